"""Throughput of batching: images per second and per-image latency at several batch sizes, side by side, one run.

One pipeline is loaded once on N spawned CPU ranks (TP=N, one thread each, as `torchrun` sets it) and makes the same
`--images` prompts (of different lengths) with `generate(batch_size=B)` for each B, in rounds that alternate the
order of the batch sizes, after one warm-up call per batch size. Images per second: images / wall seconds of the
calls (latent output, no decode: the transformer is what batching amortises). Per-image latency: the seconds of the
stock call that made the image (a batch's images all finish with it), p50 and p95 over every image of every round
(`serve.percentile`, interpolated, as `bench serve` takes them).
What it prints is measured, not modelled; the spread across rounds is printed beside the median.

`--width full` runs a real-width slice instead of the checkpoint: the family's transformer at its released width
(FLUX.1: 3072, 24 heads of 128) with `--blocks` blocks of each kind and random weights, inside its tiny pipeline
whose text encoders and VAE are widened to meet it (`device_folder.slice_folder`, `bench step`'s `bench_config`),
saved once into a temporary folder that each rank loads its shard from. At the real width each matmul is wide and
the step compute-bound: the regime a batch must also pay off in, not only the tiny one. `--width tiny` runs the same
path at the tiny checkpoint's width (a quick check of the command).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ...cli import positive_int
from ...distributed import init_distributed
from ...runner import load_pipeline
from ..spawn import run_on_cpu_ranks
from . import record
from .serve import percentile

#: The families `--width` builds a slice of (`bench step`'s image families).
SLICE_FAMILIES = ("flux", "flux2", "qwenimage", "qwenimage21")

PROMPTS = ["a red fox in the snow", "a lighthouse on a cliff at dusk, waves breaking on the rocks below",
           "a small boat", "an old library with tall shelves, warm lamps and a sleeping cat on a chair"]


def _timed(pipe, prompts: list[str], batch: int, call: dict) -> tuple[float, list[float]]:
    """Wall seconds of making `prompts` at `batch` per call, and each image's latency (its call's seconds)."""
    latencies, start = [], time.perf_counter()
    for first in range(0, len(prompts), batch):
        chunk = prompts[first:first + batch]
        began = time.perf_counter()
        pipe.generate(chunk, seed=first, batch_size=batch, **call)
        latencies += [time.perf_counter() - began] * len(chunk)
    return time.perf_counter() - start, latencies


def rank_bench(model, ranks: int, call: dict, images: int, batches: list[int], rounds: int) -> dict:
    """On every rank: per batch size, the seconds of each round and every image's latency."""
    torch.set_num_threads(1)
    pipe = load_pipeline(model, init_distributed(tp=ranks))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(images)]
    call = {**call, "output_type": "latent"}
    for batch in batches:  # warm-up: lazy buffers, allocator, each batch shape once
        pipe.generate(prompts[:batch], seed=0, batch_size=batch, **call)
    measured = {batch: {"seconds": [], "latencies": []} for batch in batches}
    for round_ in range(rounds):
        for batch in batches if round_ % 2 == 0 else batches[::-1]:
            seconds, latencies = _timed(pipe, prompts, batch, call)
            measured[batch]["seconds"].append(seconds)
            measured[batch]["latencies"] += latencies
    return measured


def measure(model: str, ranks: int, steps: int, size: int, images: int, batches: list[int], rounds: int,
            width: str | None = None, blocks: int = 1) -> dict:
    """The table's figures for `model` (a checkpoint), or with `width` for a slice of family `model` at that width
    with `blocks` blocks of each kind (built into a temporary folder, removed after)."""
    if width is None:
        return _rows(model, _run(model, ranks, steps, size, images, batches, rounds), ranks, steps, size, images,
                     batches, rounds)
    if model not in SLICE_FAMILIES:
        raise ValueError(f"--width {width} builds a slice of a family's transformer: --model must be one of "
                         f"{', '.join(SLICE_FAMILIES)}, got {model!r}. Leave --width out to measure a checkpoint.")
    from .device_folder import slice_folder

    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as folder:
        path = slice_folder(model, width, blocks, Path(folder) / model)
        per_rank = _run(str(path), ranks, steps, size, images, batches, rounds)
        params = _parameters(path / "transformer")
    result = _rows(model, per_rank, ranks, steps, size, images, batches, rounds)
    return {**result, "width": width, "blocks": blocks, "transformer_params": params}


