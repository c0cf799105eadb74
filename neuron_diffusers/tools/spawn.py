"""Run a function on N local CPU ranks over gloo and collect what each returns.

Used by the tests and by tools that prove a plan numerically (TP=1 vs TP=N) without torchrun.
Each rank is a fresh `spawn`ed interpreter, so `fn` must be importable (a module-level function).
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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


def run_on_cpu_ranks(fn, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """`fn(*args)` on `world_size` gloo ranks (the process group is up when it runs).

    Returns the per-rank results in rank order; raises `RuntimeError` with the failing ranks'
    tracebacks, or when a rank does not answer within `timeout_s`.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, timeout_s, args, results), daemon=True)
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
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if failures:
        raise RuntimeError("\n".join(failures))
    return [collected[r] for r in range(world_size)]
