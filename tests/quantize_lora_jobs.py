"""Rank jobs for tests/test_quantize_lora.py (module level, so the rank pool can import them): LoRAs fused into
quantized shards, compiled quantized pipelines, and the job's and the server's quantized images; one case a key
(`rank_cases.record`), so a case that raises fails only the tests that read it."""

from __future__ import annotations

import gc

import torch
from compile_jobs import _compile_family
from lora_jobs import outputs
from rank_cases import CaseError, one_thread, record

#: 16 divides every row shard of tiny FLUX.1 at TP=2 (its inner width is 64): the default 128 would be refused.
BLOCK = 16
KINDS = ("fp8", "int8")


def scheme(kind: str) -> str:
    return f"{kind}:{BLOCK}"


def quantized_tensors(transformer) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every quantized Linear's local stored weight and scales, cloned."""
    from neuron_diffusers.parallel.quantize import is_quantized, quantized_local

    return {name: tuple(t.clone() for t in quantized_local(module))
            for name, module in transformer.named_modules() if is_quantized(module)}


def _count_equal(before: dict, after: dict) -> int:
    return sum(torch.equal(x, y) for name in before for x, y in zip(before[name], after[name], strict=True))


def one_process_fused(checkpoint, kind: str, loras: list):
    """The whole transformer on one process, quantized, with `loras` fused (the reference each rank is held to)."""
    from neuron_diffusers.checkpoint import resolve
    from neuron_diffusers.parallel.lora import FusedLoras, lora_loader
    from neuron_diffusers.parallel.quantize import quantize_model

    model = resolve(checkpoint).transformer_class().from_pretrained(checkpoint, subfolder="transformer").eval()
    quantize_model(model, scheme(kind))
    FusedLoras(model, lora_loader(resolve(checkpoint).adapter)).set(loras)
    return model


def _dequantized(module, data, scale) -> torch.Tensor:
    from neuron_diffusers.parallel.quantize import FP8, dequantize_weight

    return dequantize_weight(data.view(FP8) if module.scheme.kind == "fp8" else data, scale, module.scheme.block)


def _shards_against_one_process(pipe, checkpoint, kind: str, loras: list) -> dict:
    """Each fused quantized shard against this rank's slice of the one-process fused weight (dequantized), bitwise."""
    from neuron_diffusers.compat import tp_loading
    from neuron_diffusers.parallel.quantize import is_quantized, quantized_local

    whole = one_process_fused(checkpoint, kind, loras)
    transformer, unequal, compared = _transformer(pipe), [], 0
    for name in sorted({n for lora in pipe.loras._loaded for n in lora.factors}):
        module = transformer.get_submodule(name)
        if not is_quantized(module):  # a LoRA on a Linear outside the blocks: tested in test_lora.py
            continue
        full = _dequantized(module, *quantized_local(whole.get_submodule(name)))
        dim, blocks, mesh = pipe.loras._layout(name)
        expected = full if dim is None else tp_loading.local_shard(full, dim, blocks or [full.shape[dim]], mesh)
        compared += 1
        if not torch.equal(_dequantized(module, *quantized_local(module)), expected):
            unequal.append(name)
    return {"compared": compared, "unequal": sorted(unequal)}


def _memory(pipe) -> dict:
    """Bytes of the CPU copies that restore the quantized base, and of the touched quantized shards (stored data,
    scales) with their weight count."""
    from neuron_diffusers.parallel.lora import QuantizedCopy
    from neuron_diffusers.parallel.quantize import quantized_local

    copies = {n: c for n, c in pipe.loras.base_copies.items() if isinstance(c, QuantizedCopy)}
    touched = [quantized_local(_transformer(pipe).get_submodule(name)) for name in copies]
    return {"copies": sum(saved.nbytes for saved in copies.values()),
            "touched_data": sum(data.nbytes for data, _ in touched),
            "touched_scales": sum(scale.nbytes for _, scale in touched),
            "touched_weights": sum(data.numel() for data, _ in touched)}


def _restore(pipe, base: dict) -> dict:
    """The LoRA fused (how many quantized tensors it changed), then removed: how many equal the base bit for bit."""
    fused = quantized_tensors(_transformer(pipe))
    pipe.set_loras([])
    restored = quantized_tensors(_transformer(pipe))
    return {"tensors": 2 * len(base), "equal_while_fused": _count_equal(base, fused),
            "equal_after_removal": _count_equal(base, restored)}


LORA_CASES = ("outputs", "shards", "memory", "restored")


def _transformer(pipe):
    return pipe.adapter.transformer_of(pipe.pipe)


def lora_job(families: dict, scale: float) -> dict:
    """At TP=2, per family of `families` (`{family: (checkpoint, LoRA file, call, kinds)}`) and kind: the quantized
    pipeline (`load_pipeline(quantize=...)`), its base tensors kept, the LoRA fused at `scale`: outputs, shards
    against one process, memory; removed: the base restored. Cases `(family, kind, name)`."""
    import neuron_diffusers as nd

    report = {}
    with one_thread():
        mesh = nd.init_distributed(tp=2)
        for family, (checkpoint, file, call, kinds) in families.items():
            for kind in kinds:
                _lora_cases(report, (family, kind), mesh, checkpoint, (file, scale), call)
                gc.collect()
    return report


