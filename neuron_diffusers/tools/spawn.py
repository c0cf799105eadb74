"""Run a function on N local CPU ranks over gloo and collect what each returns.

Used by the tests and by tools that prove a plan numerically (TP=1 vs TP=N) without torchrun.
Each rank is a fresh `spawn`ed interpreter, so `fn` must be importable (a module-level function).
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

from ..distributed import exit_process, leave_together


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: How long a finished rank waits for its peers before tearing the process group down anyway.
_LEAVE_TIMEOUT_S = 30.0


def _rank_main(fn, rank, world_size, port, timeout_s, args, results) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
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
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, collective, args, results), daemon=True)
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
