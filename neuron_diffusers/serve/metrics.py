"""The server's Prometheus metrics, in a registry of its own (so tests and a second server in one process never
share counters): queue depth, busy replicas, images, requests by status, errors by kind, seconds per phase,
batch sizes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "neuron_diffusers"


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "requests waiting for a free replica",
                                 registry=self.registry)
        self.busy_replicas = Gauge(f"{PREFIX}_busy_replicas", "replicas generating a request now",
                                   registry=self.registry)
        self.images = Counter(f"{PREFIX}_images", "images generated and returned", registry=self.registry)
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests answered, by path and status",
                                ["path", "status"], registry=self.registry)
        self.errors = Counter(f"{PREFIX}_errors", "refused or failed generation requests, by kind", ["kind"],
                              registry=self.registry)
        self.phase_seconds = Counter(f"{PREFIX}_phase_seconds", "seconds spent per phase, summed over requests "
                                     "(queue: waiting for a replica; the others on the replica's leader)", ["phase"],
                                     registry=self.registry)
        self.batches = Counter(f"{PREFIX}_batches", "replica tasks, by the requests and images made in them "
                               "together (--max-batch: compatible requests share one batched generate call; a batch "
                               "one of whose requests failed counts as its requests made one by one)",
                               ["requests", "images"], registry=self.registry)
        self.latency = Histogram(f"{PREFIX}_request_seconds", "seconds from a generation request's arrival to its "
                                 "answer", registry=self.registry,
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600))

    def text(self) -> bytes:
        return generate_latest(self.registry)
