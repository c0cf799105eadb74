"""`neuron-diffusers serve`: load the model once over the launched ranks and answer image requests over HTTP.

    torchrun --nproc_per_node=N -m neuron_diffusers serve --model M [--tp T] [--ulysses U] [--ring R]
        [--cfg-parallel] [--port P] ...

Global rank 0 runs the HTTP server (uvicorn, in a thread) and the scheduler; every rank, rank 0 included, serves its
replica (a data-parallel image group of tp x ulysses x ring ranks, or with `--cfg-parallel` a CFG pair of them) in
its main thread. Everything the command line says is checked before the process group starts or any weight is read,
with the job's rules.

Shutdown: SIGTERM (what torchrun, Kubernetes and `docker stop` send) stops rank 0 from accepting connections, lets
the requests in flight and in the queue finish (at most `--shutdown-timeout` seconds), then every replica leaves its
loop and every rank exits 0. A rank that gets SIGTERM waits for rank 0's word for as long. A lost rank ends the
serving ranks with exit 1: at once through the collective in flight, or within `--peer-timeout` through the
heartbeats when idle (`liveness.py`); `/health` answers 503 meanwhile.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

from ..cli import non_negative_float, positive_float, positive_int
from ..compile import warmup
from ..consistency import CallEntry
from ..distributed import (
    default_store,
    detect_runtime,
    init_distributed,
)
from ..job import DEFAULT_MAX_PIXELS, check_mesh, check_out_dir, context_mode, out_folder
from ..launch import DTYPES as DTYPES  # re-exported: serve's options took it from the job
from ..launch import LaunchSpec, add_launch_arguments, default_size, plan_launch
from ..parallel.lora import LoraSpec, parse_lora_option
from ..runner import load_pipeline
from .channel import Channel
from .liveness import EXIT_GRACE_S, Liveness
from .replica import serve_replica

#: The `serve` extra's modules (pyproject.toml).
WEB_STACK = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "python_multipart")


def size_list(value: str) -> tuple[tuple[int, int], ...]:
    """An argparse type: `1024x1024,768x1344` (WIDTHxHEIGHT, OpenAI's order) -> ((height, width), ...)."""
    sizes = []
    for item in value.split(","):
        width, _, height = item.strip().partition("x")
        if not (width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
            raise argparse.ArgumentTypeError(f"{item!r} is not a size: use WIDTHxHEIGHT, e.g. 1024x1024,768x1344")
        sizes.append((int(height), int(width)))
    return tuple(dict.fromkeys(sizes))


def named_lora(value: str) -> tuple[str, LoraSpec]:
    """An argparse type: `NAME=SOURCE[:SCALE]` (SOURCE as the job's `--lora`) -> (NAME, spec)."""
    name, equals, source = value.partition("=")
    if not equals or not name.strip() or not source.strip():
        raise argparse.ArgumentTypeError(f"{value!r}: use NAME=PATH_OR_HUB_ID[:SCALE], e.g. style=loras/ink.safetensors"
                                         ":0.8 (requests choose it by NAME)")
    return name.strip(), parse_lora_option(source)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="flux",
                        help="checkpoint folder, or a tiny family name built offline (default: flux, a tiny FLUX.1)")
    parser.add_argument("--pipeline", default=None, metavar="CLASS",
                        help="the stock pipeline class to serve the checkpoint with (default: its index's), e.g. "
                             "FluxKontextPipeline, FluxImg2ImgPipeline: image inputs through POST /v1/images/edits")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (printed)")
    parser.add_argument("--max-queue", type=positive_int, default=16,
                        help="requests that may wait for a free replica; more are answered 429 with Retry-After")
    parser.add_argument("--batch-wait-ms", type=non_negative_float, default=0.0, metavar="MS",
                        help="with --max-batch N: how long a free replica waits for compatible requests to fill its "
                             "batch (default 0: it takes those already queued)")
    parser.add_argument("--request-timeout", type=positive_float, default=600.0,
                        help="seconds a request may take before it is answered 504")
    parser.add_argument("--shutdown-timeout", type=positive_float, default=60.0,
                        help="after SIGTERM: seconds the requests in flight and queued may take to finish")
    parser.add_argument("--out", type=out_folder, default=None, metavar="DIR",
                        help="keep the images of `response_format: url` requests here and answer with http URLs "
                             "(GET /v1/images/files/NAME); without it such a URL is a data: URL")
    parser.add_argument("--keep", type=positive_int, default=1000,
                        help="with --out: the most images kept there; the oldest are deleted")
    parser.add_argument("--steps", type=positive_int, default=4, help="num_inference_steps when a request sets none")
    parser.add_argument("--max-steps", type=positive_int, default=100, help="refuse requests with more steps")
    parser.add_argument("--sizes", type=size_list, default=None,
                        help="WIDTHxHEIGHT[,...]: the sizes served (the first is the default); with --compile the "
                             "only ones, each compiled up front")
    parser.add_argument("--max-pixels", type=positive_int, default=DEFAULT_MAX_PIXELS,
                        help="refuse images larger than this many pixels (the model's own maximum applies anyway)")
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="seconds any collective may wait")
    parser.add_argument("--peer-timeout", type=positive_float, default=30.0,
                        help="seconds without a rank's heartbeat before it is taken as dead and the server exits 1 "
                             "(at most --timeout)")
    add_launch_arguments(parser, lora_type=named_lora, lora_metavar="NAME=SOURCE[:SCALE]",
                         lora_help="a LoRA requests may choose by NAME ('loras': [{'name': NAME}]), read and checked "
                                   "at start; repeat for more. A request without loras runs the base weights")


