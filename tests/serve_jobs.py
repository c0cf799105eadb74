"""Functions that run on spawned gloo ranks for tests/test_serve.py (module level, so `spawn` can import them)."""

from __future__ import annotations

import numpy as np


def replica_and_job_edit(model: str, pipeline_class: str, task: dict, request) -> tuple[bytes, np.ndarray]:
    """One replica rank: the PNG the server's replica loop makes of `task` (an edits request), and the image the
    job's own call makes of its `request` for the same input file."""
    import torch

    from neuron_diffusers import init_distributed, load_pipeline
    from neuron_diffusers.checkpoint import resolve
    from neuron_diffusers.job import call_kwargs
    from neuron_diffusers.serve.replica import make

    pipe = load_pipeline(resolve(model, pipeline_class), init_distributed(tp=1), torch_dtype=torch.float32)
    served = make(pipe, task, leader=True)
    assert "images" in served, served
    job = pipe.generate(request.prompt, seed=request.seed, negative_prompt=request.negative_prompt,
                        **request.image_kwargs(), **call_kwargs(request, pipe.adapter))
    return served["images"][0], np.asarray(job[0].convert("RGB"))
