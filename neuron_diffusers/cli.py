"""`neuron-diffusers` (also `python -m neuron_diffusers`): a table of subcommands, each served by one module.

Every module in `COMMANDS` has `add_arguments(parser)` and `main(args)` (returning an exit status, or None for 0).
`generate` is the job (`job.py`); `serve` the HTTP server (`serve/`); `tiny` builds offline checkpoints; `compare`
measures two outputs' difference; `plan ...` and `bench ...` are developer tools (`tools/`). Bad input from the user
exits with status 2 and a one-line error; everything is checked before a process group starts or any weight is read.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from typing import NoReturn

from .distributed import exit_process

#: "command [subcommand]" -> (module, help).
COMMANDS = {
    "generate": ("job", "generate images (H3: videos) for prompts over the launched ranks"),
    "serve": ("serve.command", "an OpenAI-style image API on rank 0; every replica of the mesh serves requests"),
    "tiny": ("tiny", "build a tiny random checkpoint of a family, offline"),
    "compare": ("tools.compare", "PSNR and SSIM of two images, or of two output folders (e.g. cached vs not)"),
    "plan report": ("tools.plan.report", "per-rank memory and collectives of a plan at a TP degree, or every "
                                         "(dp, cfg, ring, ulysses, tp) layout of N cores with its per-rank costs"),
    "plan check": ("tools.plan.check", "lint a plan against a model's module tree (meta device, no weights); "
                                       "exit 1 on errors"),
    "plan verify": ("tools.plan.verify", "tiny random model: TP=N vs one process on spawned CPU ranks; exit 1 above "
                                         "the tolerance"),
    "plan draft": ("tools.plan.draft", "draft a plan from a module tree, verified at TP=2; --all: coverage table"),
    "bench memory": ("tools.bench.memory", "per-rank memory of every family at TP 1/2/4/8, ours vs stock"),
    "bench encoder": ("tools.bench.encoder", "peak RSS of the encoding rank vs the others vs a stock pipeline"),
    "bench collectives": ("tools.bench.collectives", "collectives per forward counted at run time; step time vs "
                                                     "stock"),
    "bench step": ("tools.bench.step", "one transformer forward at real width and token count: our plans vs stock TP "
                                       "vs one process, beside the ideal (one process / N)"),
    "bench compile": ("tools.bench.compile", "recompiles over a prompt set, stock vs ours; cold compile times"),
    "bench cfg": ("tools.bench.cfg", "step time of CFG-parallel vs serial CFG on the same ranks; forwards"),
    "bench cache": ("tools.bench.cache", "step time and fraction skipped vs threshold at TP=2, beside no cache"),
    "bench exit": ("tools.bench.exit", "run the README's first command N times; count failed exits and signals"),
    "bench serve": ("tools.bench.serve", "throughput and latency percentiles of `serve` vs the batch job, same mesh"),
    "bench cp": ("tools.bench.context", "one image: step time of TP vs Ulysses vs ring vs one process on the same "
                                        "ranks; collectives by kind"),
    "bench record": ("tools.bench.record", "run bench/plan commands that print JSON; store their output with the "
                                           "command, date, machine and versions (the docs' figures)"),
    "bench vae": ("tools.bench.vae", "per-rank peak memory and seconds of a VAE decode, one rank vs N (parallel "
                                     "VAE)"),
    "bench throughput": ("tools.bench.throughput", "images/s and per-image latency at batch sizes 1, 2, 4 side by "
                                                   "side (`generate(batch_size=...)`), one TP group"),
    "bench device": ("tools.bench.device", "each family at full size on the device present (CUDA, else CPU): "
                                           "recompiles, step ms ours vs stock, peak memory; --tiny on CPU"),
}
#: Help for the command groups of two-word commands.
GROUPS = {"plan": "inspect tensor-parallel plans", "bench": "benchmarks"}
#: Errors that mean "the user's input cannot work": exit status 2, one line, no traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, PermissionError)


def positive_int(value: str) -> int:
    """An argparse type: a whole number of at least 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def finite_float(value: str) -> float:
    """An argparse type: a number that is neither NaN nor infinite (float() alone accepts "nan" and "inf")."""
    number = float(value)
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
    return number


def positive_float(value: str) -> float:
    """An argparse type: a finite number above 0 (e.g. seconds to wait)."""
    number = finite_float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {value}")
    return number


def non_negative_float(value: str) -> float:
    """An argparse type: a finite number of at least 0 (e.g. milliseconds to wait, 0 for none)."""
    number = finite_float(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, got {value}")
    return number


class _Parser(argparse.ArgumentParser):
    """One line for a bad argument (what, and where the help is) instead of the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _module(name: str):
    return importlib.import_module(f"{__package__}.{name}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="neuron-diffusers",
                                     description="Stock Hugging Face Diffusers pipelines, parallel across cores.")
    commands = parser.add_subparsers(dest="command", required=True)
    groups = {}
    for command, (module, help_text) in COMMANDS.items():
        group, _, sub = command.partition(" ")
        if not sub:
            _module(module).add_arguments(commands.add_parser(command, help=help_text))
            continue
        if group not in groups:
            groups[group] = commands.add_parser(group, help=GROUPS[group]).add_subparsers(dest="subcommand",
                                                                                         required=True)
        _module(module).add_arguments(groups[group].add_parser(sub, help=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command in this process and return its exit status (what tests call)."""
    args = _parser().parse_args(argv)
    command = " ".join(filter(None, (args.command, getattr(args, "subcommand", None))))
    try:
        return _module(COMMANDS[command][0]).main(args) or 0
    except USER_ERRORS as error:
        print(f"neuron-diffusers {command}: error: {error}", file=sys.stderr)
        return 2


def run() -> NoReturn:
    """The `neuron-diffusers` program (and `python -m neuron_diffusers`): `main`, then an exit that cannot abort in
    a native thread at interpreter shutdown (see `distributed.exit_process`)."""
    try:
        code = main()
    except SystemExit as leaving:  # argparse's own exits (--help, a bad argument), and SIGTERM (see `job.main`)
        code = leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)
    exit_process(code)