def plan_server(args, world_size: int, device_type: str):
    """Resolve and check the command line, reading no weight and starting no process group: the `ServeConfig` the
    front checks requests against, holding the `LaunchSpec` every rank loads from (`config.launch`)."""
    missing = [name for name in WEB_STACK if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"`serve` needs the web stack ({', '.join(missing)} missing): pip install "
                         "'neuron-diffusers[serve]'.")
    if args.compile and args.sizes is None:
        raise ValueError("--compile serves only the sizes it warmed up: give them with --sizes WIDTHxHEIGHT[,...].")
    _check_front(args)
    names = [name for name, _ in args.lora]
    if len(set(names)) < len(names):
        raise ValueError(f"--lora names must differ: {', '.join(sorted({n for n in names if names.count(n) > 1}))} "
                         "given twice.")
    # Every shared option checked once (each LoRA file read once, against the transformer's config, as the job does).
    launch = plan_launch(args, world_size, device_type, steps=args.steps, loras=[spec for _, spec in args.lora])
    launch = _settle_pairs(launch, world_size, compiled=bool(args.compile))
    config = _config(args, launch, world_size)
    for height, width in args.sizes or ():
        config.limits.check(height, width, f"--sizes {width}x{height}", args.max_pixels)
        config.check_split(height, width, f"--sizes {width}x{height}")
    records = launch.lora_records()
    return dataclasses.replace(config, loras={name: record for (name, _), record in zip(args.lora, records,
                                                                                          strict=True)})


def _check_front(args) -> None:
    """The server's own options: where outputs go, the port, the heartbeat timeout."""
    if args.out is not None:
        check_out_dir(args.out)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a port: use 0 .. 65535 (0 picks a free one).")
    if args.peer_timeout > args.timeout:
        raise ValueError(f"--peer-timeout {args.peer_timeout:g} is above --timeout {args.timeout:g}: a dead rank must "
                         "be noticed before a collective gives up on it. Lower --peer-timeout.")


