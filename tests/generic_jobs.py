"""Rank jobs of `test_generic.py`: stock pipelines on drafted plans through `load_pipeline`, `generate` and the job."""

from __future__ import annotations

CONTROL_PROMPT = "a capybara in a wizard hat"
PROMPT = "a red fox in the snow"


def generic_checks(checkpoints: dict, calls: dict) -> dict:
    """Per pipeline at TP=2, one case a key (`rank_cases.record`): the latents of `PROMPT` and of the control prompt
    (seed 0), whether this rank holds a text encoder, whether its transformer is sharded, and the decoded output."""
    import gc

    import runner_jobs
    import torch
    from rank_cases import CaseError, record
    from torch.distributed.tensor import DTensor

    import neuron_diffusers as nd

    torch.set_num_threads(1)
    mesh = nd.init_distributed(tp=2)
    report = {}
    for name, checkpoint in checkpoints.items():
        pipe = record(report, f"{name}/load", nd.load_pipeline, checkpoint, mesh)
        if isinstance(pipe, CaseError):
            continue
        del report[f"{name}/load"]
        for label, prompt in (("latents", PROMPT), ("control", CONTROL_PROMPT)):
            made = record(report, f"{name}/{label}", pipe.generate, prompt, seed=0, output_type="latent",
                          **calls[name])
            report[f"{name}/{label}"] = made if made is None or not isinstance(made, list) else made[0].cpu()
        record(report, f"{name}/decoded", pipe.generate, PROMPT, seed=0, **calls[name])
        record(report, f"{name}/divergence", runner_jobs._divergence, pipe, {**calls[name], "output_type": "latent"})
        record(report, f"{name}/refused", _refusals, pipe, calls[name])
        transformer = pipe.adapter.transformer_of(pipe.pipe)
        report[f"{name}/roles"] = {
            "holds_text_encoder": any(getattr(pipe.pipe, c, None) is not None for c in pipe.adapter.text_components),
            "encoder": pipe.encoder is not None,
            "sharded": sum(isinstance(p, DTensor) for p in transformer.parameters()),
            "family": pipe.checkpoint.family.display_name,
        }
        del pipe
        gc.collect()
    return report


def generic_cp_checks(checkpoint, call: dict) -> dict:
    """On 4 ranks, one pipeline at tp=2 x ulysses=2 on its drafted TP plan and its verified CP plan: the latents of
    `PROMPT` and of the control prompt (seed 0), how many attention processors are routed through diffusers' dispatch
    and hold the parallel config, and what a call whose text does not split says."""
    from rank_cases import one_thread, record

    import neuron_diffusers as nd
    from neuron_diffusers.compat.attention_route import is_routed

    report = {}
    with one_thread():
        pipe = nd.load_pipeline(checkpoint, nd.init_distributed(tp=2, ulysses=2))
        for label, prompt in (("latents", PROMPT), ("control", CONTROL_PROMPT)):
            made = record(report, label, pipe.generate, prompt, seed=0, output_type="latent", **call)
            report[label] = made[0].cpu() if isinstance(made, list) else made
        processors = [m.processor for m in pipe.adapter.transformer_of(pipe.pipe).modules() if hasattr(m, "processor")]
        # (routed and holding the parallel config, all of them): every joint attention of SD3 calls SDPA itself.
        report["routed"] = (sum(is_routed(p) and p._parallel_config is not None for p in processors), len(processors))
        odd = {k: v for k, v in call.items() if k != "max_sequence_length"}
        try:
            pipe.generate(PROMPT, seed=0, output_type="latent", **odd)
            report["odd_text"] = "accepted"
        except ValueError as error:
            report["odd_text"] = str(error)
    return report


def _refusals(pipe, call: dict) -> dict:
    """What `generate` says, on every rank, to inputs it owns: embeddings, and several outputs per prompt."""
    refused = {}
    for name in ("prompt_embeds", "num_images_per_prompt", "num_videos_per_prompt"):
        try:
            pipe.generate(PROMPT, **{name: None if name == "prompt_embeds" else 2}, **call)
            refused[name] = "accepted"
        except ValueError as error:
            refused[name] = str(error)
    return refused


def generic_job(argv: list[str]):
    """The `generate` job on the pool's ranks (as torchrun would run it): rank 0's summary."""
    from neuron_diffusers.cli import _parser
    from neuron_diffusers.distributed import detect_runtime
    from neuron_diffusers.job import plan_job, run_job

    args = _parser().parse_args(["generate", *argv])
    runtime = detect_runtime()
    plan = plan_job(args, runtime.world_size, runtime.device_type)
    return run_job(plan, overwrite=False, compile_backend=None, warm=False, timeout_s=300)


def served_and_generated(model: str):
    """The server's path for one request (`plan_work`, then the replica loop's `make`) at TP=2, and the job's own
    `generate` call for the same request: the leader's two images as arrays."""
    import io

    import numpy as np
    import torch
    from PIL import Image

    import neuron_diffusers as nd
    from neuron_diffusers.checkpoint import resolve
    from neuron_diffusers.job import call_kwargs
    from neuron_diffusers.serve.replica import make
    from neuron_diffusers.serve.request import ImageRequest, ServeConfig, plan_work

    torch.set_num_threads(1)
    checkpoint = resolve(model)
    config = ServeConfig(checkpoint, checkpoint.adapter.size_limits(checkpoint), (32, 32), 2, 50, 2048 * 2048, 2, 1,
                         1, "float32")
    work = plan_work(ImageRequest(prompt=PROMPT, size="32x32", seed=3), config)
    pipe = nd.load_pipeline(checkpoint, nd.init_distributed(tp=2), torch_dtype=torch.float32)
    served = make(pipe, work.task(), leader=pipe.is_leader)
    request = work.requests[0]
    generated = pipe.generate(request.prompt, seed=request.seed, **call_kwargs(request, pipe.adapter))
    if served is None:
        return None
    assert "images" in served, served
    return (np.asarray(Image.open(io.BytesIO(served["images"][0])).convert("RGB")),
            np.asarray(generated[0].convert("RGB")))
