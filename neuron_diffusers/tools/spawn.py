"""Run a function on N local CPU ranks over gloo and collect what each returns.

Used by the tests and by tools that prove a plan numerically (TP=1 vs TP=N) without torchrun.
Each rank is a fresh `spawn`ed interpreter, so `fn` must be importable (a module-level function); the families
registered from outside the package (`families.register`) are registered there again before it runs.
A rank ends in the job's fixed order (`distributed.exit_process`): result flushed to the parent, every rank past
its last collective, process group destroyed, `os._exit`; a normal interpreter exit could abort in a gloo thread.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from .. import families
from ..distributed import exit_process, leave_together


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: How long a finished rank waits for its peers before tearing the process group down anyway.
_LEAVE_TIMEOUT_S = 30.0


def _rank_main(fn, rank, world_size, port, timeout_s, args, results, outside=()) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        for family in outside:  # a fresh interpreter knows only our families: the parent's others too
            families.register(family)
        # Plain pickle: torch's queue reducers pass tensors by shared-memory handles, which die
        # with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # reported to the parent, which raises it with the rank named
        results.put((rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()  # the result is in the pipe before this process may end
    leave_together(min(timeout_s, _LEAVE_TIMEOUT_S))
    exit_process(0)


def _record(rank, ok, payload, collected, failures, reported) -> None:
    reported.add(rank)
    if ok:
        collected[rank] = pickle.loads(payload)
    else:
        failures.append(f"rank {rank} failed:\n{payload}")


def _drain(results, collected, failures, reported, grace_s: float) -> None:
    """Record whatever results are still in flight."""
    try:
        while True:
            _record(*results.get(timeout=grace_s), collected, failures, reported)
    except queue.Empty:
        pass


def run_on_cpu_ranks(fn, world_size: int, *args, timeout_s: float = 300.0,
                     collective_timeout_s: float | None = None) -> list:
    """`fn(*args)` on `world_size` gloo ranks (the process group is up when it runs).

    Returns the per-rank results in rank order; raises `RuntimeError` with the failing ranks'
    tracebacks, or when a rank does not answer within `timeout_s`. `collective_timeout_s` (default
    `timeout_s`) bounds each collective, as `init_distributed(timeout_s=...)` does.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    collective = timeout_s if collective_timeout_s is None else collective_timeout_s
    procs = [
        ctx.Process(target=_rank_main, daemon=True,
                    args=(fn, r, world_size, port, collective, args, results, families.outside_families()))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected, failures, reported = {}, [], set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(reported) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died without reporting (killed, or a script without a `__main__` guard) would
                # otherwise keep the others waiting for the whole timeout.
                dead = [r for r, proc in enumerate(procs) if r not in reported and proc.exitcode is not None]
                if dead:
                    _drain(results, collected, failures, reported, grace_s=2.0)  # it may have reported, then exited
                    dead = [r for r in dead if r not in reported]
                if dead:
                    failures.append(", ".join(f"rank {r} exited with code {procs[r].exitcode} without a result"
                                              for r in dead))
                    break
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - reported)
                    failures.append(f"ranks {missing} gave no result within {timeout_s:.0f} s")
                    break
                continue
            _record(rank, ok, payload, collected, failures, reported)
    finally:
        for proc in procs:
            proc.join(timeout=1 if failures else 10)  # after a failure the others may wait for a dead peer
            if proc.is_alive():
                proc.kill()
    if failures:
        raise RuntimeError("\n".join(failures))
    return [collected[r] for r in range(world_size)]


def _pool_rank_main(rank, world_size, port, timeout_s, jobs, results) -> None:
    """One rank of a `RankPool`: join the group once, then run jobs until the `None` sentinel, then leave as a job's
    rank does (`leave_together`, `exit_process`)."""
    import gc

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    except BaseException:
        results.put((None, rank, False, traceback.format_exc()))
        exit_process(1)
    while (item := jobs.get()) is not None:
        job, fn, args = item
        try:
            results.put((job, rank, True, pickle.dumps(fn(*args))))
        except BaseException:  # reported to the parent; this rank takes the next job
            results.put((job, rank, False, traceback.format_exc()))
        gc.collect()  # the job's models go now, not while the next job counts what is in memory
    results.close()
    results.join_thread()
    leave_together(min(timeout_s, _LEAVE_TIMEOUT_S))
    exit_process(0)