def _settle_pairs(launch: LaunchSpec, world_size: int, *, compiled: bool) -> LaunchSpec:
    """What the server can serve of the checkpoint, and the CFG pairs: a guidance-distilled family serves the cfg
    ranks as more replicas. The mesh is checked once the pairs are settled."""
    checkpoint, adapter = launch.checkpoint, launch.checkpoint.adapter
    if compiled and not adapter.own_class:
        raise ValueError(f"--compile with --pipeline {checkpoint.pipeline_class}: its requests carry input images, "
                         "which change the compiled shapes (a recompile mid-request). Drop --compile, or serve the "
                         "checkpoint's own class.")
    if adapter.output_suffix != ".png":
        raise ValueError(f"{adapter.pipeline_class} makes {adapter.output_suffix} files, and the server answers with "
                         "images only: use `neuron-diffusers generate` for it.")
    pairs = launch.cfg
    if pairs > 1 and not adapter.takes_negative_prompt:
        print(f"neuron-diffusers serve: note: --cfg-parallel: {adapter.pipeline_class} is guidance-distilled (no true "
              "CFG), so the cfg ranks serve as more replicas instead.", file=sys.stderr)
        pairs = 1
    mode = context_mode(checkpoint, launch.ulysses, launch.ring, launch.cp_any_length, compiled=compiled)
    check_mesh(checkpoint, world_size, tp=launch.tp, ulysses=launch.ulysses, ring=launch.ring, cfg=pairs, mode=mode)
    return dataclasses.replace(launch, cfg=pairs)


def _config(args, launch: LaunchSpec, world_size: int):
    """The `ServeConfig` the HTTP front checks requests against."""
    from .request import ServeConfig  # pydantic: the `serve` extra, for the reason `_Front` gives

    checkpoint = launch.checkpoint
    mode = context_mode(checkpoint, launch.ulysses, launch.ring, launch.cp_any_length, compiled=bool(args.compile))
    cp = launch.ulysses * launch.ring
    return ServeConfig(checkpoint, checkpoint.adapter.size_limits(checkpoint),
                       args.sizes[0] if args.sizes else default_size(args.model), args.steps, args.max_steps,
                       args.max_pixels, launch.tp, world_size // (launch.tp * cp * launch.cfg), launch.cfg,
                       launch.dtype, sizes=args.sizes if args.compile else None, ulysses=launch.ulysses,
                       ring=launch.ring, cp_split=mode is not None and not mode.any_length, cache=launch.cache_text,
                       plan=launch.plan, launch=launch, max_batch=args.batch_size)


class _Signals:
    """SIGTERM (and Ctrl-C) while serving: note the time, and on rank 0 tell the HTTP server to stop accepting."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.received_at: float | None = None
        self.http = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        if self.received_at is None:
            self.received_at = time.monotonic()
        if self.http is not None:
            self.http.should_exit = True

    def past_deadline(self) -> bool:
        """A rank that got the signal waits this long for rank 0's stop, then gives up."""
        return self.received_at is not None and time.monotonic() - self.received_at > self.timeout_s + 5


