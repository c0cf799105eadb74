"""Rank jobs of `test_generic.py`: stock pipelines on drafted plans through `load_pipeline`, `generate` and the job."""

from __future__ import annotations

CONTROL_PROMPT = "a capybara in a wizard hat"
PROMPT = "a red fox in the snow"


def generic_checks(checkpoints: dict, calls: dict) -> dict:
    """Per pipeline at TP=2, one case a key (`rank_cases.record`): the latents of `PROMPT` and of the control prompt
    (seed 0), whether this rank holds a text encoder, whether its transformer is sharded, and the decoded output."""
    import gc

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


def generic_job(argv: list[str]):
    """The `generate` job on the pool's ranks (as torchrun would run it): rank 0's summary."""
    from neuron_diffusers.cli import _parser
    from neuron_diffusers.distributed import detect_runtime
    from neuron_diffusers.job import plan_job, run_job

    args = _parser().parse_args(["generate", *argv])
    runtime = detect_runtime()
    plan = plan_job(args, runtime.world_size, runtime.device_type)
    return run_job(plan, overwrite=False, compile_backend=None, warm=False, timeout_s=300)
