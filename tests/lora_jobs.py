"""LoRA checks that run on the session's gloo rank pool (module level, so the pool can import them), one case a key
(`rank_cases.record`): a case that raises fails only the tests that read it."""

from __future__ import annotations

import gc

import numpy as np
import torch
import torch.distributed as dist
from rank_cases import CaseError, one_thread, record

from neuron_diffusers.tools.plan.cases import predictions

PROMPT, NEGATIVE = "a red fox in the snow", "blurry, low quality"
OTHER_FAMILIES = ("flux2", "qwenimage", "qwenimage21", "h3")


def outputs(transformer, call) -> tuple[torch.Tensor, ...]:
    args, kwargs = call
    with torch.no_grad():
        return tuple(t.clone() for t in predictions(transformer(*args, **kwargs)))


def local_weights(transformer) -> dict[str, torch.Tensor]:
    from neuron_diffusers.parallel.lora import _local

    return {name: _local(p).detach().clone() for name, p in transformer.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _largest_allocations(fn) -> tuple[int, int]:
    """Bytes of the largest single CPU allocation made by a torch op while `fn` ran, and by anything else (the
    profiler's `[memory]` events: buffers torch did not allocate for an op, here safetensors reading the file)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    ops = [e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]"]
    other = [e.self_cpu_memory_usage for e in prof.events() if e.name == "[memory]"]
    return max(ops, default=0), max(other, default=0)


def _failed_load(error: CaseError, names) -> dict:
    """Every case of a job whose pipeline did not load reports the failed load."""
    return dict.fromkeys(names, error)


def lora_family_check(checkpoint, file: str, scale: float, call) -> dict:
    """At TP=2: one family with a LoRA on every Linear, the transformer's outputs on its first real call."""
    import neuron_diffusers as nd

    report = {}
    with one_thread():
        pipe = record(report, "outputs", nd.load_pipeline, checkpoint, nd.init_distributed(tp=2),
                      loras=[(file, scale)])
        if not isinstance(pipe, CaseError):
            record(report, "outputs", outputs, pipe.adapter.transformer_of(pipe.pipe), call)
        del pipe
        gc.collect()
    return report


def _encoder_case(pipe) -> dict:
    """The leader's text embeddings with the LoRA's CLIP part active, as `generate` encodes; the adapters there."""
    if pipe.encoder is None:
        return {"adapters": None, "embeds": None}
    with torch.no_grad():
        return {"adapters": _encoder_adapters(pipe), "embeds": pipe.adapter.encode(pipe.encoder, PROMPT, None)}


def _encoder_adapters(pipe) -> dict | None:
    return None if pipe.encoder is None else pipe.encoder.get_list_adapters()


def _fuse_memory(pipe, b) -> dict:
    """While B is fused (sharded Linears only), the largest allocation of any op, and the shards' and full sizes."""
    from neuron_diffusers.parallel.lora import _local

    op, other = _largest_allocations(lambda: pipe.set_loras([b]))
    transformer = pipe.pipe.transformer
    targets = [transformer.get_submodule(n) for lora in pipe.loras._loaded for n in lora.factors]
    return {"largest_op_allocation": op, "largest_other_allocation": other,
            "largest_local_fp32": max(_local(m.weight).numel() * 4 for m in targets),
            "full_fp32": sorted({m.weight.numel() * 4 for m in targets})}


def _switch(pipe, loras, call):
    pipe.set_loras(loras)
    return outputs(pipe.pipe.transformer, call)


def _bad_request(pipe, a, b, bad_key) -> dict:
    """A bad request (one good LoRA, one naming a module FLUX.1 lacks) keeps the active set, the same error
    everywhere."""
    from neuron_diffusers.parallel.lora import LoraError

    pipe.set_loras([a])
    before = local_weights(pipe.pipe.transformer)
    try:
        pipe.set_loras([b, bad_key])
        error = "accepted"
    except LoraError as caught:
        error = str(caught)
    return {"error": error, "unchanged": _same(before, local_weights(pipe.pipe.transformer)),
            "active": [spec.source for spec in pipe.loras.active]}


def _fuse_failure(pipe, a, b) -> dict:
    """A failure while fusing on rank 1 only (say, out of memory): every rank raises it and goes back to A."""
    from neuron_diffusers.parallel.lora import LoraError

    pipe.set_loras([a])
    before = local_weights(pipe.pipe.transformer)
    calls_made, real = iter(range(10**6)), pipe.loras._local_factors

    def failing_local_factors(*args):
        if dist.get_rank() == 1 and next(calls_made) == 5:
            raise RuntimeError("simulated out of memory")
        return real(*args)

    pipe.loras._local_factors = failing_local_factors
    try:
        pipe.set_loras([b])
        error = "accepted"
    except LoraError as caught:
        error = str(caught)
    finally:
        del pipe.loras._local_factors
    return {"error": error, "restored": _same(before, local_weights(pipe.pipe.transformer))}


def _fresh(checkpoint, mesh, b, call, none_weights) -> dict:
    """Fresh loads: the base (what `set_loras([])` must restore) and B alone (what switching A -> B must equal)."""
    import neuron_diffusers as nd

    fresh = nd.load_pipeline(checkpoint, mesh)
    report = {"none_bitwise": _same(local_weights(fresh.pipe.transformer), none_weights),
              "none": outputs(fresh.pipe.transformer, call)}
    fresh.set_loras([b])
    report["b"] = outputs(fresh.pipe.transformer, call)
    del fresh
    gc.collect()
    return report


def _compiled(pipe, a, b, call) -> dict:
    """Compiled (`aot_eager`): switching sets reuses the graphs."""
    from neuron_diffusers.compile import compile_repeated_blocks, compile_report

    torch._dynamo.reset()
    compile_repeated_blocks(pipe, backend="aot_eager")
    transformer = pipe.pipe.transformer
    pipe.set_loras([])
    compiled = {"none": outputs(transformer, call)}
    warm = compile_report()
    for name, loras in (("a", [a]), ("b", [b]), ("none2", []), ("a2", [a])):
        pipe.set_loras(loras)
        compiled[name] = outputs(transformer, call)
    after = compile_report()
    torch._dynamo.reset()
    return {"outputs": compiled, "graphs_warm": warm["graphs"], "new_graphs": after["graphs"] - warm["graphs"],
            "new_recompiles": after["recompiles"] - warm["recompiles"]}


FLUX_CASES = ("a", "encoder", "fuse_memory", "b", "a+b", "kohya", "none", "encoder_none", "bad", "fuse_failure",
              "fresh", "compiled")


def lora_flux_checks(checkpoint, files: dict, call) -> dict:
    """At TP=2 on FLUX.1, one case a key: LoRA A's outputs and text part, fusing B's memory, switching (B, A+B,
    kohya, none), a bad request, a fuse failure on one rank, fresh loads, compiled switches."""
    import neuron_diffusers as nd

    a, b, kohya = (files["a"], files["scale_a"]), (files["b"], 1.0), (files["kohya"], 1.0)
    report = {}
    with one_thread():
        mesh = nd.init_distributed(tp=2)
        pipe = record(report, "a", nd.load_pipeline, checkpoint, mesh, loras=[a])
        if isinstance(pipe, CaseError):
            return _failed_load(pipe, FLUX_CASES)
        record(report, "a", outputs, pipe.pipe.transformer, call)
        record(report, "encoder", _encoder_case, pipe)
        record(report, "fuse_memory", _fuse_memory, pipe, b)
        record(report, "b", outputs, pipe.pipe.transformer, call)
        record(report, "a+b", _switch, pipe, [a, b], call)
        record(report, "kohya", _switch, pipe, [kohya], call)
        record(report, "none", _switch, pipe, [], call)
        record(report, "encoder_none", _encoder_adapters, pipe)
        none_weights = local_weights(pipe.pipe.transformer)
        record(report, "bad", _bad_request, pipe, a, b, files["bad_key"])
        record(report, "fuse_failure", _fuse_failure, pipe, a, b)
        record(report, "fresh", _fresh, checkpoint, mesh, b, call, none_weights)
        record(report, "compiled", _compiled, pipe, a, b, call)
        del pipe
        gc.collect()
    return report


def _cfg_image(checkpoint, a, call_kwargs: dict):
    """CFG parallelism (cfg=2 x tp=1): each group fuses its own copy, each leader its text part; the float image."""
    import neuron_diffusers as nd

    pipe = nd.load_pipeline(checkpoint, nd.init_distributed(tp=1, cfg=2), loras=[a])
    images = pipe.generate(PROMPT, seed=0, negative_prompt=NEGATIVE, true_cfg_scale=2.0, output_type="np",
                           **call_kwargs)
    del pipe
    gc.collect()
    return None if images is None else np.asarray(images[0], dtype=np.float32)


def lora_image_checks(checkpoint, files: dict, call_kwargs: dict, job_argv: list[str], latents_argv: list[str]
                      ) -> dict:
    """CFG parallelism's float image with LoRA A; the `generate` job with `--lora` (its PNG and records), and the
    job's configuration planned from the same arguments, made through `load_pipeline` as latents."""
    from rank_jobs import _job_outputs
    from runner_jobs import job_latents

    report = {}
    with one_thread():
        record(report, "cfg_image", _cfg_image, checkpoint, (files["a"], files["scale_a"]), call_kwargs)
        record(report, "job", _job_outputs, job_argv)
        record(report, "job_latents", job_latents, latents_argv)
    return report
