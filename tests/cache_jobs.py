"""Functions that run on the session's gloo rank pool for tests/test_cache.py (module level, so the pool imports
them), one job a case, each result recorded on its own (`rank_cases.record`)."""

from __future__ import annotations

import gc

import numpy as np
import torch
import torch.distributed as dist
from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks.first_block_cache import FBCHeadBlockHook
from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS
from rank_cases import CaseError, one_thread, record

import neuron_diffusers as nd
from neuron_diffusers import tiny
from neuron_diffusers.compile import compile_repeated_blocks, compile_report, warmup
from neuron_diffusers.parallel.cache import enable_group_cache

PROMPT, NEGATIVE = "a red fox in the snow", "blurry, low quality"
STEPS = 8
THRESHOLD = 0.5  # the tiny random models' first-block residual moves a lot: at 0.5 they skip some steps, not all
#: Families stock diffusers cannot cache (no block metadata; Flux2Pipeline and MiniMax-H3 set no cache context),
#: and the cache each runs: a FirstBlockCache threshold, or "mag". Compared with the same cache in one process.
ALONE_CASES = {"qwenimage21": 1.0, "h3": 0.2, "flux2": "mag"}


def taylorseer(cache_interval: int = 2):
    return TaylorSeerCacheConfig(cache_interval=cache_interval, disable_cache_before_step=2,
                                 taylor_factors_dtype=torch.float32)


def mag_cache(threshold: float = 0.2):
    """MagCache with diffusers' FLUX.1-dev ratios (interpolated to the steps): a fixed schedule that skips."""
    return MagCacheConfig(mag_ratios=FLUX_MAG_RATIOS, num_inference_steps=STEPS, threshold=threshold)


def config_of(name: str):
    if name == "taylorseer":
        return taylorseer()
    if name == "mag":
        return mag_cache()
    return FirstBlockCacheConfig(threshold=THRESHOLD if name == "first-block" else name)


def control_config_of(name: str):
    """The controls' cache: the same kind at another threshold, 0, where it skips nothing (TaylorSeer, which has no
    threshold: an interval of 1). Its output must differ from the cached one by more than the tolerance."""
    if name == "taylorseer":
        return taylorseer(cache_interval=1)
    if name == "mag":
        return mag_cache(threshold=0.0)
    return FirstBlockCacheConfig(threshold=0.0)


def call_of(family: str) -> dict:
    call = {**tiny.smallest_call(family), "num_inference_steps": STEPS}
    if family == "flux":
        call["max_sequence_length"] = 32  # 32 tokens instead of 512 keep the tiny FLUX.1 quick
    if family != "h3":
        call["output_type"] = "np"
    return call


#: One batch of `generate(batch_size=3)` under a cache, image i seeded 0 + i (stock: a list of generators).
BATCH = [PROMPT, "a lighthouse on a cliff at dusk", "a red fox on the snow"]
#: The (family, cache) cases whose TP=2 job also makes `BATCH` in one call.
BATCHED = (("flux", "first-block"), ("flux", "taylorseer"))

#: True classifier-free guidance: a negative prompt and a scale above 1 (FLUX.1 and Qwen-Image alike).
TRUE_CFG = {"negative_prompt": NEGATIVE, "true_cfg_scale": 4.0}


def as_arrays(output) -> dict | None:
    """An image (float HWC in [0, 1]) or MiniMax-H3's frames and audio, as numpy; None on ranks without output."""
    if output is None:
        return None
    if hasattr(output, "frames"):
        return {"frames": output.frames.numpy(), "audio": output.audio.numpy()}
    return {"image": np.asarray(output, dtype=np.float32)}


def _generation(pipe, family: str, **kwargs) -> dict:
    outputs = pipe.generate(PROMPT, seed=0, **{**call_of(family), **kwargs})
    return {"output": as_arrays(outputs[0] if outputs else None), "counts": pipe.cache_counts[-1],
            "decisions": [(d.context, d.local, d.shared) for d in pipe.cache.decisions]}


def _batched(pipe, family: str) -> dict:
    """`BATCH` in one stock call (latents), with each image's counts and the call's shared decisions."""
    outputs = pipe.generate(BATCH, seed=0, batch_size=len(BATCH), **{**call_of(family), "output_type": "latent"})
    return {"latents": None if outputs is None else [output.float().numpy() for output in outputs],
            "counts": pipe.cache_counts[-len(BATCH):],
            "decisions": [(d.context, d.local, d.shared) for d in pipe.cache.decisions]}


def _first_block_metric(residual, previous) -> float | None:
    """FirstBlockCache's own formula (test-side, to aim a threshold exactly at one step's value)."""
    if previous is None:
        return None
    return ((residual - previous).abs().mean() / previous.abs().mean()).item()


