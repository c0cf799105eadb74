"""Step caching at TP=N: denoising step time and the fraction of transformer forwards served from the cache, for a
sweep of FirstBlockCache thresholds, side by side with no cache, in one run.

One family's tiny pipeline (or a checkpoint) is loaded once on N spawned CPU ranks (one thread each, as `torchrun`
sets it). Every repeat runs every mode once, in turn (no cache, then each threshold: the cache is installed with
decisions shared by the TP group and removed again), so drift on a shared machine spreads over all modes alike. A
step is the seconds in the stock denoising loop (latent output, no decode) divided by the steps, on the slowest rank
of the repeat; the table gives the median and the spread (min..max) over the repeats. Skipped forwards are counted
by the cache itself. Tiny random models say nothing about image quality: `neuron-diffusers compare` measures that on
a real checkpoint.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from diffusers import FirstBlockCacheConfig

from ...distributed import init_distributed
from ...parallel.cache import enable_group_cache
from ...runner import load_pipeline
from ..spawn import run_on_cpu_ranks

PROMPT = "a red fox in the snow"


def _generation(pipe, call: dict) -> tuple[float, dict | None]:
    """Seconds per denoising step of one generation, and the cache's counts (None without a cache)."""
    before = pipe.times.seconds.get("denoise + decode", 0.0)
    pipe.generate(PROMPT, seed=0, output_type="latent", **call)
    seconds = (pipe.times.seconds["denoise + decode"] - before) / call["num_inference_steps"]
    return seconds, pipe.cache_counts[-1] if pipe.cache is not None else None


def _rank_bench(model, tp: int, thresholds: list[float], call: dict, repeats: int) -> dict:
    torch.set_num_threads(1)
    mesh = init_distributed(tp=tp)
    group = mesh["tp"].get_group() if tp > 1 else None
    pipe = load_pipeline(model, mesh)
    transformer = pipe.adapter.transformer_of(pipe.pipe)
    modes = [None, *thresholds]
    _generation(pipe, call)  # warm-up: lazy buffers, allocator
    seconds = {mode: [] for mode in modes}
    counts = {}
    for _ in range(repeats):
        for mode in modes:
            cache = None if mode is None else enable_group_cache(transformer, FirstBlockCacheConfig(mode), group)
            step, counts[mode] = _generation(pipe, call)
            seconds[mode].append(step)
            if cache is not None:
                cache.remove()
    return {"seconds": seconds, "counts": counts}


def measure(model: str, tp: int, thresholds: list[float], steps: int, size: int, repeats: int) -> dict:
    if tp < 2:
        raise ValueError(f"--tp {tp}: the shared decision is what this measures; use at least 2 ranks.")
    if any(t < 0 for t in thresholds) or not thresholds:
        raise ValueError(f"--thresholds {thresholds}: give one or more thresholds >= 0 (e.g. 0.05,0.1,0.2).")
    call = {"height": size, "width": size, "num_inference_steps": steps}
    per_rank = run_on_cpu_ranks(_rank_bench, tp, model, tp, thresholds, call, repeats, timeout_s=3600)
    rows = []
    for mode in [None, *thresholds]:
        # The slowest rank sets the pace of a TP group, repeat by repeat.
        slowest = [max(rank["seconds"][mode][i] for rank in per_rank) for i in range(repeats)]
        counts = per_rank[0]["counts"][mode]
        rows.append({"threshold": mode, "step_seconds_median": round(statistics.median(slowest), 5),
                     "step_seconds_min": round(min(slowest), 5), "step_seconds_max": round(max(slowest), 5),
                     "forwards": None if counts is None else counts["computed"] + counts["cached"],
                     "forwards_cached": None if counts is None else counts["cached"]})
    baseline = rows[0]["step_seconds_median"]
    for row in rows:
        row["step_time_vs_no_cache"] = round(row["step_seconds_median"] / baseline, 3)
    return {"model": model, "tp": tp, "size": [size, size], "steps": steps, "repeats": repeats,
            "threads_per_rank": 1, "cache": "FirstBlockCacheConfig", "rows": rows}


def format_table(result: dict) -> str:
    lines = [f"{result['model']}, {result['size'][0]}x{result['size'][1]}, {result['steps']} steps, TP={result['tp']} "
             f"on CPU ranks (1 thread each), {result['repeats']} repeats; FirstBlockCache, decisions shared",
             "| threshold | step (s), median | min .. max | forwards from cache | step time vs no cache |",
             "|---|---:|---:|---:|---:|"]
    for row in result["rows"]:
        name = "no cache" if row["threshold"] is None else f"{row['threshold']:g}"
        skipped = "-" if row["forwards"] is None else f"{row['forwards_cached']} of {row['forwards']}"
        lines.append(f"| {name} | {row['step_seconds_median']:.4f} | {row['step_seconds_min']:.4f} .. "
                     f"{row['step_seconds_max']:.4f} | {skipped} | {row['step_time_vs_no_cache']:.3f}x |")
    return "\n".join(lines)


def _thresholds(text: str) -> list[float]:
    try:
        return [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="flux", help="tiny family or checkpoint folder (default: flux)")
    parser.add_argument("--tp", type=int, default=2, help="TP degree = CPU ranks (default 2)")
    parser.add_argument("--thresholds", type=_thresholds, default=[0.1, 0.3, 0.5, 1.0],
                        help="FirstBlockCache thresholds, comma-separated (default 0.1,0.3,0.5,1.0: a tiny random "
                             "model's first-block residual moves far more per step than a trained model's)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=256,
                        help="height = width (default 256: at the tiny families' own 32x32 per-step collective "
                             "latency, not compute, is what gets measured)")
    parser.add_argument("--repeats", type=int, default=5, help="timed generations per mode")
    parser.add_argument("--json", action="store_true")


def main(args) -> None:
    result = measure(args.model, args.tp, args.thresholds, args.steps, args.size, args.repeats)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
