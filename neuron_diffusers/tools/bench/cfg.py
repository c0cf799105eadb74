"""CFG parallelism: denoising step time of cfg-parallel vs serial CFG on the same ranks, and forwards per rank.

One family's tiny pipeline (or a checkpoint) runs with a negative prompt and `true_cfg_scale` on N spawned CPU ranks,
one thread each (as `torchrun` sets it), three ways:

- serial CFG over the N ranks as one TP group (`tp=N`): cond, then uncond, each sharded N ways;
- CFG-parallel over the same N ranks (`cfg=2 x tp=N/2`): cond and uncond at once, each sharded N/2 ways;
- serial CFG on one rank alone (`tp=1`, every rank its own copy): the single-thread reference.

A step is the seconds spent in the stock denoising loop (latent output, no decode) divided by the steps, as the
mean over `--repeats` generations after one warm-up generation. What it prints is measured, not modelled.
"""

from __future__ import annotations

import argparse
import json

import torch

from ... import families
from ...distributed import init_distributed
from ...runner import load_pipeline
from ..spawn import run_on_cpu_ranks

#: The families with true CFG (a negative prompt), the ones CFG parallelism speeds up.
FAMILIES = tuple(f.name for f in families.FAMILIES if f.adapter is not None and f.adapter.takes_negative_prompt)
PROMPT, NEGATIVE = "a red fox in the snow", "blurry, low quality"


def _measure_mode(model, mesh_kwargs: dict, call: dict, repeats: int) -> dict:
    """Step seconds and real transformer forwards per image on this rank, for one mesh layout."""
    mesh = init_distributed(**mesh_kwargs)
    pipe = load_pipeline(model, mesh)
    kwargs = dict(call, negative_prompt=NEGATIVE, output_type="latent")
    pipe.generate(PROMPT, seed=0, **kwargs)  # warm-up: lazy buffers, allocator
    seconds = pipe.times.seconds.get("denoise + decode", 0.0)
    forwards = pipe.times.calls.get("transformer forward", 0)
    for _ in range(repeats):
        pipe.generate(PROMPT, seed=0, **kwargs)
    steps = call["num_inference_steps"] * repeats
    return {"step_seconds": (pipe.times.seconds["denoise + decode"] - seconds) / steps,
            "forwards_per_image": (pipe.times.calls["transformer forward"] - forwards) / repeats}


def _rank_bench(model, ranks: int, call: dict, repeats: int) -> dict:
    torch.set_num_threads(1)
    return {
        f"serial CFG, tp={ranks}": _measure_mode(model, {"tp": ranks}, call, repeats),
        f"CFG-parallel, cfg=2 x tp={ranks // 2}": _measure_mode(model, {"tp": ranks // 2, "cfg": 2}, call, repeats),
        "serial CFG, one rank (tp=1)": _measure_mode(model, {"tp": 1}, call, repeats),
    }


def measure(model: str, ranks: int, steps: int, size: int, repeats: int, true_cfg_scale: float) -> dict:
    if ranks < 2 or ranks % 2:
        raise ValueError(f"--ranks {ranks}: CFG parallelism needs an even number of ranks (2 x tp).")
    height, width = size, size
    call = {"height": height, "width": width, "num_inference_steps": steps, "true_cfg_scale": true_cfg_scale}
    per_rank = run_on_cpu_ranks(_rank_bench, ranks, model, ranks, call, repeats, timeout_s=1800)
    modes = {}
    for mode in per_rank[0]:
        modes[mode] = {
            # The slowest rank sets the pace of a group.
            "step_seconds": round(max(r[mode]["step_seconds"] for r in per_rank), 5),
            "forwards_per_rank_per_image": max(r[mode]["forwards_per_image"] for r in per_rank),
        }
    serial, parallel, alone = (modes[mode]["step_seconds"] for mode in per_rank[0])
    return {"model": model, "ranks": ranks, "size": [height, width], "steps": steps, "repeats": repeats,
            "threads_per_rank": 1, "modes": modes,
            "cfg_parallel_vs_serial_cfg_same_ranks": round(parallel / serial, 3),
            "cfg_parallel_vs_one_rank": round(parallel / alone, 3)}


def format_table(result: dict) -> str:
    lines = [f"{result['model']}, {result['size'][0]}x{result['size'][1]}, {result['steps']} steps x "
             f"{result['repeats']} repeats, {result['ranks']} CPU ranks (1 thread each)",
             "| mode | step (s) | transformer forwards per rank per image |", "|---|---:|---:|"]
    for mode, figures in result["modes"].items():
        lines.append(f"| {mode} | {figures['step_seconds']:.4f} | {figures['forwards_per_rank_per_image']:g} |")
    lines.append(f"step time, CFG-parallel / serial CFG on the same {result['ranks']} ranks: "
                 f"{result['cfg_parallel_vs_serial_cfg_same_ranks']:.3f}x")
    lines.append(f"step time, CFG-parallel / serial CFG on one rank: {result['cfg_parallel_vs_one_rank']:.3f}x")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwenimage",
                        help=f"tiny family ({', '.join(FAMILIES)}) or a checkpoint folder of one (default: qwenimage)")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (even; default 2)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=1024,
                        help="height = width (default 1024: at the tiny families' own 32x32 a step is a few "
                             "milliseconds, and per-step collective latency, not compute, is what gets measured)")
    parser.add_argument("--repeats", type=int, default=2, help="timed generations per mode")
    parser.add_argument("--true-cfg-scale", type=float, default=4.0)
    parser.add_argument("--json", action="store_true")


def main(args) -> None:
    result = measure(args.model, args.ranks, args.steps, args.size, args.repeats, args.true_cfg_scale)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
