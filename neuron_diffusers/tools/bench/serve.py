"""`neuron-diffusers bench serve`: the server's throughput and latency percentiles beside the batch job's throughput,
same model, mesh, size and steps, in one run.

The server is started under torchrun on loopback (`serve --port 0`), warmed with one request, then sent `--requests`
requests (one image each, distinct seeds) with at most `--concurrency` in flight, `--rounds` times: images per
second is requests / wall time of a round, latencies are per request (arrival to answer, client side). After each
of the server's rounds the batch job makes the same number of images from a prompt file (`generate --prompts`) on
the same mesh, while the server idles; its images per second comes from summary.json's per-image seconds, per TP
group, leaving out each group's first image (its first call pays one-time costs, like the server's warm-up
request). "s per image on a replica" is the time inside `generate` (the server's /metrics; the job's per-image
seconds, which include its save), so the gap between it and 1 / images per second is what serving adds around the
images. Figures: median [min - max] over the rounds; the ratio is taken per round (a round's serve over its batch),
since the load of a shared machine changes between rounds. On an accelerator the batch job needs the devices the
idle server holds: there, compare with a batch job run on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from ...cli import positive_int

_LISTENING = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    """`neuron-diffusers serve` under torchrun, on loopback with a free port: `url` once it listens, `stop()` sends
    SIGTERM (`ranks_only`: to the rank processes, as torchrun would; else to torchrun) and returns the exit status."""

    def __init__(self, nproc: int, serve_args: list[str], env: dict | None = None, start_timeout_s: float = 300.0):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m",
                   "neuron_diffusers", "serve", "--host", "127.0.0.1", "--port", "0", *serve_args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, start_new_session=True)
        self.lines: list[str] = []
        self._listening = threading.Event()
        self.url: str | None = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(start_timeout_s) or self.url is None:
            self.process.kill()
            raise RuntimeError("the server did not start listening:\n" + "".join(self.lines[-40:]))

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            match = _LISTENING.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._listening.set()
        self._listening.set()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        import httpx  # the `serve` extra; `cli` imports this module for its arguments whatever the command

        deadline = time.monotonic() + timeout_s
        # One client for every probe: `httpx.get` builds one (and its SSL context) per call, ~25 ms of CPU each.
        with httpx.Client(timeout=5, limits=httpx.Limits(max_keepalive_connections=0)) as probes:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError("the server exited while loading:\n" + "".join(self.lines[-40:]))
                try:
                    if probes.get(f"{self.url}/ready").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")

    def rank_pids(self) -> list[int]:
        """The rank processes: torchrun's children (Linux /proc)."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(child) for child in children]

    def stop(self, ranks_only: bool = True, timeout_s: float = 120.0) -> int:
        for pid in self.rank_pids() if ranks_only else [self.process.pid]:
            os.kill(pid, signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()


def serve_round(url: str, body: dict, requests: int, concurrency: int, first_seed: int) -> dict:
    """`requests` requests (seeds from `first_seed`) with at most `concurrency` in flight: images per second and
    latency percentiles (seconds, client side)."""
    return asyncio.run(_send(url, body, requests, concurrency, first_seed))


async def _send(url: str, body: dict, requests: int, concurrency: int, first_seed: int) -> dict:
    import httpx  # the `serve` extra (see `ServerProcess.wait_ready`)

    limit = asyncio.Semaphore(concurrency)
    latencies, failures = [], []

    async def one(client, seed: int) -> None:
        async with limit:
            start = time.perf_counter()
            response = await client.post(f"{url}/v1/images/generations", json={**body, "seed": seed})
            latencies.append(time.perf_counter() - start)
            if response.status_code != 200:
                failures.append(f"{response.status_code}: {response.text[:200]}")

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, first_seed + i) for i in range(requests)))
        wall = time.perf_counter() - start
    if failures:
        raise RuntimeError(f"{len(failures)} request(s) failed, e.g. {failures[0]}")
    return {"images_per_s": requests / wall, **{f"p{q}": percentile(latencies, q) for q in (50, 95, 99)}}


