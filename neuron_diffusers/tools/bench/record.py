"""`neuron-diffusers bench record OUT.json --run "COMMAND" [--run ...]`: store commands' JSON with how it was made.

Every figure the docs quote must come from a file under `docs/` that the repository's own command wrote, so that it
can be re-made and checked (`tests/test_doc_figures.py`). This runs each `--run` (a `neuron-diffusers` command that
prints JSON: one document, or JSON lines) in a fresh interpreter, one after another, and writes one file: the
record command, the UTC date, the machine (CPU, cores, memory, load average before and after each run), the
package versions, and each run's command, wall seconds and parsed output. Writers that make their own files
(`bench memory`, `bench step`) put the same header in them through `metadata`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("neuron-diffusers", "diffusers", "torch")


def _proc_field(path: str, key: str) -> str | None:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((line.partition(":")[2].strip() for line in lines if line.startswith(key)), None)


def machine() -> dict:
    """What the figures were measured on: enough to tell a 2-core VM from an accelerator host."""
    memory = _proc_field("/proc/meminfo", "MemTotal")
    return {"system": platform.system(), "arch": platform.machine(), "cpu": _proc_field("/proc/cpuinfo", "model name"),
            "cpus": os.cpu_count(), "memory_gib": round(int(memory.split()[0]) / 2**20, 1) if memory else None,
            "python": platform.python_version(), "load_average": [round(x, 2) for x in os.getloadavg()]}


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def metadata(command: str) -> dict:
    """The header of a stored result: the command that wrote it, when, where, with which versions."""
    return {"command": command, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "versions": versions()}


def command_line(args: argparse.Namespace) -> str:
    """The command that `args` stands for, every option spelled out (defaults too), for a writer's header."""
    words = ["neuron-diffusers", args.command, *filter(None, [getattr(args, "subcommand", None)])]
    for name, value in vars(args).items():
        flag = "--" + name.replace("_", "-")
        if name in ("command", "subcommand") or value is None or value is False:
            continue
        values = value if isinstance(value, list) else [value]
        words += [flag] if value is True else [w for v in values for w in (flag, str(v))]
    return shlex.join(words)


def parse_output(stdout: str):
    """One JSON document (the whole output, or its end after a printed table, as `bench serve --json -` prints),
    or else every line that is one (JSON lines, e.g. `bench exit`'s summary)."""
    lines = stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip()[:1] in ("{", "[")]
    for start in [0, *starts]:
        try:
            return json.loads("\n".join(lines[start:]))
        except json.JSONDecodeError:
            continue
    found = []
    for start in starts:
        try:
            found.append(json.loads(lines[start]))
        except json.JSONDecodeError:
            continue
    if not found:
        raise ValueError("the command printed no JSON: give it its `--json` flag")
    return found[0] if len(found) == 1 else found


def _checked(commands: list[str]) -> list[list[str]]:
    from ...cli import _parser  # the CLI's own parser, so a typo fails here, before any run

    parsed = []
    for text in commands:
        argv = shlex.split(text)
        if argv[:1] == ["neuron-diffusers"]:
            argv = argv[1:]
        if argv[:2] == ["bench", "record"]:
            raise ValueError(f"--run {text!r}: record cannot run itself")
        try:
            _parser().parse_args(argv)
        except SystemExit:
            raise ValueError(f"--run {text!r} is not a valid neuron-diffusers command (see its --help)") from None
        parsed.append(argv)
    return parsed


def run_one(argv: list[str], timeout_s: float) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "neuron_diffusers", *argv], capture_output=True, text=True,
                          timeout=timeout_s)
    seconds = round(time.perf_counter() - start, 1)
    try:  # a non-zero exit with JSON is a result (`bench exit` exits 1 when a run failed); without, an error
        result = parse_output(done.stdout)
    except ValueError:
        raise RuntimeError(f"`neuron-diffusers {shlex.join(argv)}` exited {done.returncode} without JSON:\n"
                           f"{done.stderr[-3000:]}") from None
    return {"command": f"neuron-diffusers {shlex.join(argv)}", "exit_code": done.returncode, "seconds": seconds,
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "result": result}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="the JSON file to write (e.g. docs/cfg.json)")
    parser.add_argument("--run", action="append", required=True, metavar="COMMAND",
                        help='a neuron-diffusers command that prints JSON, quoted, e.g. "bench cfg --json"; '
                             "repeat for several (run one after another)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take (default 1800)")


def main(args: argparse.Namespace) -> None:
    commands = _checked(args.run)
    if not args.out.parent.is_dir():
        raise FileNotFoundError(f"{args.out.parent} is not a folder: create it, or write the record elsewhere")
    runs_line = " ".join(f"--run {shlex.quote(shlex.join(argv))}" for argv in commands)
    record = metadata(f"neuron-diffusers bench record {args.out} {runs_line}")
    record["runs"] = [run_one(argv, args.timeout) for argv in commands]
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out} ({len(record['runs'])} run(s))")
