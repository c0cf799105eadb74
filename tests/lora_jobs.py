"""LoRA checks that run on spawned gloo ranks (module level, so `spawn` can import them)."""

from __future__ import annotations

import gc

import numpy as np
import torch
import torch.distributed as dist

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


def _image(outputs_) -> np.ndarray | None:
    return None if outputs_ is None else np.asarray(outputs_[0], dtype=np.float32) / 255.0


def lora_checks(checkpoints: dict, files: dict, calls: dict, call_kwargs: dict, out: str) -> dict:
    """At TP=2: every family with a LoRA on every Linear; FLUX.1 switching, restore, bad input, a fuse failure on one
    rank, compiled switches, CFG parallelism and the `generate` job with `--lora`."""
    from rank_jobs import _job_outputs

    import neuron_diffusers as nd
    from neuron_diffusers.compile import compile_repeated_blocks, compile_report
    from neuron_diffusers.parallel.lora import LoraError, _local

    torch.set_num_threads(1)  # as torchrun does: ranks share the cores
    mesh = nd.init_distributed(tp=2)
    report = {"rank": dist.get_rank()}
    for family in OTHER_FAMILIES:
        pipe = nd.load_pipeline(checkpoints[family], mesh, loras=[(files[family], files["scale"])])
        report[family] = outputs(pipe.adapter.transformer_of(pipe.pipe), calls[family])
        del pipe
        gc.collect()

    a, b, kohya = (files["a"], files["scale_a"]), (files["b"], 1.0), (files["kohya"], 1.0)
    call = calls["flux"]
    pipe = nd.load_pipeline(checkpoints["flux"], mesh, loras=[a])
    transformer = pipe.pipe.transformer
    report["a"] = outputs(transformer, call)
    report["encoder_adapters_a"] = None if pipe.encoder is None else pipe.encoder.get_list_adapters()
    if pipe.encoder is not None:  # the leader's text embeddings, LoRA's CLIP part active, as `generate` encodes
        with torch.no_grad():
            report["embeds_a"] = pipe.adapter.encode(pipe.encoder, PROMPT, None)

    # While B is fused (sharded Linears only), no op allocates more than one local shard in fp32.
    switch = pipe.set_loras
    report["largest_op_allocation"], report["largest_other_allocation"] = _largest_allocations(lambda: switch([b]))
    targets = [transformer.get_submodule(n) for lora in pipe.loras._loaded for n in lora.factors]
    report["largest_local_fp32"] = max(_local(m.weight).numel() * 4 for m in targets)
    report["full_fp32"] = sorted({m.weight.numel() * 4 for m in targets})
    report["b"] = outputs(transformer, call)
    pipe.set_loras([a, b])
    report["a+b"] = outputs(transformer, call)
    pipe.set_loras([kohya])
    report["kohya"] = outputs(transformer, call)
    pipe.set_loras([])
    report["none"] = outputs(transformer, call)
    report["encoder_adapters_none"] = None if pipe.encoder is None else pipe.encoder.get_list_adapters()
    none_weights = local_weights(transformer)

    # A bad request (one good LoRA, one naming a module FLUX.1 lacks) keeps the active set, the same error everywhere.
    pipe.set_loras([a])
    before = local_weights(transformer)
    try:
        pipe.set_loras([b, files["bad_key"]])
        report["bad_error"] = "accepted"
    except LoraError as error:
        report["bad_error"] = str(error)
    report["bad_unchanged"] = _same(before, local_weights(transformer))
    report["bad_active"] = [spec.source for spec in pipe.loras.active]

    # A failure while fusing on rank 1 only (say, out of memory): every rank raises it and goes back to A.
    calls_made, real = iter(range(10**6)), pipe.loras._local_factors

    def failing_local_factors(*args):
        if dist.get_rank() == 1 and next(calls_made) == 5:
            raise RuntimeError("simulated out of memory")
        return real(*args)

    pipe.loras._local_factors = failing_local_factors
    try:
        pipe.set_loras([b])
        report["fuse_error"] = "accepted"
    except LoraError as error:
        report["fuse_error"] = str(error)
    del pipe.loras._local_factors
    report["fuse_failure_restored"] = _same(before, local_weights(transformer))

    # Fresh loads: the base (what `set_loras([])` must restore) and B alone (what switching A -> B must equal).
    fresh = nd.load_pipeline(checkpoints["flux"], mesh)
    report["fresh_none_bitwise"] = _same(local_weights(fresh.pipe.transformer), none_weights)
    report["fresh_none"] = outputs(fresh.pipe.transformer, call)
    fresh.set_loras([b])
    report["fresh_b"] = outputs(fresh.pipe.transformer, call)
    del fresh
    gc.collect()

    # Compiled: switching sets reuses the graphs.
    torch._dynamo.reset()
    compile_repeated_blocks(pipe, backend="aot_eager")
    pipe.set_loras([])
    compiled = {"none": outputs(transformer, call)}
    warm = compile_report()
    for name, loras in (("a", [a]), ("b", [b]), ("none2", []), ("a2", [a])):
        pipe.set_loras(loras)
        compiled[name] = outputs(transformer, call)
    after = compile_report()
    report["compiled"] = compiled
    report["compile"] = {"graphs_warm": warm["graphs"], "new_graphs": after["graphs"] - warm["graphs"],
                         "new_recompiles": after["recompiles"] - warm["recompiles"]}
    del pipe, transformer
    torch._dynamo.reset()
    gc.collect()

    # CFG parallelism (cfg=2 x tp=1 on the same ranks): each group fuses its own copy, each leader its text part.
    cfg_pipe = nd.load_pipeline(checkpoints["flux"], nd.init_distributed(tp=1, cfg=2), loras=[a])
    report["image_cfg_a"] = _image(cfg_pipe.generate(PROMPT, seed=0, negative_prompt=NEGATIVE, true_cfg_scale=2.0,
                                                     **call_kwargs))
    del cfg_pipe
    gc.collect()

    # The job: `generate --lora PATH:SCALE` at TP=2, its image and what it records.
    size = [f"--{k}={v}" for k, v in (("height", call_kwargs["height"]), ("width", call_kwargs["width"]),
                                       ("steps", call_kwargs["num_inference_steps"]))]
    report["job"] = _job_outputs(["--model", checkpoints["flux"], "--prompt", PROMPT, "--out", out, "--tp", "2",
                                  "--lora", f"{a[0]}:{a[1]}", *size])
    return report
