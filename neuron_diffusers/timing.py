"""Seconds per phase of a run (load, encode, denoise, decode, ...), accumulated where they happen.

Phases inside a stock pipeline call (the VAE decode, each transformer forward) are timed with named diffusers
hooks on those modules (`neuron_diffusers.timing.<phase>`), so no pipeline code is copied to put a timer around
them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from diffusers.hooks import HookRegistry, ModelHook


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

    def time_module(self, module: torch.nn.Module, name: str) -> None:
        """Count `module`'s forwards as phase `name`."""
        HookRegistry.check_if_exists_or_initialize(module).register_hook(_PhaseHook(self, name),
                                                                        f"neuron_diffusers.timing.{name}")

    def as_dict(self) -> dict:
        return {name: {"seconds": round(seconds, 4), "calls": self.calls[name]}
                for name, seconds in self.seconds.items()}


class _PhaseHook(ModelHook):
    def __init__(self, times: PhaseTimes, name: str):
        super().__init__()
        self.times, self.name, self.starts = times, name, []

    def pre_forward(self, module, *args, **kwargs):
        self.starts.append(time.perf_counter())
        return args, kwargs

    def post_forward(self, module, output):
        self.times.seconds[self.name] += time.perf_counter() - self.starts.pop()
        self.times.calls[self.name] += 1
        return output
