"""Seconds per phase of a run (load, encode, denoise, decode, ...), accumulated where they happen.

Phases inside a stock pipeline call (the VAE decode, each transformer forward) are timed with module hooks, so
no pipeline code is copied to put a timer around them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimes:
    """`seconds[phase]` and `calls[phase]`, summed over a run."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def time_module(self, module: torch.nn.Module, name: str) -> list:
        """Count `module`'s forwards as phase `name`; returns the hook handles."""
        starts = []

        def before(*_):
            starts.append(time.perf_counter())

        def after(*_):
            self.seconds[name] += time.perf_counter() - starts.pop()
            self.calls[name] += 1

        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def as_dict(self) -> dict:
        return {name: {"seconds": round(seconds, 4), "calls": self.calls[name]} for name, seconds in self.seconds.items()}
