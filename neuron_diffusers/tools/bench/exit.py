"""`neuron-diffusers bench exit`: run the README's first command N times and count the runs that did not end cleanly.

A job can finish its work and still fail at exit: a native gloo thread that drops a tensor's last reference while
the interpreter shuts down takes the GIL, CPython unwinds it, and the process aborts ("terminate called without an
active exception", SIGABRT; pytorch/pytorch#190489). torchrun then reports the finished job as failed. Rare (about
one run in twenty in CI), so only many runs say anything: this runs
`torchrun --nproc_per_node=2 -m neuron_diffusers generate --prompt "a red fox" --out DIR --tp 2` (torchrun as
`python -m torch.distributed.run`, so the same interpreter) `--runs` times, each into a fresh folder, and counts
non-zero exits, runs past `--timeout` (killed with their workers), runs whose output names a signal or the abort,
and runs whose PNG is missing or broken.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...media import read_png_text

#: What torchrun or a dying worker prints when a rank ended by a signal or an abort.
_CRASH = re.compile(r"terminate called|SIGABRT|SIGSEGV|Signal \d+|exitcode\s*:\s*-\d+|Aborted|core dumped")


def command(out: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m", "neuron_diffusers",
            "generate", "--prompt", "a red fox", "--out", str(out), "--tp", str(nproc)]


def one_run(out: Path, nproc: int, timeout_s: float) -> dict:
    start = time.perf_counter()
    # A session of its own, so a run past its time is killed whole: killing torchrun alone would leave its workers
    # waiting for a store that is gone.
    with subprocess.Popen(command(out, nproc), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout_s)
            code = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            code, output = None, f"timed out after {timeout_s:.0f} s\n{output}"
    crash = _CRASH.search(output)
    return {
        "exit_code": code,
        "crash": crash.group(0) if crash else None,
        "image_ok": read_png_text(out / "00000-a-red-fox.png") is not None,
        "seconds": round(time.perf_counter() - start, 2),
        "tail": output[-1500:] if code != 0 or crash else "",
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=50, help="how many times to run the command (default 50)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run, all in one TP group (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's record here")


def main(args: argparse.Namespace) -> int:
    """Exit status 1 if any run did not end cleanly (so a script can gate on it)."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-exit-") as folder:
        for index in range(args.runs):
            run = one_run(Path(folder) / f"run{index}", args.nproc, args.timeout)
            runs.append(run)
            failed = run["exit_code"] != 0 or run["crash"] or not run["image_ok"]
            why = run["crash"] or {0: "no image", None: "timed out"}.get(run["exit_code"], "non-zero exit")
            print(f"run {index + 1}/{args.runs}: exit {run['exit_code']}, {run['seconds']} s"
                  + (f", FAILED ({why})" if failed else ""), flush=True)
            if run["tail"]:
                print(run["tail"], flush=True)
    bad = [r for r in runs if r["exit_code"] != 0 or r["crash"] or not r["image_ok"]]
    seconds = [r["seconds"] for r in runs]
    summary = {
        "command": " ".join(command(Path("DIR"), args.nproc)),
        "runs": len(runs),
        "clean": len(runs) - len(bad),
        "non_zero_exit": sum(r["exit_code"] not in (0, None) for r in runs),
        "timed_out": sum(r["exit_code"] is None for r in runs),
        "signal_or_abort": sum(r["crash"] is not None for r in runs),
        "image_missing": sum(not r["image_ok"] for r in runs),
        "seconds_median": statistics.median(seconds) if seconds else None,
        "seconds_min": min(seconds, default=None),
        "seconds_max": max(seconds, default=None),
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    return 1 if bad else 0
