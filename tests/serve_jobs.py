"""Functions that run on spawned gloo ranks for tests/test_serve.py (module level, so `spawn` can import them)."""

from __future__ import annotations

import numpy as np


def replica_and_job(model: str, pipeline_class: str, cases: list, request) -> list[tuple[bytes, np.ndarray]]:
    """One replica rank, for each `(task, loras)` in turn: the PNG the server's replica loop makes of `task`, and the
    image the job's own call makes of its `request` (same input files) with `loras` fused as the job fuses them."""
    import torch

    from neuron_diffusers import init_distributed, load_pipeline
    from neuron_diffusers.checkpoint import resolve
    from neuron_diffusers.job import call_kwargs
    from neuron_diffusers.serve.replica import make

    pipe = load_pipeline(resolve(model, pipeline_class), init_distributed(tp=1), torch_dtype=torch.float32)
    made = []
    for task, loras in cases:
        served = make(pipe, task, leader=True)
        assert "images" in served, served
        pipe.set_loras(loras)
        job = pipe.generate(request.prompt, seed=request.seed, negative_prompt=request.negative_prompt,
                            **request.image_kwargs(), **call_kwargs(request, pipe.adapter))
        made.append((served["images"][0], np.asarray(job[0].convert("RGB"))))
    return made
