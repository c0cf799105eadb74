"""Run diffusers' own `ContextParallelTesterMixin` (its Ulysses cases) on 2 CPU gloo ranks with neuron_diffusers.

    python tests/upstream_cp/run.py DIFFUSERS_CHECKOUT [--runs N] [--json FILE] [pytest args...]

DIFFUSERS_CHECKOUT holds a diffusers source tree's `tests/` only (the wheel ships none), e.g. `git archive COMMIT
tests | tar -x -C DIR` plus the commit in `DIR/COMMIT`: a full checkout's conftest would import its own
`src/diffusers` instead of the installed one. The mixin is diffusers' test code: it is run from that checkout, not
copied here. It selects the context-parallel tests of the four transformers that ship a `_cp_plan` (FLUX.1, FLUX.2,
Qwen-Image, MiniMax-H3; set `UPSTREAM_CP_MODULES` to run fewer), their Ulysses cases; ring cases skip themselves with
the native attention backend (diffusers' rule). Without the package, stock divides by
`torch.accelerator.device_count()` (0 on a CPU host) and fails.

`--runs N` repeats the whole selection N times (an abort at exit can be intermittent); `--json FILE` stores each
run's counts, exit status and whether any process aborted ("terminate called", SIGABRT), with the command, date,
machine, package versions and the checkout's commit, so docs quote a stored result. Exit status: the first
non-zero pytest status, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

MODULES = tuple(os.environ.get("UPSTREAM_CP_MODULES", "flux flux2 qwenimage minimax_h3").split())
#: What an aborted process prints: a C++ `std::terminate` (a joinable thread destroyed at exit) or a signal.
ABORTED = re.compile(r"terminate called|SIGABRT|Aborted|core dumped")
SUMMARY = re.compile(r"\d+ (passed|failed|errors?)\b.* in [\d.]+s")


def _command(checkout: Path, here: Path, pytest_args: list[str]) -> tuple[list[str], dict]:
    files = [str(checkout / "tests" / "models" / "transformers" / f"test_models_transformer_{m}.py") for m in MODULES]
    env = {**os.environ, "DIFFUSERS_TEST_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "pytest", *files, "-p", "cpu_ranks", "-p", "no:cacheprovider",
               "-k", "ContextParallel and not AttnBackends and ulysses", "-rA", *pytest_args]
    return command, env


def _run_once(command: list[str], env: dict, checkout: Path) -> dict:
    """One pytest run, its output passed through, and what it counted."""
    start = time.monotonic()
    process = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    output = process.stdout + process.stderr
    sys.stdout.write(output)
    summary = next((line for line in reversed(process.stdout.splitlines()) if SUMMARY.search(line)), "")
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary)}
    return {"returncode": process.returncode, "passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
            "errors": counts.get("error", 0) + counts.get("errors", 0), "skipped": counts.get("skipped", 0),
            "aborted": bool(ABORTED.search(output)), "seconds": round(time.monotonic() - start, 1)}


def _checkout_commit(checkout: Path) -> str | None:
    """The checkout's commit: a `COMMIT` file (a tree exported with `git archive`, which must hold `tests/` only:
    a full checkout's conftest puts its own `src/diffusers` first on the path), else `git rev-parse HEAD`."""
    if (checkout / "COMMIT").is_file():
        return (checkout / "COMMIT").read_text().strip()
    result = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    return (result.stdout.strip() or None) if result.returncode == 0 else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("checkout", nargs="?")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args, pytest_args = parser.parse_known_args(argv)
    helpers = Path(args.checkout or ".") / "tests" / "models" / "testing_utils" / "parallelism.py"
    if not args.checkout or not helpers.exists():
        print(__doc__, file=sys.stderr)
        return 2
    checkout = Path(args.checkout).resolve()
    command, env = _command(checkout, Path(__file__).resolve().parent, pytest_args)
    runs = [_run_once(command, env, checkout) for _ in range(args.runs)]
    if args.json is not None:
        args.json.write_text(json.dumps({
            "command": "python tests/upstream_cp/run.py DIFFUSERS_CHECKOUT " + " ".join(argv[1:]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
            "cpus": os.cpu_count(), "modules": list(MODULES), "versions": {
                name: version(name) for name in ("neuron-diffusers", "diffusers", "torch")},
            "checkout_commit": _checkout_commit(checkout), "runs": runs}, indent=2) + "\n")
    return next((run["returncode"] for run in runs if run["returncode"]), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