def _with_head_probe(probe):
    """Run `probe(residual, previous)` ahead of FirstBlockCache's stock decision in every hook installed inside."""
    stock = FBCHeadBlockHook._should_compute_remaining_blocks

    def probed(self, residual):
        probe(residual, self.state_manager.get_state().head_block_residual)
        return stock(self, residual)

    FBCHeadBlockHook._should_compute_remaining_blocks = probed
    return lambda: setattr(FBCHeadBlockHook, "_should_compute_remaining_blocks", stock)


def _perturbation(pipe, group) -> dict:
    """Aim the threshold exactly at step 1's metric, then nudge rank 1's first-block residual by 1e-6."""

    transformer = pipe.adapter.transformer_of(pipe.pipe)
    metrics = []
    restore = _with_head_probe(lambda residual, previous: metrics.append(_first_block_metric(residual, previous)))
    try:
        pipe.cache.remove()
        enable_group_cache(transformer, FirstBlockCacheConfig(threshold=0.0), group)  # computes every step
        _generation(pipe, "flux")
    finally:
        restore()
    threshold = [metrics[1]]
    dist.broadcast_object_list(threshold, group=group, group_src=0)
    nudged = dist.get_rank(group) == 1

    def nudge(residual, previous):  # every element 1e-6 further from the last residual: the metric rises a hair
        if nudged and previous is not None:
            residual.add_(1e-6 * torch.sign(residual - previous))

    restore = _with_head_probe(nudge)
    try:
        pipe.cache.remove()
        enable_group_cache(transformer, FirstBlockCacheConfig(threshold=threshold[0]), group)
        run = _generation(pipe, "flux")  # the group's latents are compared at the first and last step
    finally:
        restore()
        pipe.cache.remove()
    return {"metrics": metrics, "threshold": threshold[0], **run}


def _compiled(pipe, group) -> dict:
    """FLUX.1 with the first-block cache: blocks compiled (aot_eager), warmed up, then generating with the cache."""

    enable_group_cache(pipe.adapter.transformer_of(pipe.pipe), FirstBlockCacheConfig(threshold=THRESHOLD), group)
    eager = _generation(pipe, "flux")
    torch._dynamo.reset()
    start = compile_report()
    compile_repeated_blocks(pipe, backend="aot_eager")
    call = call_of("flux")
    guard = warmup(pipe, [(call["height"], call["width"])], on_recompile="raise",
                   max_sequence_length=call["max_sequence_length"])
    warm = compile_report()
    compiled = [_generation(pipe, "flux") for _ in range(2)]
    guard.remove()
    after = compile_report()
    return {"eager": eager, "compiled": compiled, "graphs_after_warmup": warm["graphs"] - start["graphs"],
            "new_graphs": after["graphs"] - warm["graphs"], "new_recompiles": after["recompiles"] - warm["recompiles"],
            "graph_breaks": after["graph_breaks"] - start["graph_breaks"]}


def _case_check(checkpoint, family: str, name, mesh_kwargs: dict, extras: bool, batched: bool = False,
                **kwargs) -> dict:
    """One cached generation (`generation`: output, counts and decisions) on `init_distributed(**mesh_kwargs)`; with
    `batched`, `BATCH` in one call (`batched`); with `extras` (FLUX.1's first-block case at TP=2) also the
    perturbation and the compiled run on the same pipeline."""
    report = {}
    with one_thread():
        mesh = nd.init_distributed(**mesh_kwargs)
        pipe = record(report, "generation", nd.load_pipeline, checkpoint, mesh, cache=config_of(name))
        if isinstance(pipe, CaseError):
            return dict.fromkeys(("generation", "batched", "perturbation", "compiled"), pipe)
        record(report, "generation", _generation, pipe, family, **kwargs)
        if batched:
            record(report, "batched", _batched, pipe, family)
        if extras:
            group = mesh["tp"].get_group()
            record(report, "perturbation", _perturbation, pipe, group)
            record(report, "compiled", _compiled, pipe, group)
            torch._dynamo.reset()
        del pipe
        gc.collect()
    return report


def tp2_case_check(checkpoint, family: str, name) -> dict:
    """At TP=2: the cached generation of (`family`, cache `name`); the `BATCHED` cases also a batch of three,
    FLUX.1's first-block case the perturbation and the compiled blocks."""
    extras = (family, name) == ("flux", "first-block")
    return _case_check(checkpoint, family, name, {"tp": 2}, extras, batched=(family, name) in BATCHED)


def cfg_pair_case_check(checkpoint, family: str, name) -> dict:
    """As one CFG pair (cfg=2, tp=1) with true CFG: the cached generation, each rank one guidance branch."""
    return _case_check(checkpoint, family, name, {"tp": 1, "cfg": 2}, False, **TRUE_CFG)


def job_check(job_argv: list[str]) -> dict:
    """The `generate` job with `--cache` on two ranks: rank 0's outputs, and each rank's final latents (what its
    group's last latent check compared, `cfg_jobs.final_latents`), to compare with stock before the 8-bit rounding."""
    from cfg_jobs import job_with_latents

    report = {}
    with one_thread():
        record(report, "job", job_with_latents, job_argv)
    return report