def percentile(values: list[float], q: int) -> float:
    """The `q`th percentile, linearly interpolated between the closest ranks (`statistics.quantiles`, inclusive):
    the one method of the benches' latency percentiles (`bench serve`, `bench throughput`)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def generate_seconds(url: str) -> float:
    """The seconds the server's replicas spent in `generate` so far (its /metrics), to tell the time of the images
    themselves from the time around them (HTTP, queue, PNG, the store)."""
    import httpx  # the `serve` extra (see `ServerProcess.wait_ready`)

    match = re.search(r'phase_seconds_total\{phase="generate"\} (\S+)', httpx.get(f"{url}/metrics").text)
    return float(match.group(1)) if match else 0.0


def batch_round(args, mesh_args: list[str], folder: Path, index: int) -> dict:
    """One batch job of `--requests` prompts; images per second from summary.json (see the module docstring)."""
    width, _, height = args.size.partition("x")
    prompts = folder / "prompts.txt"
    prompts.write_text("".join(f"a red fox, take {i}\n" for i in range(args.requests)))
    out = folder / f"batch{index}"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "-m",
               "neuron_diffusers", "generate", "--model", args.model, "--prompts", str(prompts), "--out", str(out),
               *mesh_args, "--height", height, "--width", width, "--steps", str(args.steps)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the batch job failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    per_group = defaultdict(list)
    for image in sorted(json.loads((out / "summary.json").read_text())["images"], key=lambda image: image["index"]):
        per_group[image["rank"]].append(image["seconds"])
    # Each TP group (replica) in its steady state, its first image left out; the groups run side by side.
    steady = [seconds[1:] for seconds in per_group.values() if len(seconds) > 1]
    return {"images_per_s": sum(len(s) / sum(s) for s in steady),
            "seconds_per_image": sum(map(sum, steady)) / sum(map(len, steady))}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f} - {max(values):.3f}]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="flux", help="checkpoint folder or tiny family (default: flux)")
    parser.add_argument("--nproc", type=positive_int, default=2, help="ranks (default 2)")
    parser.add_argument("--tp", type=positive_int, default=None, help="TP degree (default: all ranks)")
    parser.add_argument("--ulysses", type=positive_int, default=1, help="context parallelism (Ulysses degree)")
    parser.add_argument("--ring", type=positive_int, default=1, help="context parallelism (ring degree)")
    parser.add_argument("--cfg-parallel", action="store_true")
    parser.add_argument("--requests", type=positive_int, default=16, help="requests per round (at most 1000)")
    parser.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight (at most 64)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds of each, for the spread")
    parser.add_argument("--size", default="128x128", help="WIDTHxHEIGHT (default 128x128)")
    parser.add_argument("--steps", type=positive_int, default=4)
    parser.add_argument("--json", type=Path, default=None, help="also write the rounds here ('-': print them as JSON)")


def main(args: argparse.Namespace) -> int:
    if args.requests > 1000 or args.concurrency > 64:
        raise ValueError("bench serve is bounded: --requests at most 1000, --concurrency at most 64.")
    if not re.fullmatch(r"[0-9]+x[0-9]+", args.size):
        raise ValueError(f"--size {args.size}: use WIDTHxHEIGHT, e.g. 128x128.")
    mesh_args = ((["--tp", str(args.tp)] if args.tp else []) + (["--cfg-parallel"] if args.cfg_parallel else [])
                 + [f"--{name}={degree}" for name, degree in (("ulysses", args.ulysses), ("ring", args.ring))
                    if degree > 1])
    body = {"prompt": "a red fox", "size": args.size, "num_inference_steps": args.steps}
    served, batch = [], []
    # One server for every round; the batch job's rounds alternate with the server's (which then sits idle), so
    # both meet the same load on a shared machine.
    server = ServerProcess(args.nproc, ["--model", args.model, *mesh_args, "--max-queue", str(args.requests),
                                        "--steps", str(args.steps), "--sizes", args.size])
    try:
        server.wait_ready()
        serve_round(server.url, body, 1, 1, 10**6)  # warm-up: first-call costs are not throughput
        with tempfile.TemporaryDirectory(prefix="bench-serve-") as folder:
            for index in range(args.rounds):
                before = generate_seconds(server.url)
                served.append(serve_round(server.url, body, args.requests, args.concurrency, index * args.requests))
                served[-1]["seconds_per_image"] = (generate_seconds(server.url) - before) / args.requests
                batch.append(batch_round(args, mesh_args, Path(folder), index))
                print(f"round {index + 1}: serve {served[-1]['images_per_s']:.3f}, batch "
                      f"{batch[-1]['images_per_s']:.3f} images/s", file=sys.stderr, flush=True)
    finally:
        server.stop(ranks_only=False)
    ratios = [s["images_per_s"] / b["images_per_s"] for s, b in zip(served, batch, strict=True)]
    print(f"{args.model}, {args.nproc} rank(s) {' '.join(mesh_args) or '(tp = all)'}, {args.size}, {args.steps} "
          f"steps, {args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}")
    print("| | images/s | s per image on a replica | p50 latency (s) | p95 (s) | p99 (s) |\n"
          "|---|---:|---:|---:|---:|---:|")
    print(f"| serve | {_spread([r['images_per_s'] for r in served])} | "
          f"{_spread([r['seconds_per_image'] for r in served])} | "
          + " | ".join(_spread([r[f'p{q}'] for r in served]) for q in (50, 95, 99)) + " |")
    print(f"| batch job | {_spread([r['images_per_s'] for r in batch])} | "
          f"{_spread([r['seconds_per_image'] for r in batch])} | - | - | - |")
    print(f"serve / batch images per second, per round: {_spread(ratios)}")
    if args.json:
        setup = {"model": args.model, "nproc": args.nproc, "mesh": mesh_args, "size": args.size, "steps": args.steps,
                 "requests": args.requests, "rounds": args.rounds, "concurrency": args.concurrency}
        stored = json.dumps({"setup": setup, "serve": served, "batch": batch, "ratios": ratios}, indent=2)
        print(stored) if str(args.json) == "-" else args.json.write_text(stored)  # "-": stdout, for `bench record`
    return 0
