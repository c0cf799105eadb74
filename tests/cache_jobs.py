"""Functions that run on spawned gloo ranks for tests/test_cache.py (module level, so `spawn` imports them)."""

from __future__ import annotations

import gc

import numpy as np
import torch
import torch.distributed as dist
from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks.first_block_cache import FBCHeadBlockHook
from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS
from rank_jobs import _job_outputs

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


def taylorseer():
    return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, taylor_factors_dtype=torch.float32)


def mag_cache():
    """MagCache with diffusers' FLUX.1-dev ratios (interpolated to the steps): a fixed schedule that skips."""
    return MagCacheConfig(mag_ratios=FLUX_MAG_RATIOS, num_inference_steps=STEPS, threshold=0.2)


def config_of(name: str):
    if name == "taylorseer":
        return taylorseer()
    if name == "mag":
        return mag_cache()
    return FirstBlockCacheConfig(threshold=THRESHOLD if name == "first-block" else name)


def call_of(family: str) -> dict:
    call = {**tiny.smallest_call(family), "num_inference_steps": STEPS}
    if family == "flux":
        call["max_sequence_length"] = 32  # 32 tokens instead of 512 keep the tiny FLUX.1 quick
    if family != "h3":
        call["output_type"] = "np"
    return call


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


def cache_checks(checkpoints: dict, job_argv: list[str]) -> dict:
    """Two ranks: at TP=2, then as one CFG pair (cfg=2, tp=1) with true CFG: cached generations and their decisions,
    the perturbation, compile, and the `generate` job with `--cache`."""
    torch.set_num_threads(1)
    report = {}
    mesh = nd.init_distributed(tp=2)
    group = mesh["tp"].get_group()
    for family, name in (("flux", "first-block"), ("qwenimage", "first-block"), ("flux", "taylorseer"),
                         *((family, setting) for family, setting in ALONE_CASES.items())):
        pipe = nd.load_pipeline(checkpoints[family], mesh, cache=config_of(name))
        report[f"tp2 {family} {name}"] = _generation(pipe, family)
        if (family, name) == ("flux", "first-block"):
            report["perturbation"] = _perturbation(pipe, group)
            report["compiled"] = _compiled(pipe, group)
        del pipe
        gc.collect()

    pair = nd.init_distributed(tp=1, cfg=2)
    for family, name in (("flux", "first-block"), ("qwenimage", "first-block"), ("flux", "taylorseer")):
        pipe = nd.load_pipeline(checkpoints[family], pair, cache=config_of(name))
        report[f"cfg2 {family} {name}"] = _generation(pipe, family, **TRUE_CFG)
        del pipe
        gc.collect()
    report["job"] = _job_outputs(job_argv)
    return report
