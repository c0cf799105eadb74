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


def _raise_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(f"injected failure on rank {bad_rank}")
    return "fine"


def _pid():
    import torch.distributed as dist

    dist.barrier()  # the group still works
    return os.getpid()


def _hang_on_rank_1():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(3600)
    return "rank 0 done"


class _SessionPool:
    """The session's 2 ranks as a `RankPool` (`run(fn, *args)`): already up, so only the ranks these tests kill are
    spawned again (each spawn costs seconds of imports), and the jobs after them find fresh ranks as any would."""

    def __init__(self, pools):
        self.pools = pools

    def run(self, fn, *args, timeout_s: float = 300.0):
        return self.pools.run(fn, 2, *args, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def pool(rank_pool):
    return _SessionPool(rank_pool)


def test_a_pool_runs_jobs_on_the_same_ranks(pool):
    assert pool.run(_rank_and_world) == [(0, 2), (1, 2)]
    assert pool.run(_pid) == pool.run(_pid)


def test_a_job_that_raises_reports_the_rank_and_leaves_the_pool_as_it_was(pool):
    pids = pool.run(_pid)
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*ValueError: injected failure on rank 1"):
        pool.run(_raise_on_rank, 1)
    assert pool.run(_pid) == pids


def test_a_rank_that_hangs_fails_its_job_and_the_next_job_gets_fresh_ranks(pool):
    pids = pool.run(_pid)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] gave no result within 5 s"):
        pool.run(_hang_on_rank_1, timeout_s=5)
    fresh = pool.run(_pid)
    assert set(fresh).isdisjoint(pids)


def test_a_rank_that_dies_fails_its_job_and_the_next_job_gets_fresh_ranks(pool):
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3 without a result"):
        pool.run(_rank_1_dies)
    assert pool.run(_rank_and_world) == [(0, 2), (1, 2)]


def test_a_case_that_raises_fails_only_the_test_that_reads_it():
    from rank_cases import case, record

    report = {}
    record(report, "fine", lambda: 1)
    record(report, "broken", lambda: 1 / 0)
    assert case([report, report], "fine") == [1, 1]
    with pytest.raises(pytest.fail.Exception, match="rank 0: case 'broken' raised:(.|\n)*ZeroDivisionError"):
        case([report, report], "broken")
