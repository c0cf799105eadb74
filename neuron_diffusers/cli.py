"""`neuron-diffusers` (also `python -m neuron_diffusers`): `generate`, `tiny`, `plan` and `bench`.

`generate` runs the job in `job.py`, alone or under `torchrun`: every check of the user's input runs
before the process group starts or any weight is read, and only one rank per TP group writes (PNGs,
or for MiniMax-H3 MP4 + WAV). `plan report` and `bench memory` measure plans on models built on the
meta device, so they need no weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

from . import (bench_cfg, bench_collectives, bench_compile, bench_encoder, bench_memory, plan_check, plan_report,
               plan_verify, tiny)
from .distributed import detect_runtime
from .job import format_phases, plan_job, run_job

DTYPES = ("float32", "bfloat16", "float16")


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron-diffusers", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate images (H3: videos) for prompts over the launched ranks")
    gen.add_argument("--model", default="flux",
                     help="checkpoint folder, or a tiny family name built offline (default: flux, a tiny FLUX.1)")
    gen.add_argument("--prompt", default=None, help="one prompt (or use --prompts)")
    gen.add_argument("--prompts", type=Path, default=None,
                     help=".txt (one prompt a line) or .jsonl (prompt, negative_prompt, seed, height, width, steps, "
                          "guidance per line)")
    gen.add_argument("--negative-prompt", default=None,
                     help="for true classifier-free guidance (Qwen-Image, Qwen-Image-2.1; FLUX.1 with true_cfg_scale)")
    gen.add_argument("--out", required=True, type=Path,
                     help="folder: one PNG per prompt (H3: MP4 + WAV), named from its index and prompt, + summary.json")
    gen.add_argument("--overwrite", action="store_true", help="regenerate outputs that already exist (default: skip)")
    gen.add_argument("--guidance", type=float, default=None,
                     help="guidance scale (FLUX: guidance_scale; Qwen-Image / 2.1: true_cfg_scale)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tp", type=_positive, default=None,
                     help="tensor-parallel degree (default: all ranks; with --cfg-parallel half of them)")
    gen.add_argument("--cfg-parallel", action="store_true",
                     help="true CFG (negative prompt, scale > 1): compute cond and uncond on two TP groups at once; "
                          "needs a multiple of 2 x tp ranks. Requests without true CFG use the pairs as data parallelism")
    gen.add_argument("--true-cfg-scale", type=float, default=None,
                     help="FLUX.1's true CFG scale (with --negative-prompt); Qwen-Image / 2.1 take it from --guidance")
    gen.add_argument("--height", type=_positive, default=None)
    gen.add_argument("--width", type=_positive, default=None)
    gen.add_argument("--steps", type=_positive, default=4)
    gen.add_argument("--dtype", choices=DTYPES, default=None,
                     help="default: bfloat16 on an accelerator, float32 on CPU")
    gen.add_argument("--timeout", type=float, default=600.0, help="seconds any collective may wait")
    gen.add_argument("--compile", nargs="?", const="auto", default=None, metavar="BACKEND",
                     help="compile the transformer's repeated blocks (default backend: neuron if present, else inductor)")
    gen.add_argument("--warmup", action="store_true",
                     help="with --compile: compile the requested size and every text-length bucket before generating")

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
    plan_check.add_arguments(plan_commands.add_parser(
        "check", help="lint a plan against a model's module tree (meta device, no weights); exit 1 on errors"))
    plan_verify.add_arguments(plan_commands.add_parser(
        "verify", help="tiny random model: TP=N vs one process on spawned CPU ranks; exit 1 above the tolerance"))

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="subcommand", required=True)
    bench_memory.add_arguments(
        bench_commands.add_parser("memory", help="per-rank memory of every family at TP 1/2/4/8, ours vs stock"))
    bench_encoder.add_arguments(
        bench_commands.add_parser("encoder", help="peak RSS of the encoding rank vs the others vs a stock pipeline"))
    bench_collectives.add_arguments(
        bench_commands.add_parser("collectives", help="collectives per forward counted at run time; step time vs stock"))
    bench_compile.add_arguments(
        bench_commands.add_parser("compile", help="recompiles over a prompt set, stock vs ours; cold compile times"))
    bench_cfg.add_arguments(
        bench_commands.add_parser("cfg", help="step time of CFG-parallel vs serial CFG on the same ranks; forwards"))
    return parser


def _generate(args) -> int:
    runtime = detect_runtime()
    # Every check runs here, before the process group starts or any weight is read. Every rank resolves the
    # model itself: a tiny family is built into the cache by whichever rank renames its build into place first.
    plan = plan_job(args, runtime.world_size, runtime.device_type)
    if runtime.rank == 0:
        for note in plan.notes:
            print(f"neuron-diffusers generate: note: {note}", file=sys.stderr, flush=True)
    try:
        summary = run_job(plan, overwrite=args.overwrite, compile_backend=args.compile, warm=args.warmup,
                          timeout_s=args.timeout)
    except (RuntimeError, dist.DistError) as error:
        # Most often another rank died and a collective failed or timed out: what was written is complete
        # (atomic writes), and the same command resumes.
        print(f"neuron-diffusers generate: error on rank {runtime.rank}: {error}\nOutputs written so far are "
              "complete; rerun the same command to generate the rest.", file=sys.stderr, flush=True)
        return 1
    if summary is not None:
        print(format_phases(summary))
        if summary["compile"]:
            print(f"compile report: {json.dumps({k: v for k, v in summary['compile'].items() if k != 'recompile_reasons'})}")
        print(f"wrote {summary['generated']} of {summary['requests']} to {plan.out_dir} "
              f"(tp={plan.tp}, cfg={plan.cfg}, dp={plan.world_size // (plan.tp * plan.cfg)}, {plan.dtype}); "
              "summary.json", flush=True)
    # Leave together: a rank tearing gloo down while its peer has already exited was seen to abort (SIGABRT,
    # "terminate called without an active exception") after a finished job, and torchrun then reports a failure.
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _plan_report(args) -> None:
    report = plan_report.plan_report(args.model, args.tp, args.plan)
    print(json.dumps(report) if args.json else plan_report.format_report(report))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = " ".join(filter(None, (args.command, getattr(args, "subcommand", None))))
    try:
        if args.command == "generate":
            return _generate(args)
        elif args.command == "tiny":
            print(tiny.build_tiny(args.family, args.dir, seed=args.seed))
        elif command == "plan report":
            _plan_report(args)
        elif command == "plan check":
            return plan_check.main_with(args)
        elif command == "plan verify":
            return plan_verify.main_with(args)
        elif command == "bench memory":
            bench_memory.main_with(args)
        elif command == "bench encoder":
            bench_encoder.main_with(args)
        elif command == "bench collectives":
            bench_collectives.main_with(args)
        elif command == "bench compile":
            bench_compile.main_with(args)
        elif command == "bench cfg":
            bench_cfg.main_with(args)
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError) as error:
        print(f"neuron-diffusers {command}: error: {error}", file=sys.stderr)
        return 2
    return 0
