"""Rank 0's scheduling: a bounded queue of accepted requests and one dispatcher thread per replica.

A dispatcher takes the next request as soon as its replica is free, sends it over the replica's `Channel`, waits
for the answer and hands it to the waiting HTTP handler through a `concurrent.futures.Future`: replicas work
concurrently, in arrival order. With `--max-batch N` a dispatcher takes with its request the compatible ones queued
(equal `Work.batch_key`) up to N images, waiting up to `--batch-wait-ms` for more, and its replica makes them in one
batched `generate` call (`replica.py`); each still gets its own answer (a later compatible request may thus be made
before an earlier incompatible one, which the next free replica takes first). A full queue is refused at once (HTTP
429) rather than letting clients wait without bound. `stop` lets the dispatchers finish what is queued, then sends
every replica the task that ends its loop; `fail` (a rank is gone) answers everything queued and in flight with 503
at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

from .channel import STOP, Channel
from .metrics import Metrics


class QueueFull(Exception):
    """Every replica is busy and the queue holds `max_queue` requests already."""


class NotAccepting(Exception):
    """The server is loading (not ready yet) or shutting down."""


@dataclass
class Job:
    task: dict
    images: int
    #: Jobs with equal keys may share one batched call (`Work.batch_key`); None: made alone.
    key: Hashable | None = None
    future: Future = field(default_factory=Future)
    queued_at: float = field(default_factory=time.perf_counter)


class Scheduler:
    def __init__(self, channels: list[Channel], max_queue: int, metrics: Metrics, max_batch: int = 1,
                 batch_wait_s: float = 0.0):
        self.channels = channels
        self.metrics = metrics
        self.max_queue, self.max_batch, self.batch_wait_s = max_queue, max_batch, batch_wait_s
        self._pending: deque[Job] = deque()
        #: Notified whenever a job is queued (a dispatcher waiting for its first job, or for batch-mates).
        self._changed = threading.Condition()
        self.ready = threading.Event()
        #: Why the server cannot serve any more (a replica failed): `/health` reports it.
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._dispatch, args=(channel,), name=f"replica-{channel.replica}",
                                          daemon=True) for channel in channels]
        #: Mean seconds per replica task, for Retry-After (None until one finished).
        self.mean_seconds: float | None = None
        metrics.queue_depth.set_function(self.queued)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def queued(self) -> int:
        """Requests waiting for a free replica."""
        return len(self._pending)

    def submit(self, task: dict, images: int, key: Hashable | None = None) -> Future:
        """Queue `task` for the next free replica; raises `NotAccepting` or `QueueFull` instead of waiting."""
        if self.failure is not None:
            raise NotAccepting(f"the server is failing ({self.failure}) and exits; retry on its replacement")
        if self._stopping.is_set():
            raise NotAccepting("the server is shutting down")
        if not self.ready.is_set():
            raise NotAccepting("the server is still loading the model (see GET /ready)")
        job = Job(task, images, key)
        with self._changed:
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"all {len(self.channels)} replica(s) are busy and {self.max_queue} request(s) are "
                                "queued")
            self._pending.append(job)
            self._changed.notify_all()
        return job.future

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: one task's time per replica."""
        return max(1, round((self.mean_seconds or 1.0) * self.queued() / len(self.channels)))

    def stop(self) -> None:
        """Finish the queued requests, then end every replica's loop; returns when every dispatcher is done."""
        self._stopping.set()
        for thread in self._threads:
            thread.join()

    def fail(self, failure: str) -> None:
        """A rank is gone (see `liveness.py`): `/health` says so, and no request waits for an answer that cannot come
        (every queued one and each one in flight is answered 503)."""
        self.failure = failure
        self._stopping.set()
        with self._changed:
            jobs, self._pending = list(self._pending), deque()
            self._changed.notify_all()
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_result(self._failed())

    def _failed(self) -> dict:
        return {"error": {"status": 503, "type": "server_error", "kind": "unhealthy",
                          "message": f"the server is failing ({self.failure}) and exits; retry on its replacement"}}

    def _next_batch(self) -> list[Job]:
        """The next queued job and the compatible ones queued with it (up to `max_batch` images, waiting at most
        `batch_wait_s` for more), or [] after 0.1 s without any job."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._pending, timeout=0.1):
                return []
            batch = [self._pending.popleft()]
            if batch[0].key is None or self.max_batch == 1:
                return batch
            deadline = time.monotonic() + self.batch_wait_s
            while True:
                images = self._join(batch)
                left = deadline - time.monotonic()
                if images >= self.max_batch or left <= 0 or self._stopping.is_set():
                    return batch
                self._changed.wait(left)

    def _join(self, batch: list[Job]) -> int:
        """Move the queued jobs compatible with `batch` that still fit into it, in arrival order; its images."""
        images = sum(job.images for job in batch)
        for job in list(self._pending):
            if job.key == batch[0].key and images + job.images <= self.max_batch:
                self._pending.remove(job)
                batch.append(job)
                images += job.images
        return images

    def _task(self, batch: list[Job]) -> dict:
        """What the replica makes: one request's task, or (`replica.make`) several in one batched call."""
        if len(batch) > 1:
            return {"batch": [job.task for job in batch], "batch_size": self.max_batch}
        job = batch[0]
        return job.task if job.key is None or self.max_batch == 1 else {**job.task, "batch_size": self.max_batch}

    def _dispatch(self, channel: Channel) -> None:
        number = 0
        while True:
            batch = self._next_batch()
            if not batch:
                if self._stopping.is_set():
                    break
                continue
            # A job whose client gave up while it was queued is left out.
            batch = [job for job in batch if job.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            if self.failure is not None:
                for job in batch:
                    job.future.set_result(self._failed())
                continue
            number += 1
            if not self._run(channel, number, batch):
                return
        channel.send_task(number + 1, STOP)

    def _run(self, channel: Channel, number: int, batch: list[Job]) -> bool:
        """Task `number` on `channel`: every job of `batch` answered; False when the replica cannot serve any more."""
        start = time.perf_counter()
        for job in batch:
            self.metrics.phase_seconds.labels("queue").inc(start - job.queued_at)
        self.metrics.busy_replicas.inc()
        try:
            channel.send_task(number, self._task(batch))
            result = channel.receive_result(number, give_up=lambda: self.failure is not None)
            channel.forget(number)
        except Exception as error:  # a rank or the store is gone: this replica cannot serve any more
            self.failure = self.failure or f"replica {channel.replica}: {error}"
            for job in batch:
                job.future.set_result(self._failed())
            return False
        finally:
            self.metrics.busy_replicas.dec()
        seconds = time.perf_counter() - start
        self.mean_seconds = seconds if self.mean_seconds is None else 0.8 * self.mean_seconds + 0.2 * seconds
        for phase, value in result.get("phases", {}).items():
            self.metrics.phase_seconds.labels(phase).inc(value)
        self._count(batch, together=result.get("together", True))
        for job, answer in zip(batch, result.get("answers", [result]), strict=True):
            job.future.set_result(answer)
        return True

    def _count(self, batch: list[Job], together: bool) -> None:
        """The batch sizes metric: one call of the whole batch, or (a batch-mate failed) one call per request."""
        for group in [batch] if together else [[job] for job in batch]:
            self.metrics.batches.labels(str(len(group)), str(sum(job.images for job in group))).inc()
