"""`neuron-diffusers` (also `python -m neuron_diffusers`): `generate`, `tiny`, `plan` and `bench`.

`generate` runs alone or under `torchrun`; every check of the user's input runs before the process
group starts or any weight is read, and only one rank per TP group writes (a PNG, or for MiniMax-H3
an MP4 with its WAV soundtrack). `plan report` and
`bench memory` measure plans on models built on the meta device, so they need no weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from . import __version__, bench_encoder, bench_memory, plan_report, tiny
from .distributed import check_tp_degree, detect_runtime, init_distributed
from .media import save_png, save_video
from .pipelines import adapter_for
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
    gen.add_argument("--negative-prompt", default=None,
                     help="for true classifier-free guidance (FLUX.1 with --true-cfg-scale, Qwen-Image, Qwen-Image-2.1)")
    gen.add_argument("--out", required=True, type=Path,
                     help="file to write: .png for image models, .mp4 for MiniMax-H3 (its audio also goes to .wav)")
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
    bench_encoder.add_arguments(
        bench_commands.add_parser("encoder", help="peak RSS of the encoding rank vs the others vs a stock pipeline"))
    return parser


def _check_generate_args(args) -> None:
    """Everything that can be checked without a process group or a weight."""
    if not args.prompt.strip():
        raise ValueError("--prompt is empty: give the text to generate an image from.")
    if args.out.suffix.lower() not in (".png", ".mp4"):
        raise ValueError(f"--out {args.out} must end in .png (image models) or .mp4 (MiniMax-H3).")
    parent = args.out.parent.resolve()
    writable = parent if parent.exists() else next(p for p in parent.parents if p.exists())
    if not os.access(writable, os.W_OK):
        raise PermissionError(f"--out {args.out}: {writable} is not writable. Choose another output path.")


def _check_output_kind(args, checkpoint: Path) -> None:
    """A video model writes .mp4 and an image model .png, checked before any weight is read."""
    makes_video = adapter_for(checkpoint).pipeline_class == "MiniMaxH3Blocks"
    wanted = ".mp4" if makes_video else ".png"
    if args.out.suffix.lower() != wanted:
        kind = "video with audio" if makes_video else "images"
        raise ValueError(f"--out {args.out}: {checkpoint} makes {kind}, so --out must end in {wanted}.")


def _generate(args) -> None:
    _check_generate_args(args)
    runtime = detect_runtime()
    tp = args.tp or runtime.world_size
    check_tp_degree(tp, runtime.world_size)
    # Every rank resolves the model itself: a tiny family is built into the cache by whichever rank
    # renames its build into place first (see `tiny.cached_tiny`), so no rank waits on another here.
    checkpoint = resolve_model(args.model)
    _check_output_kind(args, checkpoint)
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
        outputs = pipe.generate(prompts, seed=args.seed, negative_prompt=args.negative_prompt,
                                height=height, width=width, num_inference_steps=args.steps)
        if outputs is not None:
            written = _save(outputs[0], args, tp=tp, dp=dp_size, dtype_name=dtype_name)
            print(f"wrote {', '.join(map(str, written))} (tp={tp}, dp={dp_size}, {dtype_name})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _save(output, args, **layout) -> list[Path]:
    """The image as a PNG whose text chunks record how it was made, or the clip as MP4 + WAV."""
    if args.out.suffix.lower() == ".mp4":
        return save_video(output, args.out)
    settings = {
        "prompt": args.prompt, "negative_prompt": args.negative_prompt or "", "seed": args.seed,
        "steps": args.steps, "model": args.model, **layout, "neuron_diffusers": __version__,
    }
    return [save_png(output, args.out, text={key: str(value) for key, value in settings.items()})]


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
        elif command == "bench encoder":
            bench_encoder.main_with(args)
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError) as error:
        print(f"neuron-diffusers {command}: error: {error}", file=sys.stderr)
        return 2
    return 0
