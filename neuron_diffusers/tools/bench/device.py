"""`bench device`: every family at full size on whatever device is present (CUDA, else CPU), as far as memory allows.

Per family, in its own process with its own time box (`device_family.py`, one JSON line per phase): the full-size
default transformer with random bf16 weights built on the device (no Hub), `load_pipeline` with the text encoder on
CPU and that transformer on the device, `compile_repeated_blocks(backend="auto")` + `warmup`, graphs and
recompiles over 20 prompt lengths, then the median transformer step of ours vs stock (a fresh transformer, stock
`compile_repeated_blocks`, the stock pipeline) on one device at 1024x1024, with peak device memory. Two rows more:
images per second at batch 1 vs batch 4 (#31) and the median step with fp8 weights (`load_pipeline(quantize=
"fp8")`, #30) beside bf16's, both eager (`device_family.py` says why).

A family that hangs, runs out of memory or crashes prints its last phase and the next family starts: the time box
of each is what is left of `--total-s` shared by the families still to run, so a fast family leaves more to the
next. Lines are printed as they arrive, so whatever a time limit cuts off, the phases before it stand.
`--tiny` runs the same path on the tiny checkpoints, on CPU (the test suite runs it), compiling with `aot_eager` by
default: what it checks (dynamo's graphs, guards and recompiles, our hooks inside compiled blocks) does not depend
on the backend, and inductor's CPU C++ code generation, which no device run uses, would take most of its time.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ... import families
from ...cli import positive_float

#: Total seconds for every family: the issue's 8 minutes on one H200 (the lead's device run has 600 s in all).
TOTAL_S = 480.0
TINY_TOTAL_S = 170.0
#: A family given less than this is skipped, with the reason printed.
MIN_FAMILY_S = 20.0


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _error_tail(path: str) -> str:
    with open(path, errors="replace") as file:
        text = file.read().strip().splitlines()
    return " | ".join(text[-3:])[-600:]


def run_family(family: str, budget_s: float, tiny: bool, backend: str, out=print) -> list[dict]:
    """Run one family's phases in a child process for at most `budget_s`; `out` gets each line as it arrives."""
    command = [sys.executable, "-m", f"{__package__}.device_family", family, "--backend", backend]
    command += ["--tiny"] if tiny else []
    results = []
    with tempfile.NamedTemporaryFile("w+", suffix=".stderr") as stderr:
        # Its own session, so a time box ends the child and anything it started (compiler workers) together.
        # --tiny means the CPU even where an accelerator is present: the run the test suite checks.
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if tiny else None
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
                                 env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(child.stdout, lines), daemon=True).start()
        deadline = time.monotonic() + budget_s
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                last = results[-1]["phase"] if results else "start"
                results.append({"family": family, "phase": "timeout", "budget_s": round(budget_s, 1),
                                "after": last})
                out(results[-1])
                break
            if line is None:
                code = child.wait()
                if code and not any(r["phase"] == "error" for r in results):
                    results.append({"family": family, "phase": "crashed", "returncode": code,
                                    "stderr": _error_tail(stderr.name)})
                    out(results[-1])
                break
            if line.startswith("{"):
                results.append(json.loads(line))
                out(results[-1])
    return results


def run(names: list[str], tiny: bool = False, backend: str | None = None, total_s: float | None = None,
        out=print) -> list[dict]:
    """Every family in `names`, one child process each, within `total_s` seconds in all."""
    total_s = (TINY_TOTAL_S if tiny else TOTAL_S) if total_s is None else total_s
    backend = default_backend(tiny) if backend is None else backend
    deadline = time.monotonic() + total_s
    results = []
    for index, family in enumerate(names):
        budget = (deadline - time.monotonic()) / (len(names) - index)
        if budget < MIN_FAMILY_S:
            results.append({"family": family, "phase": "skip", "reason": f"{budget:.0f} s left for it, under "
                                                                          f"{MIN_FAMILY_S:.0f} s (--total-s)"})
            out(results[-1])
            continue
        results += run_family(family, budget, tiny, backend, out)
    return results


def default_backend(tiny: bool) -> str:
    """`aot_eager` for `--tiny` (see the module's docstring), else `auto`: neuron with TorchNeuron, else inductor."""
    return "aot_eager" if tiny else "auto"


def _text_line(result: dict) -> str:
    fields = " ".join(f"{k}={v}" for k, v in result.items() if k not in ("family", "phase", "forward_ms", "words"))
    return f"{result['family']:<12} {result['phase']:<18} {fields}"


def summary(results: list[dict]) -> str:
    """A markdown table: per family, recompiles after warm-up, median step ours vs stock, images/s at batch N (4;
    tiny: 2) over batch 1, the eager step's bf16 / fp8, peak memory."""
    lines = ["| family | recompiles (20 lengths) | ours step ms | stock step ms | stock / ours | batch N / batch 1 "
             "(images/s) | bf16 / fp8 (eager step) | peak GiB | last phase |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for family in dict.fromkeys(r["family"] for r in results):
        rows = {r["phase"]: r for r in results if r["family"] == family}
        ours, stock = rows.get("ours", {}).get("step_ms"), rows.get("stock", {}).get("step_ms")
        ratio = f"{stock / ours:.2f}" if ours and stock else "-"
        batch = rows.get("batch", {}).get("speedup") or ("refused" if rows.get("batch", {}).get("refused") else "-")
        fp8 = rows.get("fp8", {})
        fp8 = fp8.get("bf16_over_fp8") or ("error" if fp8.get("ok") is False else "-")
        last = list(rows)[-1]
        peak = max((r.get("peak_gib", 0) for r in rows.values()), default=0)
        lines.append(f"| {family} | {rows.get('prompts', {}).get('recompiles', '-')} | {ours or '-'} | "
                     f"{stock or '-'} | {ratio} | {batch} | {fp8} | {peak} | {last} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny checkpoints on CPU instead of full-size transformers (the test suite's run)")
    parser.add_argument("--json", action="store_true", help="print only the JSON lines, one per phase")
    parser.add_argument("--family", action="append", choices=families.PIPELINE_FAMILIES,
                        help="run only this family (repeatable; default: every family, in registry order)")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default auto: neuron if installed, else inductor; with --tiny "
                             "aot_eager)")
    parser.add_argument("--total-s", type=positive_float, default=None,
                        help=f"seconds for all families together (default {TOTAL_S:.0f}, --tiny {TINY_TOTAL_S:.0f})")


def main(args: argparse.Namespace) -> None:
    from ...compile import resolve_backend  # imports torch: only when the command runs

    backend = default_backend(args.tiny) if args.backend is None else args.backend
    resolve_backend(backend)  # an unknown backend fails here once, not in every family's process
    names = args.family or list(families.PIPELINE_FAMILIES)

    def out(result: dict) -> None:
        print(json.dumps(result) if args.json else _text_line(result), flush=True)

    results = run(names, tiny=args.tiny, backend=backend, total_s=args.total_s, out=out)
    if not args.json:
        print()
        print(summary(results))