def _parameters(folder: Path) -> int:
    """The parameters saved in `folder`'s safetensors files, counted from their headers (no tensor read)."""
    from safetensors import safe_open

    count = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as tensors:
            count += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    return count


def _run(model: str, ranks: int, steps: int, size: int, images: int, batches: list[int], rounds: int) -> list:
    call = {"height": size, "width": size, "num_inference_steps": steps}
    return run_on_cpu_ranks(rank_bench, ranks, model, ranks, call, images, batches, rounds, timeout_s=3600)


def _rows(model: str, per_rank: list, ranks: int, steps: int, size: int, images: int, batches: list[int],
          rounds: int) -> dict:
    rows = {}
    for batch in batches:
        # A TP group moves at its slowest rank's pace.
        seconds = [max(rank[batch]["seconds"][i] for rank in per_rank) for i in range(rounds)]
        rates = [images / s for s in seconds]
        latencies = per_rank[0][batch]["latencies"]
        rows[str(batch)] = {"images_per_second": round(statistics.median(rates), 3),
                            "images_per_second_range": [round(min(rates), 3), round(max(rates), 3)],
                            "latency_p50_s": round(percentile(latencies, 50), 4),
                            "latency_p95_s": round(percentile(latencies, 95), 4)}
    base = rows[str(batches[0])]["images_per_second"]
    for row in rows.values():
        row["vs_first"] = round(row["images_per_second"] / base, 3)
    return {"model": model, "ranks": ranks, "tp": ranks, "size": [size, size], "steps": steps, "images": images,
            "rounds": rounds, "threads_per_rank": 1, "batches": rows}


def format_table(result: dict) -> str:
    model = result["model"]
    if result.get("width"):
        model += (f" ({result['width']}-width slice, {result['blocks']} block(s) of each kind, "
                  f"{result['transformer_params'] / 1e6:.0f}M transformer parameters)")
    lines = [f"{model}, {result['size'][0]}x{result['size'][1]}, {result['steps']} steps, "
             f"{result['images']} images x {result['rounds']} rounds, TP={result['tp']} on {result['ranks']} CPU "
             "ranks (1 thread each)",
             "| batch | images/s (median) | range over rounds | vs first | latency p50 (s) | p95 (s) |",
             "|---:|---:|---|---:|---:|---:|"]
    for batch, row in result["batches"].items():
        low, high = row["images_per_second_range"]
        lines.append(f"| {batch} | {row['images_per_second']:.3f} | {low:.3f}-{high:.3f} | {row['vs_first']:.2f}x "
                     f"| {row['latency_p50_s']:.3f} | {row['latency_p95_s']:.3f} |")
    return "\n".join(lines)


def _batches(text: str) -> list[int]:
    try:
        batches = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batches {text!r}: comma-separated positive integers, e.g. 1,2,4") from None
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"--batches {text!r}: comma-separated positive integers, e.g. 1,2,4")
    return batches


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="flux", help="a tiny family name or a checkpoint folder (default: flux)")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks, one TP group (default 2)")
    parser.add_argument("--batches", type=_batches, default=[1, 2, 4], help="batch sizes to compare (default 1,2,4)")
    parser.add_argument("--images", type=int, default=8, help="images per round (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per batch size (default 3)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=128, help="height = width (default 128)")
    parser.add_argument("--width", choices=("full", "tiny"), default=None,
                        help="instead of the checkpoint, a slice of family --model's transformer at this width (full: "
                             "the released one, e.g. FLUX.1's 3072) with --blocks blocks of each kind, random weights")
    parser.add_argument("--blocks", type=positive_int, default=1, help="with --width: blocks of each kind (default 1)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the result as JSON")


def main(args) -> None:
    result = measure(args.model, args.ranks, args.steps, args.size, args.images, args.batches, args.rounds,
                     width=args.width, blocks=args.blocks)
    print(format_table(result))
    if args.json is not None:  # with the header every stored result carries (docs/verified.md, "Figures")
        header = record.metadata(record.command_line(args))
        args.json.write_text(json.dumps({**header, **result}, indent=2) + "\n")
