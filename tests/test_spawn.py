"""`run_on_cpu_ranks`: results in rank order, and a rank that dies without reporting fails the call at once."""

import os

import pytest

from neuron_diffusers.tools.spawn import run_on_cpu_ranks


def _rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _rank_1_dies():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    return "rank 0 done"


def test_results_come_back_in_rank_order():
    assert run_on_cpu_ranks(_rank_and_world, 2) == [(0, 2), (1, 2)]


def test_a_rank_that_dies_without_a_result_is_named_without_waiting_for_the_timeout():
    # The message names the dead rank; waiting out the timeout would say "gave no result within 300 s".
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3 without a result"):
        run_on_cpu_ranks(_rank_1_dies, 2, timeout_s=300)
