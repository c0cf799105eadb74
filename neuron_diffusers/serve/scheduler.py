"""Rank 0's scheduling: a bounded queue of accepted requests and one dispatcher thread per replica.

A dispatcher takes the next request as soon as its replica is free, sends it over the replica's `Channel`, waits
for the answer and hands it to the waiting HTTP handler through a `concurrent.futures.Future`: replicas work
concurrently, each on one request at a time, in arrival order. A full queue is refused at once (HTTP 429) rather
than letting clients wait without bound. `stop` lets the dispatchers finish what is queued, then sends every replica
the task that ends its loop; `fail` (a rank is gone) answers everything queued and in flight with 503 at once.
"""

from __future__ import annotations

import queue
import threading
import time
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
    future: Future = field(default_factory=Future)
    queued_at: float = field(default_factory=time.perf_counter)


class Scheduler:
    def __init__(self, channels: list[Channel], max_queue: int, metrics: Metrics):
        self.channels = channels
        self.metrics = metrics
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.ready = threading.Event()
        #: Why the server cannot serve any more (a replica failed): `/health` reports it.
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._dispatch, args=(channel,), name=f"replica-{channel.replica}",
                                          daemon=True) for channel in channels]
        #: Mean seconds per request on a replica, for Retry-After (None until one finished).
        self.mean_seconds: float | None = None
        metrics.queue_depth.set_function(self.queue.qsize)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, task: dict, images: int) -> Future:
        """Queue `task` for the next free replica; raises `NotAccepting` or `QueueFull` instead of waiting."""
        if self.failure is not None:
            raise NotAccepting(f"the server is failing ({self.failure}) and exits; retry on its replacement")
        if self._stopping.is_set():
            raise NotAccepting("the server is shutting down")
        if not self.ready.is_set():
            raise NotAccepting("the server is still loading the model (see GET /ready)")
        job = Job(task, images)
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"all {len(self.channels)} replica(s) are busy and {self.queue.maxsize} request(s) are "
                            "queued") from None
        return job.future

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: one request's time per replica."""
        return max(1, round((self.mean_seconds or 1.0) * self.queue.qsize() / len(self.channels)))

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
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            if job.future.set_running_or_notify_cancel():
                job.future.set_result(self._failed())

    def _failed(self) -> dict:
        return {"error": {"status": 503, "type": "server_error", "kind": "unhealthy",
                          "message": f"the server is failing ({self.failure}) and exits; retry on its replacement"}}

    def _dispatch(self, channel: Channel) -> None:
        number = 0
        while True:
            try:
                job = self.queue.get(timeout=0.1)
            except queue.Empty:
                if self._stopping.is_set():
                    break
                continue
            if not job.future.set_running_or_notify_cancel():  # its client gave up while it was queued
                continue
            if self.failure is not None:
                job.future.set_result(self._failed())
                continue
            number += 1
            start = time.perf_counter()
            self.metrics.phase_seconds.labels("queue").inc(start - job.queued_at)
            self.metrics.busy_replicas.inc()
            try:
                channel.send_task(number, job.task)
                result = channel.receive_result(number, give_up=lambda: self.failure is not None)
                channel.forget(number)
            except Exception as error:  # a rank or the store is gone: this replica cannot serve any more
                self.failure = self.failure or f"replica {channel.replica}: {error}"
                job.future.set_result(self._failed())
                return
            finally:
                self.metrics.busy_replicas.dec()
            seconds = time.perf_counter() - start
            self.mean_seconds = seconds if self.mean_seconds is None else 0.8 * self.mean_seconds + 0.2 * seconds
            for phase, value in result.get("phases", {}).items():
                self.metrics.phase_seconds.labels(phase).inc(value)
            job.future.set_result(result)
        channel.send_task(number + 1, STOP)
