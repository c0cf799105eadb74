"""`bench vae`'s measurement of one decode: the peak memory above the start, read from the process's own counters."""

import torch

from neuron_diffusers.tools.bench.vae import _measured


def test_a_decode_that_allocates_64_mib_peaks_at_least_that_much_above_the_start():
    def decode():
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB of float32, every page touched
        assert block.sum() > 0

    figures = _measured(decode)
    assert 60 < figures["peak_mib"] < 200, figures
    assert figures["s"] > 0 and figures["cpu_s"] >= 0
