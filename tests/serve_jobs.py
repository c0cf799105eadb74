"""Rank jobs for tests/test_serve.py, run on the session's pool of ranks (`rank_pool`; module level, so a rank can
import them)."""

from __future__ import annotations

import numpy as np


def _served_and_job(pipe, request, task: dict, loras: list) -> tuple[bytes, np.ndarray]:
    from neuron_diffusers.job import call_kwargs
    from neuron_diffusers.serve.replica import make

    served = make(pipe, task, leader=True)
    assert "images" in served, served
    pipe.set_loras(loras)
    job = pipe.generate(request.prompt, seed=request.seed, negative_prompt=request.negative_prompt,
                        **request.image_kwargs(), **call_kwargs(request, pipe.adapter))
    return served["images"][0], np.asarray(job[0].convert("RGB"))


def replica_and_job(model: str, pipeline_class: str, cases: dict, request) -> dict:
    """One replica rank, for each case `name: (task, loras)` in turn: the PNG the server's replica loop makes of
    `task`, and the image the job's own call makes of its `request` (same input files) with `loras` fused as the job
    fuses them; each case recorded on its own (`rank_cases.record`)."""
    import torch
    from rank_cases import CaseError, record

    from neuron_diffusers import init_distributed, load_pipeline
    from neuron_diffusers.checkpoint import resolve

    report = {}
    pipe = record(report, "load", load_pipeline, resolve(model, pipeline_class), init_distributed(tp=1),
                  torch_dtype=torch.float32)
    if isinstance(pipe, CaseError):
        return dict.fromkeys(cases, pipe)
    del report["load"]
    for name, (task, loras) in cases.items():
        record(report, name, _served_and_job, pipe, request, task, loras)
    return report


def batched_server(prefix: str, serve_argv: list[str], bodies: list[dict], bad_body: dict,
                   failing_seed: int) -> dict | None:
    """`serve` as its command runs it, minus uvicorn: the command line planned by `plan_server`, the model loaded on
    every rank, rank 0's app (ASGI, in process) and scheduler, and every rank in the replica loop (the channel on a
    store prefix of its own). Rank 0 meanwhile sends, in a thread, three rounds at once, each recorded on its own
    with /metrics after it:

    - `together`: the requests `bodies`;
    - `bad_among`: `bodies[1:]` and `bad_body` (which the front refuses);
    - `failing_mate`: `bodies`' tasks straight to the scheduler, `bodies[2]` with `failing_seed` (a seed the front
      would refuse, so it reaches the replica's `generate`, which refuses it).

    Returns rank 0's rounds, None on the other ranks."""
    import asyncio
    import threading

    import httpx
    import torch.distributed as dist
    from rank_cases import record

    from neuron_diffusers.cli import _parser
    from neuron_diffusers.distributed import default_store, detect_runtime, init_distributed
    from neuron_diffusers.runner import load_pipeline
    from neuron_diffusers.serve.app import GENERATIONS, build_app
    from neuron_diffusers.serve.channel import Channel
    from neuron_diffusers.serve.command import plan_server
    from neuron_diffusers.serve.metrics import Metrics
    from neuron_diffusers.serve.replica import serve_replica
    from neuron_diffusers.serve.request import ImageRequest, plan_work
    from neuron_diffusers.serve.scheduler import Scheduler

    runtime = detect_runtime()
    config = plan_server(_parser().parse_args(["serve", *serve_argv]), runtime.world_size, "cpu")
    mesh = init_distributed(tp=config.tp)
    pipe = load_pipeline(config.launch, mesh)
    store = dist.PrefixStore(prefix, default_store())
    if runtime.rank != 0:
        serve_replica(pipe, Channel(0, store))
        return None
    metrics = Metrics()
    args = _parser().parse_args(["serve", *serve_argv])
    scheduler = Scheduler([Channel(0, store)], 16, metrics, max_batch=config.max_batch,
                          batch_wait_s=args.batch_wait_ms / 1000)
    app = build_app(config, scheduler, metrics, request_timeout_s=300)
    report: dict = {}

    async def post_all(all_bodies):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server", timeout=300) as client:
            answers = await asyncio.gather(*(client.post(GENERATIONS, json=body) for body in all_bodies))
            text = (await client.get("/metrics")).text
        return [(answer.status_code, answer.json()) for answer in answers], text

    def failing_mate():
        works = [plan_work(ImageRequest.model_validate(body), config) for body in bodies]
        tasks = [work.task() for work in works]
        tasks[2] = {**tasks[2], "seed": failing_seed}
        futures = [scheduler.submit(task, 1, work.batch_key) for task, work in zip(tasks, works, strict=True)]
        return [future.result(300) for future in futures], metrics.text().decode()

    def rounds():
        try:
            record(report, "together", lambda: asyncio.run(post_all(bodies)))
            record(report, "bad_among", lambda: asyncio.run(post_all([*bodies[1:], bad_body])))
            record(report, "failing_mate", failing_mate)
        finally:
            scheduler.stop()

    scheduler.ready.set()
    scheduler.start()
    sender = threading.Thread(target=rounds)
    sender.start()
    report["tasks"] = serve_replica(pipe, Channel(0, store))
    sender.join()
    return report
