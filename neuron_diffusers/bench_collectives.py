"""Collectives per transformer forward, counted at run time (calls and bytes), and CPU step time, ours vs stock TP.

`plan report` counts collectives statically from a plan; this runs one real forward of each family's tiny
transformer on CPU ranks and counts what actually goes over the wire, with a dispatch mode that sees every
collective op whichever way it is issued (functional collectives, `torch.distributed` calls, DTensor
redistributes). Per-collective latency dominates small collectives, so calls matter as much as bytes. Step time
is the mean of a few forwards after a warm-up one, on the same inputs, with our plan and with diffusers' own.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import tiny
from .spawn import run_on_cpu_ranks

KINDS = {"all_reduce": ("all_reduce", "allreduce"), "all_gather": ("all_gather", "allgather"),
         "reduce_scatter": ("reduce_scatter",), "broadcast": ("broadcast",), "all_to_all": ("all_to_all", "alltoall")}


def _kind(op_name: str) -> str | None:
    """The collective an op issues (`None` for bookkeeping ops such as `wait_tensor`)."""
    if not op_name.startswith(("c10d", "_c10d_functional")):
        return None
    for kind, markers in KINDS.items():
        if any(marker in op_name for marker in markers):
            return kind
    return None


class CollectiveCounter(TorchDispatchMode):
    """Counts collective calls and the bytes each rank sends into them, per kind, while active."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _kind(func._schema.name)
        if kind is not None:
            self.calls[kind] += 1
            tensors = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
            self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


def _measure_plan(model, args, kwargs, repeats: int) -> dict:
    counter = CollectiveCounter()
    with torch.no_grad():
        model(*args, **kwargs)  # warm-up: lazy buffers, allocator
        with counter:
            model(*args, **kwargs)
        start = time.perf_counter()
        for _ in range(repeats):
            model(*args, **kwargs)
        seconds = (time.perf_counter() - start) / repeats
    return {"calls": dict(counter.calls), "bytes": dict(counter.bytes), "seconds_per_forward": seconds}


def _rank_job(families: list[str], tp: int, repeats: int) -> dict:
    from diffusers import TensorParallelConfig

    import neuron_diffusers as nd
    from neuron_diffusers.runner import transformer_class
    from neuron_diffusers.tp_plans import stock_plan, using_plan
    from neuron_diffusers.verify_cases import reference_call

    mesh = nd.init_distributed(tp=tp)["tp"]
    results = {}
    for family in families:
        checkpoint = tiny.cached_tiny(family)
        args, kwargs, _ = reference_call(checkpoint, family)
        cls = transformer_class(checkpoint)
        results[family] = {}
        plans = {"ours": cls._tp_plan, "stock": stock_plan(cls)}
        for label, plan in plans.items():
            if plan is None:
                results[family][label] = None  # diffusers ships no plan (MiniMax-H3)
                continue
            with using_plan(cls, plan):
                model = cls.from_pretrained(checkpoint, subfolder="transformer",
                                            parallel_config=TensorParallelConfig(mesh=mesh))
            results[family][label] = _measure_plan(model, args, kwargs, repeats)
    return results


def measure(families: list[str] | None = None, tp: int = 2, repeats: int = 5) -> dict:
    """Rank 0's counts and timings for every family (tiny checkpoints, `tp` CPU ranks over gloo)."""
    families = list(families or tiny.FAMILIES)
    for family in families:
        tiny.cached_tiny(family)  # built here, before the ranks start
    return {"tp": tp, "repeats": repeats, "families": run_on_cpu_ranks(_rank_job, tp, families, tp, repeats)[0]}


def format_table(result: dict) -> str:
    rows = [f"collectives per transformer forward at TP={result['tp']} (tiny checkpoints, CPU/gloo; step time: mean "
            f"of {result['repeats']} forwards)", "",
            "| family | plan | all-reduces | all-gathers | KiB sent | s / forward | vs stock |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for family, plans in result["families"].items():
        stock = plans.get("stock")
        for label, figures in plans.items():
            if figures is None:
                rows.append(f"| {family} | {label} | - | - | - | - | no stock plan |")
                continue
            ratio = "" if stock is None else f"{figures['seconds_per_forward'] / stock['seconds_per_forward']:.2f}x"
            rows.append(
                f"| {family} | {label} | {figures['calls'].get('all_reduce', 0)} | "
                f"{figures['calls'].get('all_gather', 0)} | {sum(figures['bytes'].values()) / 1024:.1f} | "
                f"{figures['seconds_per_forward']:.4f} | {ratio} |"
            )
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", action="append", choices=tiny.FAMILIES, help="default: all five")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per plan")
    parser.add_argument("--json", action="store_true")


def main_with(args) -> None:
    result = measure(args.family, args.tp, args.repeats)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