def _lora_cases(report: dict, key: tuple, mesh, checkpoint, lora: tuple, call) -> None:
    import neuron_diffusers as nd

    kind = key[1]
    pipe = record(report, (*key, "outputs"), nd.load_pipeline, checkpoint, mesh, quantize=scheme(kind))
    if isinstance(pipe, CaseError):
        report.update({(*key, name): pipe for name in LORA_CASES})
        return
    base = quantized_tensors(_transformer(pipe))
    pipe.set_loras([lora])
    record(report, (*key, "outputs"), outputs, _transformer(pipe), call)
    record(report, (*key, "shards"), _shards_against_one_process, pipe, checkpoint, kind, [lora])
    record(report, (*key, "memory"), _memory, pipe)
    record(report, (*key, "restored"), _restore, pipe, base)


def compile_job(checkpoint, call: dict, kinds, prompts: list, backend: str, loras=None, others=None) -> dict:
    """At TP=2 on FLUX.1, per kind: the quantized pipeline compiled (`compile_jobs._compile_family`: warm-up with
    recompiles raising, then `prompts`: graphs, breaks, recompiles, the output against eager); with `loras`
    (`{name: [(file, scale)]}`), `_compiled_switches` instead. `others` (`{family: (checkpoint, call, load kwargs,
    prompts)}`): each family in fp8 through `_compile_family`, its case the family."""
    import neuron_diffusers as nd

    report = {}
    with one_thread():
        mesh = nd.init_distributed(tp=2)
        for kind in kinds:
            if loras is None:
                record(report, kind, _compile_family, mesh, checkpoint, call, {"quantize": scheme(kind)}, prompts,
                       backend, False)
            else:
                record(report, kind, _compiled_switches, mesh, checkpoint, call, scheme(kind), prompts, backend,
                       loras)
            torch._dynamo.reset()
        for family, (family_checkpoint, family_call, load_kwargs, family_prompts) in (others or {}).items():
            record(report, family, _compile_family, mesh, family_checkpoint, family_call,
                   {"quantize": scheme("fp8"), **load_kwargs}, family_prompts, backend, family == "h3")
            torch._dynamo.reset()
    return report


def _latents(pipe, prompt: str, call: dict):
    latents = pipe.generate(prompt, seed=0, output_type="latent", **call)
    return None if latents is None else latents[0].float().clone()


def _compiled_switches(mesh, checkpoint, call: dict, quantize: str, prompts: list, backend: str,
                       loras: dict) -> dict:
    """Eager latents per LoRA set of `loras`; then compiled and warmed up (a recompile raises), `prompts` and every
    set again, switched in place on the compiled model: graphs, breaks, recompiles and each set's latents."""
    import neuron_diffusers as nd
    from neuron_diffusers.compile import compile_repeated_blocks, compile_report, warmup

    torch._dynamo.reset()
    start = compile_report()
    pipe = nd.load_pipeline(checkpoint, mesh, quantize=quantize)
    eager = {}
    for name, chosen in loras.items():
        pipe.set_loras(chosen)
        eager[name] = _latents(pipe, prompts[0], call)
    compile_repeated_blocks(pipe, backend=backend)
    guard = warmup(pipe, [(call["height"], call["width"])], on_recompile="raise",
                   **{k: v for k, v in call.items() if k not in ("height", "width")})
    try:
        warm = compile_report()
        for prompt in prompts:
            pipe.generate(prompt, seed=0, output_type="latent", **call)
        compiled = {}
        for name, chosen in [*loras.items(), *loras.items()]:  # each set twice: switched away and back
            pipe.set_loras(chosen)
            compiled.setdefault(name, []).append(_latents(pipe, prompts[0], call))
    finally:
        guard.remove()
    after = compile_report()
    return {"graphs_after_warmup": warm["graphs"] - start["graphs"], "new_graphs": after["graphs"] - warm["graphs"],
            "new_recompiles": after["recompiles"] - warm["recompiles"],
            "graph_breaks": after["graph_breaks"] - start["graph_breaks"], "eager": eager, "compiled": compiled}


def _served(serve_argv: list[str], bodies: dict) -> dict:
    """The server's own path minus HTTP: `plan_server` from the command line, each body checked by `plan_work`, the
    replica loading `load_pipeline(config.launch)` and making each task with `replica.make`: the leader's PNGs."""
    import neuron_diffusers as nd
    from neuron_diffusers.cli import _parser
    from neuron_diffusers.distributed import detect_runtime
    from neuron_diffusers.serve.command import plan_server
    from neuron_diffusers.serve.replica import make
    from neuron_diffusers.serve.request import ImageRequest, plan_work

    runtime = detect_runtime()
    config = plan_server(_parser().parse_args(["serve", *serve_argv]), runtime.world_size, runtime.device_type)
    pipe = nd.load_pipeline(config.launch, nd.init_distributed(tp=config.tp))
    leader = runtime.rank == 0
    made = {}
    for name, body in bodies.items():
        answer = make(pipe, plan_work(ImageRequest(**body), config).task(), leader)
        made[name] = None if answer is None else answer["images"][0]
    del pipe
    gc.collect()
    return made


def job_and_served(job_argv: list[str], serve_argv: list[str], bodies: dict) -> dict:
    """The `generate` job's outputs (as torchrun's ranks run it) and the server's PNGs for `bodies`."""
    from rank_jobs import _job_outputs

    report = {}
    with one_thread():
        record(report, "job", _job_outputs, job_argv)
        record(report, "served", _served, serve_argv, bodies)
    return report
