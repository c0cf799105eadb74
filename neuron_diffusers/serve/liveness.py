"""Noticing a dead rank while the server idles: heartbeats through the process group's store.

A collective notices a lost peer only while one is in flight; an idle server waits in the store for its next task,
where nothing fails when a peer is gone, so `/health` would stay 200 on a server that can no longer answer. Each
rank therefore counts up its own key every `BEAT_S` seconds (`store.add`: atomic, never blocks) from a thread, and
watches: rank 0 every other rank, the others rank 0 and the failure rank 0 announces. A counter that has not moved
for `dead_after_s` (measured on the watcher's own clock, so clocks need not agree) means its rank is gone; so does a
store that no longer answers. The watcher then calls `on_failure` (rank 0: `/health` 503, the queue answered 503),
the replica loop gives up (exit 1), and if this process is stuck in a collective with the dead peer it is ended
`EXIT_GRACE_S` later anyway. A rank that leaves normally says so first, so it is never taken for dead.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ..distributed import wait_keys
from .channel import PREFIX

#: Seconds between two heartbeats (and two looks at the others').
BEAT_S = 0.25
#: Seconds a process whose peer died may take to leave by itself before it is ended (stuck in a collective).
EXIT_GRACE_S = 5.0
FAILED = f"{PREFIX}/failed"


def _alive(rank: int) -> str:
    return f"{PREFIX}/alive/{rank}"


def _left(rank: int) -> str:
    return f"{PREFIX}/left/{rank}"


def _done(rank: int) -> str:
    return f"{PREFIX}/done/{rank}"


class Liveness:
    """This rank's heartbeat and its watch over the ranks it depends on; `failure` says why serving must end."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, dead_after_s: float,
                 on_failure: Callable[[str], None] = lambda message: None,
                 exit_process: Callable[[int], None] = os._exit):
        self.store, self.rank, self.dead_after_s = store, rank, dead_after_s
        self.watched = [r for r in range(world_size) if r != rank] if rank == 0 else [0]
        self.on_failure, self.exit_process = on_failure, exit_process
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)

    def start(self) -> Liveness:
        self.store.add(_alive(self.rank), 1)
        self._thread.start()
        return self

    def leave(self) -> None:
        """Stop beating and watching, saying so first: from now on this rank's silence is not a death."""
        self._stop.set()
        self._thread.join()
        try:
            self.store.set(_left(self.rank), "1")
        except dist.DistError:  # the store is gone: nobody is left to tell
            pass

    def leave_together(self, world_size: int, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until every rank of the world is done, still beating and watching: a rank that
        died meanwhile (a peer SIGKILLed, then torchrun's SIGTERM drained this one) ends the wait within
        `dead_after_s`, not `timeout_s`. Rank 0 says whether every other rank was done, and leaves last, once each
        has seen that: it hosts the store (the job's own, or this torchrun attempt's), which must outlive every
        rank's last look. Polls (a blocking wait would hold the store client the heartbeat needs, see `channel.py`).
        False on every rank when some rank did not come: a rank that left with 0 after a peer died would, on another
        node than the dead rank's, end that node's torchrun agent as finished, which then never rejoins the
        restarted group (measured: the two-node server never came back)."""
        deadline = time.monotonic() + timeout_s
        others = [rank for rank in range(world_size) if rank != self.rank]
        try:
            if self.rank == 0:
                together = self._wait_for([_done(r) for r in others], deadline)
                self.store.set(_done(0), "1" if together else "0")
                together = together and self._wait_for([_left(r) for r in others], deadline)
            else:
                self.store.set(_done(self.rank), "1")
                together = self._wait_for([_done(0)], deadline) and self.store.get(_done(0)) == b"1"
            self.store.set(_left(self.rank), "1")  # from now on this rank's silence is not a death
        except dist.DistError:  # the store's host is gone
            together = False
        self._stop.set()
        self._thread.join()
        return together

    def _wait_for(self, keys: list[str], deadline: float) -> bool:
        return wait_keys(self.store, keys, deadline - time.monotonic(), give_up=lambda: self.failure is not None)

    def _run(self) -> None:
        seen = {rank: (-1, time.monotonic()) for rank in self.watched}
        while not self._stop.wait(BEAT_S):
            try:
                self.store.add(_alive(self.rank), 1)
                failure = self._look(seen)
            except dist.DistError as error:  # the store's host (rank 0, or torchrun's agent) is gone
                failure = f"the process group's store does not answer ({error})"
            if failure is not None and not self._stop.is_set():
                self._fail(failure)
                return

    def _look(self, seen: dict[int, tuple[int, float]]) -> str | None:
        if self.rank != 0 and self.store.check([FAILED]):
            return self.store.get(FAILED).decode()
        now = time.monotonic()
        for rank, (count, since) in seen.items():
            current = self.store.add(_alive(rank), 0)
            if current != count:
                seen[rank] = (current, now)
            elif now - since > self.dead_after_s and not self.store.check([_left(rank)]):
                return (f"rank {rank} is gone: no heartbeat for {now - since:.1f} s (--peer-timeout "
                        f"{self.dead_after_s:g})")
        return None

    def _fail(self, failure: str) -> None:
        self.failure = failure
        try:
            if self.rank == 0:
                self.store.set(FAILED, failure)  # every other rank learns it at its next look
        except dist.DistError:
            pass
        self.on_failure(failure)
        # Logged once `/health` already says so: whoever reads this line finds the server failing, never healthy.
        print(f"neuron-diffusers serve: error on rank {self.rank}: {failure}; stopping", file=sys.stderr, flush=True)
        # The replica loop notices `failure` within a poll and returns; a rank stuck in a collective with the dead
        # peer (NCCL and Neuron wait for the collective timeout) is ended here instead.
        if not self._stop.wait(EXIT_GRACE_S):
            sys.stderr.flush()
            self.exit_process(1)
