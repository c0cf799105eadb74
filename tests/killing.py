"""Kill one rank of a torchrun job mid-run, as the dead-rank tests of the job (test_cli) and of torchrun's elastic
restart (test_multinode) both need."""

import os
import signal
import time

import psutil


def _worker_pids(launcher: psutil.Process) -> list[int]:
    return [p.pid for p in launcher.children(recursive=True) if "neuron_diffusers" in " ".join(p.cmdline())]


def kill_rank_1_after_first_image(launcher, out, timeout_s: float) -> None:
    """Wait (at most `timeout_s`) until the job in `launcher` (a 2-rank torchrun `Popen`) has written a PNG into `out`,
    then SIGKILL its last-started worker, rank 1."""
    deadline = time.monotonic() + timeout_s
    while not list(out.glob("*.png")) and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.05)
    workers = _worker_pids(psutil.Process(launcher.pid))
    assert list(out.glob("*.png")) and len(workers) == 2, "the job did not reach its first image"
    os.kill(max(workers), signal.SIGKILL)
