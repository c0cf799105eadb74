"""Rank 0 and a replica's ranks talk through the process group's key-value store, one numbered task at a time.

The store (torchrun's TCP store, the same under gloo, NCCL and Neuron) rather than a collective, because a replica
waits for work for as long as the server is idle: a collective waiting that long would hit the collective timeout,
and a store read can be retried without leaving anything pending. Every rank of replica r reads task n of r from
`neuron_diffusers/serve/<r>/<n>/task` (so all of them get the very same request), and the replica's leader (the one
rank `generate` returns images on) answers under `.../result`. Readers poll (`check`, then a short sleep) instead of
a blocking `wait`: rank 0's store client is shared by its dispatchers and its own replica's loop, and a blocking wait
holds the client's lock for its whole duration; a wait that times out also logs a warning in C++ every time.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable

import torch.distributed as dist

PREFIX = "neuron_diffusers/serve"
#: The task that ends a replica's loop.
STOP = {"stop": True}
#: Seconds between two looks at the store: from the first, growing while nothing comes, to the last.
POLL_S = (0.001, 0.01)


class Channel:
    """Tasks to replica `replica` and its answers, over `store`."""

    def __init__(self, replica: int, store: dist.Store):
        self.replica, self.store = replica, store

    def _key(self, number: int, what: str) -> str:
        return f"{PREFIX}/{self.replica}/{number}/{what}"

    def send_task(self, number: int, task: dict) -> None:
        self.store.set(self._key(number, "task"), pickle.dumps(task))

    def receive_task(self, number: int, give_up: Callable[[], bool] = lambda: False) -> dict:
        return self._receive(self._key(number, "task"), give_up)

    def send_result(self, number: int, result: dict) -> None:
        self.store.set(self._key(number, "result"), pickle.dumps(result))

    def receive_result(self, number: int, give_up: Callable[[], bool] = lambda: False) -> dict:
        return self._receive(self._key(number, "result"), give_up)

    def forget(self, number: int) -> None:
        """Drop task `number` and its answer (rank 0, once it has the answer: every rank of the replica has read
        the task by then, since `generate` returned on its leader only after all of them entered it)."""
        for what in ("task", "result"):
            self.store.delete_key(self._key(number, what))

    def _receive(self, key: str, give_up: Callable[[], bool]) -> dict:
        pause = POLL_S[0]
        while not self.store.check([key]):
            if give_up():
                raise TimeoutError(f"gave up waiting for {key}")
            time.sleep(pause)
            pause = min(pause * 1.5, POLL_S[1])
        return pickle.loads(self.store.get(key))