class RankPool:
    """`world_size` gloo ranks spawned once and kept alive, which run jobs one at a time (`run`).

    Spawning ranks costs seconds of imports each time; a test suite that submits many small jobs pays it once. A job
    that raises on every rank leaves the pool as it was (each rank reports its traceback and takes the next job). A
    job that leaves some rank behind (it died, hung, or had not answered `failure_grace_s` after a peer failed, so it
    may be stuck in a collective) closes the pool: the next `run` starts fresh ranks. `collective_timeout_s` bounds
    every collective of the ranks' process group.
    """

    def __init__(self, world_size: int, *, collective_timeout_s: float = 120.0, failure_grace_s: float = 10.0):
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.failure_grace_s = failure_grace_s
        self._procs: list = []
        self._jobs: list = []
        self._results = None
        self._next_job = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(target=_pool_rank_main, daemon=True,
                        args=(r, self.world_size, port, self.collective_timeout_s, self._jobs[r], self._results))
            for r in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, fn, *args, timeout_s: float = 300.0) -> list:
        """`fn(*args)` on every rank (the process group is up); the per-rank results in rank order.

        Raises `RuntimeError` with each failing rank's traceback, or naming the ranks that died or gave no result
        within `timeout_s`. `fn` must be importable (a module-level function).
        """
        if not self._procs:
            self._start()
        job, self._next_job = self._next_job, self._next_job + 1
        for jobs in self._jobs:
            jobs.put((job, fn, args))
        collected, failures, complete = self._collect(job, timeout_s)
        if not complete:
            self._kill()  # a rank may be dead or stuck in a collective: fresh ranks for the next job
        if failures:
            raise RuntimeError("\n".join(failures))
        return [collected[r] for r in range(self.world_size)]

    def _collect(self, job: int, timeout_s: float) -> tuple[dict, list, bool]:
        """Every rank's answer to `job`: (results by rank, failure messages, whether every rank answered)."""
        collected, failures, reported = {}, [], set()
        deadline = time.monotonic() + timeout_s
        while len(reported) < self.world_size:
            try:
                answer, rank, ok, payload = self._results.get(timeout=1.0)
            except queue.Empty:
                problem = self._stalled(reported, failures, deadline, timeout_s)
                if problem:
                    failures.append(problem)
                    return collected, failures, False
                continue
            if answer in (job, None):  # None: the rank could not join the process group
                _record(rank, ok, payload, collected, failures, reported)
                if failures:
                    deadline = min(deadline, time.monotonic() + self.failure_grace_s)
        return collected, failures, True

    def _stalled(self, reported: set, failures: list, deadline: float, timeout_s: float) -> str | None:
        """Why waiting longer is pointless (a rank died, or the deadline passed), or None."""
        missing = sorted(set(range(self.world_size)) - reported)
        dead = [r for r in missing if self._procs[r].exitcode is not None]
        if dead:
            return ", ".join(f"rank {r} exited with code {self._procs[r].exitcode} without a result" for r in dead)
        if time.monotonic() > deadline:
            grace = self.failure_grace_s
            waited = f"within {grace:.0f} s of a failed peer" if failures else f"within {timeout_s:.0f} s"
            return f"ranks {missing} gave no result {waited} (the pool restarts for the next job)"
        return None

    def _kill(self) -> None:
        """End every rank now: one is dead or stuck, so the safe way out (`leave_together`) would only wait."""
        for proc in self._procs:
            proc.kill()
            proc.join(timeout=5)
        self._procs, self._jobs, self._results = [], [], None

    def close(self) -> None:
        """Stop the ranks the safe way (each leaves through `exit_process`); kill those that do not stop."""
        for jobs in self._jobs:
            try:
                jobs.put(None)
            except (OSError, ValueError):  # its queue is already closed
                pass
        for proc in self._procs:
            proc.join(timeout=_LEAVE_TIMEOUT_S + 5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._jobs, self._results = [], [], None


class RankPools:
    """One `RankPool` per world size, started on first use: `pools.run(fn, world_size, *args, timeout_s=...)`."""

    def __init__(self, **pool_options):
        self._options = pool_options
        self._pools: dict[int, RankPool] = {}

    def run(self, fn, world_size: int, *args, timeout_s: float = 300.0) -> list:
        """`RankPool.run` on the pool of `world_size` ranks (same signature as `run_on_cpu_ranks`)."""
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size, **self._options)
        return self._pools[world_size].run(fn, *args, timeout_s=timeout_s)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
