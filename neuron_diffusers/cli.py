"""`neuron-diffusers` (also `python -m neuron_diffusers`): `generate`, `tiny`, `plan` and `bench`.

`generate` runs alone or under `torchrun`; every check of the user's input runs before the process
group starts or any weight is read, and only one rank writes the image. `plan report` and
`bench memory` measure plans on models built on the meta device, so they need no weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from . import bench_memory, plan_report, tiny
from .distributed import check_tp_degree, detect_runtime, init_distributed
from .runner import check_heads, load_pipeline, resolve_model

DTYPES = ("float32", "bfloat16", "float16")


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron-diffusers", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate an image, tensor-parallel over the launched ranks")
    gen.add_argument("--model", default="flux",
                     help="checkpoint folder, or a tiny family name built offline (default: flux, a tiny FLUX.1)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--out", required=True, type=Path, help="PNG file to write")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tp", type=_positive, default=None, help="tensor-parallel degree (default: all ranks)")
    gen.add_argument("--height", type=_positive, default=None)
    gen.add_argument("--width", type=_positive, default=None)
    gen.add_argument("--steps", type=_positive, default=4)
    gen.add_argument("--dtype", choices=DTYPES, default=None,
                     help="default: bfloat16 on an accelerator, float32 on CPU")
    gen.add_argument("--timeout", type=float, default=600.0, help="seconds any collective may wait")

    tiny_cmd = commands.add_parser("tiny", help="build a tiny random checkpoint of a family, offline")
    tiny_cmd.add_argument("family")
    tiny_cmd.add_argument("dir", type=Path)
    tiny_cmd.add_argument("--seed", type=int, default=0)

    plan = commands.add_parser("plan", help="inspect tensor-parallel plans")
    plan_commands = plan.add_subparsers(dest="subcommand", required=True)
    report = plan_commands.add_parser("report", help="per-rank memory and collectives of a plan at a TP degree")
    report.add_argument("--model", required=True,
                        help="family name (full-size default config) or checkpoint folder (its transformer config)")
    report.add_argument("--tp", type=_positive, required=True, help="tensor-parallel degree")
    report.add_argument("--plan", choices=plan_report.PLANS, default="ours")
    report.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="subcommand", required=True)
    bench_memory.add_arguments(
        bench_commands.add_parser("memory", help="per-rank memory of every family at TP 1/2/4/8, ours vs stock"))
    return parser


def _check_generate_args(args) -> None:
    """Everything that can be checked without a process group or a weight."""
    if not args.prompt.strip():
        raise ValueError("--prompt is empty: give the text to generate an image from.")
    if args.out.suffix.lower() != ".png":
        raise ValueError(f"--out {args.out} must end in .png: images are written as PNG.")
    parent = args.out.parent.resolve()
    writable = parent if parent.exists() else next(p for p in parent.parents if p.exists())
    if not os.access(writable, os.W_OK):
        raise PermissionError(f"--out {args.out}: {writable} is not writable. Choose another output path.")


def save_png_atomically(image, path: Path) -> None:
    """Write to a temporary file beside `path` and rename it, so a crash never leaves a truncated PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            image.save(handle, format="PNG")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _generate(args) -> None:
    _check_generate_args(args)
    runtime = detect_runtime()
    tp = args.tp or runtime.world_size
    check_tp_degree(tp, runtime.world_size)
    # Every rank resolves the model itself: a tiny family is built into the cache by whichever rank
    # renames its build into place first (see `tiny.cached_tiny`), so no rank waits on another here.
    checkpoint = resolve_model(args.model)
    check_heads(checkpoint, tp)
    mesh = init_distributed(tp=tp, timeout_s=args.timeout)

    family = args.model if args.model in tiny.FAMILIES else None
    height, width = args.height, args.width
    if family and (height is None or width is None):
        height, width = (height or tiny.default_size(family)[0]), (width or tiny.default_size(family)[1])
    dtype_name = args.dtype or ("float32" if runtime.device_type == "cpu" else "bfloat16")
    pipe = load_pipeline(checkpoint, mesh, torch_dtype=getattr(torch, dtype_name))

    # Data parallel: TP group `dp` takes every dp-th prompt; with one prompt only group 0 works.
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    prompts = [args.prompt][dp_rank::dp_size]
    if prompts:
        images = pipe.generate(prompts, seed=args.seed, height=height, width=width,
                               num_inference_steps=args.steps)
        if images is not None:
            save_png_atomically(images[0], args.out)
            print(f"wrote {args.out} (tp={tp}, dp={dp_size}, {dtype_name})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _plan_report(args) -> None:
    report = plan_report.plan_report(args.model, args.tp, args.plan)
    print(json.dumps(report) if args.json else plan_report.format_report(report))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = " ".join(filter(None, (args.command, getattr(args, "subcommand", None))))
    try:
        if args.command == "generate":
            _generate(args)
        elif args.command == "tiny":
            print(tiny.build_tiny(args.family, args.dir, seed=args.seed))
        elif command == "plan report":
            _plan_report(args)
        elif command == "bench memory":
            bench_memory.main_with(args)
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError) as error:
        print(f"neuron-diffusers {command}: error: {error}", file=sys.stderr)
        return 2
    return 0
