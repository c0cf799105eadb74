"""One image on N ranks: denoising step time of TP=N vs Ulysses=N vs ring=N vs one process, side by side in one run,
with the collectives each transformer forward issues, by kind (all-reduce, all-gather, all-to-all, P2P).

One family's tiny pipeline (or a checkpoint) runs on N spawned CPU ranks, one thread each (as `torchrun` sets it),
four ways over the same ranks: the transformer sharded over heads (`tp=N`), its sequence split with Ulysses
(`ulysses=N`) or ring attention (`ring=N`), and every rank alone with its own copy (`tp=1`: the single-thread
reference). Pick a size where attention dominates (context parallelism splits the sequence, so it gains where the
sequence is long: compute-bound); at tiny sizes every layout is latency-bound and the collectives decide.

A step is the seconds spent in the stock denoising loop (latent output, no decode) divided by the steps, as the mean
over `--repeats` generations after one warm-up generation, the four layouts loaded side by side and timed in
alternation. Collectives are counted over one transformer forward of the warm-up generation. What it prints is
measured, not modelled.
"""

from __future__ import annotations

import argparse
import json

import torch

from ... import tiny
from ...distributed import init_distributed
from ...runner import load_pipeline
from ..spawn import run_on_cpu_ranks
from .collectives import CollectiveCounter

PROMPT = "a red fox in the snow"


def count_forward(transformer) -> tuple[CollectiveCounter, list]:
    """A counter that is active during the transformer's next forward only.

    Plain torch hooks (not diffusers' registry): they must sit outside the CP hooks diffusers registered, around the
    whole forward, and come off again after one call.
    """
    counter = CollectiveCounter()
    handles = []

    def start(module, args):
        counter.__enter__()

    def stop(module, args, output):
        counter.__exit__(None, None, None)
        for handle in handles:
            handle.remove()

    handles += [transformer.register_forward_pre_hook(start), transformer.register_forward_hook(stop)]
    return counter, handles


def _rank_bench(model, ranks: int, call: dict, repeats: int) -> dict:
    """Every layout loaded side by side on these ranks, then timed in alternation (one generation of each per
    round), so load from other processes hits all alike; collectives counted over each one's warm-up forward."""
    torch.set_num_threads(1)
    layouts = {f"tp={ranks}": {"tp": ranks}, f"ulysses={ranks}": {"tp": 1, "ulysses": ranks},
               f"ring={ranks}": {"tp": 1, "ring": ranks}, "one process (tp=1, each rank alone)": {"tp": 1}}
    pipes = {label: load_pipeline(model, init_distributed(**mesh_kwargs)) for label, mesh_kwargs in layouts.items()}
    kwargs = dict(call, output_type="latent")
    counters, start = {}, {}
    for label, pipe in pipes.items():
        counters[label], _ = count_forward(pipe.adapter.transformer_of(pipe.pipe))
        pipe.generate(PROMPT, seed=0, **kwargs)  # warm-up: lazy buffers, allocator; counts the first forward
        start[label] = pipe.times.seconds.get("denoise + decode", 0.0)
    for _ in range(repeats):
        for pipe in pipes.values():
            pipe.generate(PROMPT, seed=0, **kwargs)
    steps = call["num_inference_steps"] * repeats
    return {label: {"step_seconds": (pipe.times.seconds["denoise + decode"] - start[label]) / steps,
                    "calls": dict(counters[label].calls), "bytes": dict(counters[label].bytes)}
            for label, pipe in pipes.items()}


def measure(model: str, ranks: int, steps: int, size: int, repeats: int) -> dict:
    """Rank 0's figures for every layout of `ranks` CPU ranks on one image of `size` x `size`."""
    if ranks < 2:
        raise ValueError(f"--ranks {ranks}: comparing layouts needs at least 2 ranks.")
    if model in tiny.FAMILIES:
        model = str(tiny.cached_tiny(model))  # built here, before the ranks start
    call = {"height": size, "width": size, "num_inference_steps": steps}
    per_rank = run_on_cpu_ranks(_rank_bench, ranks, model, ranks, call, repeats, timeout_s=1800)
    layouts = per_rank[0]
    single = next(v for k, v in layouts.items() if k.startswith("one process"))["step_seconds"]
    for figures in layouts.values():
        figures["vs_one_process"] = figures["step_seconds"] / single  # the ratio the docs quote, stored with it
    return {"model": model, "ranks": ranks, "size": size, "steps": steps, "repeats": repeats, "layouts": layouts}


KINDS = {"all_reduce": "all-reduces", "all_gather": "all-gathers", "all_to_all": "all-to-alls", "p2p": "P2P"}


def format_table(result: dict) -> str:
    single = next(v for k, v in result["layouts"].items() if k.startswith("one process"))["step_seconds"]
    rows = [f"one {result['size']}x{result['size']} image on {result['ranks']} CPU ranks (gloo, one thread each), "
            f"{result['model']}: step time (mean of {result['repeats']} generations of {result['steps']} steps, "
            "layouts alternating) and collectives per transformer forward on rank 0", "",
            "| layout | s / step | vs one process | " + " | ".join(KINDS.values())
            + " | KiB sent |", "|---|---:|---:|" + "---:|" * len(KINDS) + "---:|"]
    for label, figures in result["layouts"].items():
        counts = " | ".join(str(figures["calls"].get(kind, 0)) for kind in KINDS)
        rows.append(f"| {label} | {figures['step_seconds']:.4f} | {figures['step_seconds'] / single:.2f}x | {counts} "
                    f"| {sum(figures['bytes'].values()) / 1024:.1f} |")
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="flux2", help="a tiny family name (default flux2) or a checkpoint folder")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size", type=int, default=512, help="image height and width (default 512: attention-bound)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per layout")
    parser.add_argument("--json", action="store_true")


def main(args) -> None:
    result = measure(args.model, args.ranks, args.steps, args.size, args.repeats)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