def main(args: argparse.Namespace) -> int:
    """`neuron-diffusers serve`: exit 0 after a SIGTERM once everything in flight is answered; 1 when a rank failed."""
    runtime = detect_runtime()
    config = plan_server(args, runtime.world_size, runtime.device_type)
    launch = config.launch
    listener = _listen(args.host, args.port) if runtime.rank == 0 else None
    signals = _Signals(args.shutdown_timeout)
    mesh = init_distributed(tp=config.tp, ulysses=config.ulysses, ring=config.ring, cfg=config.cfg,
                            order=launch.mesh_order, cross_node=launch.cross_node, timeout_s=args.timeout)
    front = _Front(config, args, listener, signals) if runtime.rank == 0 else None
    liveness = Liveness(default_store(), runtime.rank, runtime.world_size, args.peer_timeout,
                        on_failure=front.scheduler.fail if front is not None else lambda failure: None).start()
    try:
        pipe = load_pipeline(launch, mesh)  # compiled as its last step with --compile
        if args.compile:
            warmup(pipe, list(args.sizes), num_inference_steps=2)
        # Ready when every replica is: the handshake waits (up to the collective timeout) for the slowest load.
        CallEntry(list(range(runtime.world_size)), "serve ready", timeout_s=None).enter([config.checkpoint.source])
        if front is not None:
            front.scheduler.ready.set()
            print(f"neuron-diffusers serve: ready: {config.replicas} replica(s) of tp={config.tp} ulysses="
                  f"{config.ulysses} ring={config.ring} cfg={config.cfg}", file=sys.stderr, flush=True)
        channel = Channel(mesh["dp"].get_local_rank(), default_store())
        serve_replica(pipe, channel, give_up=lambda: signals.past_deadline() or liveness.failure is not None)
    except (dist.DistError, TimeoutError, RuntimeError) as error:
        failure = liveness.failure or str(error)
        if front is not None:
            front.fail(failure)
        print(f"neuron-diffusers serve: error on rank {runtime.rank}: {failure}", file=sys.stderr, flush=True)
        return 1
    if front is not None:
        front.join()
    # Every rank past its last task, watched meanwhile: a rank that died while the queue drained after a SIGTERM
    # (torchrun's, when a peer was killed) ends this with exit 1 within --peer-timeout.
    return 0 if liveness.leave_together(runtime.world_size, args.timeout) else 1


def _listen(host: str, port: int) -> socket.socket:
    """Bind the port before anything loads: a port in use is an error now, not after minutes of loading."""
    try:
        listener = socket.create_server((host, port), reuse_port=False)
    except OSError as error:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({error.strerror or error}). Choose "
                         "another --port (0 picks a free one).") from None
    return listener


class _Front:
    """Rank 0's HTTP server (uvicorn in a thread, so the main thread can serve its replica) and the scheduler; when
    the HTTP server has finished its last response after a SIGTERM, the scheduler drains and stops the replicas."""

    def __init__(self, config, args, listener: socket.socket, signals: _Signals):
        # Imported here: the web stack is the `serve` extra, needed by this command only (and `cli` imports this
        # module for its arguments whatever the command).
        import uvicorn

        from .app import build_app
        from .files import ImageFiles
        from .metrics import Metrics
        from .scheduler import Scheduler

        metrics = Metrics()
        store = default_store()
        self.scheduler = Scheduler([Channel(r, store) for r in range(config.replicas)], args.max_queue,
                                   metrics, max_batch=config.max_batch, batch_wait_s=args.batch_wait_ms / 1000)
        files = ImageFiles(args.out, args.keep) if args.out is not None else None
        app = build_app(config, self.scheduler, metrics, args.request_timeout, files)
        self.http = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                  timeout_graceful_shutdown=args.shutdown_timeout))
        signals.http = self.http
        if signals.received_at is not None:
            self.http.should_exit = True
        self._http_thread = threading.Thread(target=self.http.run, kwargs={"sockets": [listener]}, name="http",
                                             daemon=True)
        self._stopper = threading.Thread(target=self._stop_after_http, name="stopper", daemon=True)
        self.scheduler.start()
        self._http_thread.start()
        self._stopper.start()
        host, port = listener.getsockname()[:2]
        print(f"neuron-diffusers serve: listening on http://{host}:{port} (loading the model)", file=sys.stderr,
              flush=True)

    def _stop_after_http(self) -> None:
        self._http_thread.join()
        self.scheduler.stop()

    def join(self) -> None:
        self._stopper.join()

    def fail(self, failure: str) -> None:
        """A rank is gone: every queued and in-flight request is answered 503, and the HTTP server gets up to
        `EXIT_GRACE_S` to send those answers and close before this process exits (else its clients would see the
        connection reset instead of the reason)."""
        self.scheduler.fail(failure)
        self.http.should_exit = True
        self._http_thread.join(EXIT_GRACE_S)
