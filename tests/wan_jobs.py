"""Rank jobs of tests/test_wan.py: Wan through `load_pipeline(...).generate(...)` at tp=2 and at tp=2 x ulysses=2."""

from __future__ import annotations

from rank_cases import one_thread, record

import neuron_diffusers as nd

#: The control prompt: the same call with it must move the latents by far more than the tolerance.
PROMPTS = ("a red fox in the snow", "a capybara in a wizard hat")
NEGATIVE = "blurry, low quality"
#: Two steps of 9 frames at 32 x 32: 3 latent frames of 2 x 2 tokens (12 video tokens: they split for ulysses=2).
CALL = dict(height=32, width=32, num_frames=9, num_inference_steps=2)


def _latents(pipe, **kwargs) -> list | None:
    """Each prompt's latents at seed 0 (the leader's; None elsewhere); default guidance: CFG, empty negative."""
    outputs = [pipe.generate(prompt, seed=0, output_type="latent", **CALL, **kwargs) for prompt in PROMPTS]
    return None if outputs[0] is None else [output[0].clone() for output in outputs]


def _forwards(pipe) -> int:
    return pipe.times.calls.get("transformer forward", 0)


def _run(checkpoint, mesh) -> dict:
    pipe = nd.load_pipeline(checkpoint, mesh)
    transformer = pipe.adapter.transformer_of(pipe.pipe)
    norm = transformer.blocks[0].attn1.norm_q
    before = _forwards(pipe)
    latents = _latents(pipe)
    return {
        "latents": latents,
        "forwards": _forwards(pipe) - before,
        "negative": _latents(pipe, negative_prompt=NEGATIVE, guidance_scale=3.0),
        "norm_width": tuple(norm.weight.to_local().shape),
        "local_heads": transformer.blocks[0].attn1.heads,
        "cp": pipe.cp_mode is not None,
        "encoder": pipe.encoder is not None,
    }


def wan_job(checkpoint) -> dict:
    """On 4 ranks: tp=2 (two replicas), tp=2 x ulysses=2 (one image group of 4), then a CFG pair of TP=2 groups
    (each computes one branch of every guided step)."""
    report = {}
    with one_thread():
        record(report, "tp2", _run, checkpoint, nd.init_distributed(tp=2))
        record(report, "tp2u2", _run, checkpoint, nd.init_distributed(tp=2, ulysses=2))
        record(report, "tp2cfg2", _run, checkpoint, nd.init_distributed(tp=2, cfg=2))
    return report


def _expert_calls(module) -> list:
    """Counts the forwards of `module` (a list that grows by one per call)."""
    calls = []
    module.register_forward_pre_hook(lambda *args: calls.append(1))
    return calls


def _wan22(checkpoint, mesh) -> dict:
    from torch.distributed.tensor import DTensor

    pipe = nd.load_pipeline(checkpoint, mesh)
    expert = pipe.pipe.transformer_2
    calls = {"transformer": _expert_calls(pipe.pipe.transformer), "transformer_2": _expert_calls(expert)}
    latents = [pipe.generate(prompt, seed=0, output_type="latent", **CALL_22) for prompt in PROMPTS]
    return {
        "latents": None if latents[0] is None else [output[0].clone() for output in latents],
        "calls": {name: len(made) for name, made in calls.items()},
        "expert_sharded": isinstance(expert.blocks[0].attn1.to_q.weight, DTensor),
        "expert_heads": expert.blocks[0].attn1.heads,
    }


def wan22_job(checkpoint) -> dict:
    """Wan 2.2 A14B's layout (a high-noise `transformer` and a low-noise `transformer_2`) on 2 ranks: at tp=2 both
    experts sharded with the same plan, each called for its share of the steps; then a CFG pair of one rank each,
    where each expert's cond and uncond calls run on the two ranks at once."""
    report = {}
    with one_thread():
        record(report, "tp2", _wan22, checkpoint, nd.init_distributed(tp=2))
        record(report, "cfg2", _wan22, checkpoint, nd.init_distributed(tp=1, cfg=2))
    return report


#: Four steps (two per expert at `boundary_ratio=0.8`) of the small clip.
CALL_22 = {**CALL, "num_inference_steps": 4}
