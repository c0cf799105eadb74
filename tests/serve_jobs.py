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
