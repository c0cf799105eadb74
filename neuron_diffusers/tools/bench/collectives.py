"""Collectives per transformer forward, counted at run time (calls and bytes), and CPU step time, our plans vs stock TP.

`plan report` counts collectives statically from a plan; this runs one real forward of each family's tiny
transformer on CPU ranks and counts what actually goes over the wire, with a dispatch mode that sees every
collective op whichever way it is issued (functional collectives, `torch.distributed` calls, DTensor
redistributes). Per-collective latency dominates small collectives, so calls matter as much as bytes. Step time
is the median of a few forwards after a warm-up one, on the same inputs, with each of our plans (`default`, and
`lean` where a family has one) and with diffusers' own (`stock`), timed in alternation, one thread per rank;
`--depth full` gives the tiny-width transformers the real models' block counts.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import time

import torch
from diffusers import TensorParallelConfig
from torch.utils._python_dispatch import TorchDispatchMode

from ... import tiny
from ...checkpoint import resolve
from ...compat.plans import stock_plan, using_plan
from ...distributed import init_distributed
from ...families import by_model_class
from ..plan.cases import reference_call
from ..spawn import run_on_cpu_ranks

KINDS = {"all_reduce": ("all_reduce", "allreduce"), "all_gather": ("all_gather", "allgather"),
         "reduce_scatter": ("reduce_scatter",), "broadcast": ("broadcast",), "all_to_all": ("all_to_all", "alltoall"),
         "p2p": ("send", "recv")}  # point-to-point: what a ring attention that rotates by P2P would issue


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


#: Config fields that set a transformer's depth; `--depth full` gives them the class defaults (the real models').
DEPTH_FIELDS = ("num_layers", "num_single_layers", "num_refiner_layers")


def forward_call(model, args, kwargs):
    """One forward on the captured call; a per-layer KV cache in it (Qwen-Image-2.1's first step fills one) is
    replaced by a fresh one sized for this model, so every forward does the same work at any depth."""
    fresh = {key: type(value)(len(model.transformer_blocks)) if hasattr(value, "layer_caches") else value
             for key, value in kwargs.items()}
    return model(*args, **fresh)


def _count(model, args, kwargs) -> dict:
    counter = CollectiveCounter()
    with torch.no_grad():
        forward_call(model, args, kwargs)  # warm-up: lazy buffers, allocator
        with counter:
            forward_call(model, args, kwargs)
    return {"calls": dict(counter.calls), "bytes": dict(counter.bytes)}


def _median_seconds(models: dict, args, kwargs, repeats: int) -> dict[str, float]:
    """Forwards timed in alternation, one of each plan in turn, so load from other processes hits all alike."""
    times = {label: [] for label in models}
    with torch.no_grad():
        for _ in range(repeats):
            for label, model in models.items():
                start = time.perf_counter()
                forward_call(model, args, kwargs)
                times[label].append(time.perf_counter() - start)
    return {label: sorted(values)[len(values) // 2] for label, values in times.items()}


def full_depth(cls, checkpoint) -> dict:
    """The real model's block counts (the class defaults) for the depth fields the tiny config sets."""
    config = cls.load_config(checkpoint, subfolder="transformer")
    defaults = inspect.signature(cls.__init__).parameters
    return {field: defaults[field].default for field in DEPTH_FIELDS if field in config and field in defaults}


def _sharded(cls, checkpoint, plan: dict, mesh, depth: dict):
    """The tiny transformer at `depth` (random weights, seeded: the same on every rank and for both plans)."""
    with using_plan(cls, plan):
        if not depth:
            return cls.from_pretrained(checkpoint, subfolder="transformer",
                                       parallel_config=TensorParallelConfig(mesh=mesh))
        torch.manual_seed(0)
        model = cls.from_config({**cls.load_config(checkpoint, subfolder="transformer"), **depth}).eval()
        model.enable_parallelism(config=TensorParallelConfig(mesh=mesh))
        return model


def _rank_job(families: list[str], tp: int, repeats: int, depth: str) -> dict:
    torch.set_num_threads(1)  # as torchrun does: the ranks share the host's cores (more threads each oversubscribe it)
    mesh = init_distributed(tp=tp)["tp"]
    results = {}
    for family in families:
        checkpoint = tiny.cached_tiny(family)
        args, kwargs, _ = reference_call(checkpoint, family)
        cls = resolve(checkpoint).transformer_class()
        layers = full_depth(cls, checkpoint) if depth == "full" else {}
        plans = {**by_model_class(cls.__name__).plan_variants, "stock": stock_plan(cls)}
        models = {label: _sharded(cls, checkpoint, plan, mesh, layers) for label, plan in plans.items() if plan}
        seconds = _median_seconds(models, args, kwargs, repeats)
        results[family] = {"depth": layers or "tiny"}
        for label, plan in plans.items():  # diffusers ships no MiniMax-H3 plan: None
            results[family][label] = plan and {**_count(models[label], args, kwargs),
                                               "seconds_per_forward": seconds[label]}
    return results


def measure(families: list[str] | None = None, tp: int = 2, repeats: int = 5, depth: str = "tiny") -> dict:
    """Rank 0's counts and timings for every family (tiny widths, `tp` CPU ranks over gloo).

    `depth="full"` stacks as many blocks as the real model (random weights), so counts per forward and the
    step-time ratio are the real model's; `"tiny"` loads the tiny checkpoints as they are.
    """
    families = list(families or tiny.FAMILIES)
    for family in families:
        tiny.cached_tiny(family)  # built here, before the ranks start
    results = run_on_cpu_ranks(_rank_job, tp, families, tp, repeats, depth)[0]
    for plans in results.values():  # the figures the docs quote, stored as quoted
        stock = plans.get("stock")
        for figures in plans.values():
            if isinstance(figures, dict) and "bytes" in figures:
                figures["kib_sent"] = sum(figures["bytes"].values()) / 1024
                if stock:
                    figures["vs_stock"] = figures["seconds_per_forward"] / stock["seconds_per_forward"]
    return {"tp": tp, "repeats": repeats, "depth": depth, "families": results}


def format_table(result: dict) -> str:
    rows = [f"collectives per transformer forward at TP={result['tp']} (tiny widths, {result['depth']} depth, "
            f"CPU/gloo; step time: median of {result['repeats']} forwards, the plans alternating)", "",
            "| family | plan | all-reduces | all-gathers | KiB sent | s / forward | vs stock |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for family, plans in result["families"].items():
        stock = plans.get("stock")
        for label, figures in plans.items():
            if label == "depth":
                continue
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
    parser.add_argument("--depth", choices=("tiny", "full"), default="tiny",
                        help="full: as many blocks as the real model (tiny widths, random weights)")
    parser.add_argument("--json", action="store_true")


def main(args) -> None:
    result = measure(args.family, args.tp, args.repeats, args.depth)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
