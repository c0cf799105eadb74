"""Context parallelism (tests/test_context_parallel.py): the transformer calls compared, and the rank jobs.

The calls are built in the test process (stock, one process), each with a control: the single-process prediction of
the same call with another text input (another prompt's embeddings). The jobs run on the session's rank pool and
return, per call, the max abs difference of their output to the prediction and to the control (which must exceed
the tolerance the first is held to), or the error a configuration raised (so the tests can check the words). The
runner's jobs record each check as a case of its own (`rank_cases.record`).
"""

from __future__ import annotations

import copy

import torch
from cfg_jobs import final_latents
from rank_cases import CaseError, one_thread, record
from runner_jobs import _past_the_entry_check

from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.tools.plan.cases import predictions, reference_call

#: Per family: the text-length axis of every text-indexed input of the transformer's call (name -> dim).
TEXT_INPUTS = {
    "flux": {"encoder_hidden_states": 1, "txt_ids": 0},
    "flux2": {"encoder_hidden_states": 1, "txt_ids": 1},
    "qwenimage": {"encoder_hidden_states": 1, "encoder_hidden_states_mask": 1},
}
ODD_TEXT = 7


def _transformer(checkpoint):
    return resolve(checkpoint).transformer_class().from_pretrained(checkpoint, subfolder="transformer")


def another_text(kwargs: dict) -> dict:
    """The call with another prompt's text: `encoder_hidden_states` replaced by seeded noise of the same scale."""
    text = kwargs["encoder_hidden_states"]
    noise = torch.randn(text.shape, generator=torch.Generator().manual_seed(1), dtype=text.dtype)
    return {**kwargs, "encoder_hidden_states": noise * text.std()}


def _with_predictions(model, args, kwargs, control_kwargs=None):
    """(args, kwargs, predictions, control predictions): the control is the call with another text input."""
    with torch.no_grad():
        expected = predictions(model(*args, **kwargs))
        control = predictions(model(*args, **(another_text(kwargs) if control_kwargs is None else control_kwargs)))
    return args, kwargs, expected, control


def family_calls(checkpoint, family: str) -> dict:
    """Named transformer calls of `family` with their single-process predictions: the stock pipeline's first call
    ("pipeline"), its text cut to 7 tokens ("text7"), Qwen-Image's text padded with masked positions to a multiple of
    4 ("padded4"), and Qwen-Image-2.1's prefill, cached and uncached steps at an even and an odd joint length."""
    if family == "qwenimage21":
        return _qwenimage21_calls(checkpoint)
    model = _transformer(checkpoint)
    args, kwargs, _ = reference_call(checkpoint, family)
    calls = {"pipeline": _with_predictions(model, args, kwargs)}
    if family in TEXT_INPUTS:
        short = dict(kwargs)
        for name, dim in TEXT_INPUTS[family].items():
            if short.get(name) is not None:
                short[name] = short[name].narrow(dim, 0, ODD_TEXT).clone()
        calls[f"text{ODD_TEXT}"] = _with_predictions(model, args, short)
    if family == "qwenimage":
        calls["padded4"] = _with_predictions(model, args, _padded_text(kwargs, 4))
    return calls


def _padded_text(kwargs: dict, multiple: int) -> dict:
    """Qwen-Image's call with its text right-padded to a multiple of `multiple` by masked positions (as the buckets
    of `load_pipeline` pad it)."""
    kwargs = dict(kwargs)
    text = kwargs["encoder_hidden_states"]
    extra = -text.shape[1] % multiple or multiple
    mask = kwargs.get("encoder_hidden_states_mask")
    mask = torch.ones(text.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    kwargs["encoder_hidden_states"] = torch.cat([text, text.new_zeros(text.shape[0], extra, text.shape[2])], dim=1)
    kwargs["encoder_hidden_states_mask"] = torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1)
    return kwargs


def _qwenimage21_calls(checkpoint) -> dict:
    """Prefill with the KV cache extracted, the cached step after it, the prefill without a cache; then the same
    three with one text token less (an odd joint length)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    model = _transformer(checkpoint)
    args, kwargs, _ = reference_call(checkpoint, "qwenimage21")
    shorter = dict(kwargs)
    assert not kwargs["img_mask"][0, 0], "the first slot is text"
    shorter["encoder_hidden_states"] = kwargs["encoder_hidden_states"][:, 1:].clone()
    shorter["img_mask"] = kwargs["img_mask"][:, 1:].clone()
    calls = {}
    for label, base in (("", kwargs), ("_odd", shorter)):
        caches = [QwenImage21KVCache(len(model.transformer_blocks)) for _ in range(2)]  # the call's, the control's
        control_base = another_text(base)
        steps = {f"extract{label}": {"kv_cache_mode": "extract"}, f"cached{label}": {"kv_cache_mode": "cached"},
                 f"nocache{label}": {"kv_cache": None, "kv_cache_mode": None}}
        for name, step in steps.items():  # in this order: the cached step reads what the extract step stored
            main = {**base, "kv_cache": caches[0], **step}
            control = {**control_base, "kv_cache": caches[1], **step}
            calls[name] = _with_predictions(model, args, main, control)
        caches[0].layer_caches = QwenImage21KVCache(len(model.transformer_blocks)).layer_caches  # ranks start empty
    return calls


# --- on the ranks --------------------------------------------------------------------------------------------------


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:400]}"


def _diffs(model, call) -> tuple[float, float]:
    """The max abs difference of `model`'s output for `call` to the single-process prediction, and to the control's
    (the prediction for another text input)."""
    args, kwargs, expected, control = call
    with torch.no_grad():
        outputs = predictions(model(*args, **kwargs))
    assert len(outputs) == len(expected) > 0

    def largest(references):
        return max((out - ref).abs().max().item() for out, ref in zip(outputs, references, strict=True))

    return largest(expected), largest(control)


def _config(cp_kwargs: dict, tp: int = 2, mesh=None):
    from diffusers import ContextParallelConfig, ParallelConfig, TensorParallelConfig

    return ParallelConfig(
        context_parallel_config=ContextParallelConfig(**cp_kwargs, mesh=mesh),
        tensor_parallel_config=TensorParallelConfig(tp_degree=tp) if mesh is None else TensorParallelConfig(
            mesh=mesh["tp"]))


def _load(checkpoint, config, path: str):
    """`from_pretrained(parallel_config=...)`, or a plain load then `enable_parallelism(config=...)`."""
    cls = resolve(checkpoint).transformer_class()
    if path == "from_pretrained":
        return cls.from_pretrained(checkpoint, subfolder="transformer", parallel_config=config)
    model = cls.from_pretrained(checkpoint, subfolder="transformer")
    model.enable_parallelism(config=config)
    return model


def api_matrix(checkpoints: dict, calls: dict, cases: dict) -> dict:
    """Every (family, path, config, call) of `cases` (family -> [(path, label, ContextParallelConfig kwargs, call
    names)]): the max abs differences to one process and to the control (`_diffs`), or the error it raised."""
    with one_thread():
        return _api_matrix(checkpoints, calls, cases)


def _api_matrix(checkpoints: dict, calls: dict, cases: dict) -> dict:
    report = {}
    for family, family_cases in cases.items():
        for path, label, cp_kwargs, names in family_cases:
            try:
                model = _load(checkpoints[family], _config(cp_kwargs), path)
            except Exception as error:  # reported, compared by the tests
                report[family, path, label, "load"] = _error(error)
                continue
            report[family, path, label, "tp_halves"] = _tp_halves(model)
            family_calls = copy.deepcopy(calls[family])  # each config fills its own KV caches
            for name in names:
                try:
                    report[family, path, label, name] = _diffs(model, family_calls[name])
                except Exception as error:
                    report[family, path, label, name] = _error(error)
    return report


def _tp_halves(model) -> bool:
    """Whether every attention query projection holds half its rows on this rank (tp=2), as a DTensor shard."""
    from torch.distributed.tensor import DTensor

    weights = [m.to_q.weight for m in model.modules() if hasattr(m, "to_q")]
    return bool(weights) and all(isinstance(w, DTensor) and w.to_local().shape[0] * 2 == w.shape[0] for w in weights)


def _groups(mesh) -> dict:
    """Global ranks of this rank's group along each dimension of `mesh`."""
    return {name: mesh[name].mesh.flatten().tolist() for name in mesh.mesh_dim_names}


def _user_mesh(flux, calls: dict, order) -> dict:
    """One mesh from the user, in `order`: who is contiguous, and the output against one process and the control."""
    import neuron_diffusers as nd

    mesh = nd.init_distributed(tp=2, ulysses=2, order=order)
    model = _load(flux, _config({"ulysses_degree": 2}, mesh=mesh), "from_pretrained")
    return {"groups": _groups(mesh), "diffs": _diffs(model, calls["flux"]["pipeline"])}


def _cp_only(flux, calls: dict) -> tuple[float, float]:
    """Context parallelism alone through `from_pretrained` (stock cannot take a bare ContextParallelConfig there)."""
    from diffusers import ContextParallelConfig

    model = resolve(flux).transformer_class().from_pretrained(
        flux, subfolder="transformer", parallel_config=ContextParallelConfig(ulysses_degree=2))
    return _diffs(model, calls["flux"]["pipeline"])


def _stock_order(qwen, calls: dict) -> float:
    """Stock order (CP hooks, then TP): the hooks keep the block forward that TP's coalescing replaces afterwards."""
    model = resolve(qwen).transformer_class().from_pretrained(qwen, subfolder="transformer")
    type(model).enable_parallelism.__wrapped__(model, config=_config({"ulysses_degree": 2}))
    return _diffs(model, calls["qwenimage"]["padded4"])[0]


def _rollback(flux, calls: dict) -> dict | str:
    """All or nothing: a failure while the CP hooks go on leaves the model exactly as it was (and its output)."""
    import diffusers.hooks

    model = _transformer(flux)
    before = {name: id(p) for name, p in model.named_parameters()}
    stock_apply = diffusers.hooks.apply_context_parallel

    def failing_apply(module, config, plan):
        stock_apply(module, config, plan)  # the hooks are on: the failure hits a fully sharded, hooked model
        raise RuntimeError("injected failure after the CP hooks")

    diffusers.hooks.apply_context_parallel = failing_apply
    try:
        model.enable_parallelism(config=_config({"ulysses_degree": 2}))
        return "no failure raised"
    except RuntimeError as error:
        rollback = {
            "error": str(error),
            "params_restored": {name: id(p) for name, p in model.named_parameters()} == before,
            "config_cleared": model._parallel_config is None,
            "hooks_left": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
            "registries_left": sum(hasattr(m, "_diffusers_hook") for m in model.modules()),
            "forward_overrides_left": sum("forward" in vars(m) for m in model.modules()),
            "processors_configured": sum(getattr(getattr(m, "processor", None), "_parallel_config", None) is not None
                                         for m in model.modules()),
        }
    finally:
        diffusers.hooks.apply_context_parallel = stock_apply
    args, kwargs, _, _ = calls["flux"]["pipeline"]
    with torch.no_grad():
        rollback["output_diff"] = (predictions(model(*args, **kwargs))[0]
                                   - predictions(_transformer(flux)(*args, **kwargs))[0]).abs().max().item()
    return rollback


def _rejections(checkpoints: dict) -> dict:
    """Bad requests are refused before a single weight is read, with the same words on every rank."""
    import safetensors
    from diffusers import ContextParallelConfig, ParallelConfig, TensorParallelConfig

    import neuron_diffusers as nd

    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before the request was checked")

    flux = checkpoints["flux"]
    root = nd.init_distributed(tp=2, ulysses=2)
    bad = {
        "world": (flux, _config({"ulysses_degree": 4})),
        "mesh_degree": (flux, _config({"ring_degree": 2}, mesh=root)),
        "cp_only_world": (flux, ContextParallelConfig(ulysses_degree=8)),
        "qwenimage21_ring": (checkpoints["qwenimage21"], _config({"ring_degree": 2})),
        "tp_mesh_only": (flux, ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=2),
                                              tensor_parallel_config=TensorParallelConfig(mesh=root["tp"]))),
    }
    rejections = {}
    stock_open = safetensors.safe_open
    safetensors.safe_open = no_reads
    try:
        for label, (checkpoint, config) in bad.items():
            try:
                resolve(checkpoint).transformer_class().from_pretrained(checkpoint, subfolder="transformer",
                                                                        parallel_config=config)
                rejections[label] = "accepted"
            except (ValueError, AssertionError) as error:
                rejections[label] = _error(error)
    finally:
        safetensors.safe_open = stock_open
    return rejections


def api_checks(checkpoints: dict, calls: dict) -> dict:
    """User meshes in both orders, CP alone, why CP goes on after TP, all-or-nothing, and checks before any weight
    is read: one case a key."""
    from neuron_diffusers.distributed import TP_INNER, ULYSSES_INNER

    report = {}
    with one_thread():
        for label, order in (("ulysses_inner", ULYSSES_INNER), ("tp_inner", TP_INNER)):
            record(report, ("user_mesh", label), _user_mesh, checkpoints["flux"], calls, order)
        record(report, "cp_only_from_pretrained", _cp_only, checkpoints["flux"], calls)
        record(report, "stock_order_qwen", _stock_order, checkpoints["qwenimage"], calls)
        record(report, "rollback", _rollback, checkpoints["flux"], calls)
        record(report, "rejections", _rejections, checkpoints)
    return report


# --- the runner and the job (load_pipeline / generate, `neuron-diffusers generate --ulysses`) ----------------------

PROMPT, NEGATIVE = "a red fox in the snow", "blurry, low quality"


def _job_outputs(argv: list[str]) -> dict:
    """The `generate` job in this process group (as torchrun runs it): rank 0's summary and written files' bytes
    (`outputs`, None elsewhere), and every rank's final latents per image (`cfg_jobs.final_latents`)."""
    from neuron_diffusers.cli import _parser
    from neuron_diffusers.distributed import detect_runtime
    from neuron_diffusers.job import plan_job, run_job

    args = _parser().parse_args(["generate", *argv])
    runtime = detect_runtime()
    with final_latents([]) as found:
        summary = run_job(plan_job(args, runtime.world_size, runtime.device_type), overwrite=False,
                          compile_backend=None, warm=False, timeout_s=300)
    outputs = None if summary is None else {"summary": summary,
                                            "files": {path.name: path.read_bytes() for path in args.out.iterdir()}}
    return {"outputs": outputs, "latents": found}


def _arrays(output):
    """Latents (a tensor) or a clip (`VideoWithAudio`: its float frames and audio) as numpy arrays."""
    if hasattr(output, "frames"):
        return {"frames": output.frames.numpy(), "audio": output.audio.numpy()}
    return {"latents": output.numpy()}


def _generate(pipe, family: str, call: dict) -> dict:
    """One `generate` (image families: `output_type="latent"`): the output, the final latents, how it ran, and the
    collectives of its forwards as `bench cp` counts them."""
    from neuron_diffusers.tools.bench.context import count_forward

    transformer = pipe.adapter.transformer_of(pipe.pipe)
    counter, _ = count_forward(transformer)
    with final_latents([]) as found:
        outputs = pipe.generate(PROMPT, seed=0, **(call if family == "h3" else {**call, "output_type": "latent"}))
    return {"output": None if outputs is None else _arrays(outputs[0]), "latents": found[-1],
            "buckets": pipe.buckets, "mode": tuple(pipe.cp_mode), "encoder": pipe.encoder is not None,
            "collectives": dict(counter.calls),
            "attentions": sum(hasattr(m, "processor") for m in transformer.modules())}


def _entry(pipe, call: dict) -> str:
    """A different seed per Ulysses pair (equal within each TP group): the entry handshake spans the image group, so
    it refuses the call before any work."""
    import torch.distributed as dist

    from neuron_diffusers.consistency import GroupOutOfStepError

    try:
        pipe.generate(PROMPT, seed=dist.get_rank() % 2, **call)
        return "not caught"
    except GroupOutOfStepError as error:
        return str(error)


def _divergence(pipe, call: dict) -> str:
    """The same past the entry check: the latent check over the whole image group catches it."""
    import torch.distributed as dist

    from neuron_diffusers.consistency import LatentsDivergedError

    try:
        with _past_the_entry_check():
            pipe.generate(PROMPT, seed=dist.get_rank() % 2, **call)
        return "not caught"
    except LatentsDivergedError as error:
        return str(error)


RUNNER_CASES = ("generate", "entry", "divergence", "job")


def runner_family(family: str, checkpoint, call: dict, job_argv: list[str] | None) -> dict:
    """On 4 ranks at tp=2 x ulysses=2, one family, one case a key: `generate`, for FLUX.1 per-rank seeds caught at
    entry and past it, and the job when `job_argv` is given."""
    import torch.distributed as dist

    import neuron_diffusers as nd
    from neuron_diffusers.distributed import image_group

    with one_thread():
        mesh = nd.init_distributed(tp=2, ulysses=2)
        report = {"mesh": (mesh.mesh_dim_names, tuple(mesh.shape)), "leader": nd.is_group_leader(mesh),
                  "group": dist.get_process_group_ranks(image_group(mesh))}
        pipe = record(report, "load", nd.load_pipeline, checkpoint, mesh)
        if isinstance(pipe, CaseError):  # every case reports the failed load
            return {**report, **dict.fromkeys(RUNNER_CASES, pipe)}
        del report["load"]
        record(report, "generate", _generate, pipe, family, call)
        if family == "flux":
            record(report, "entry", _entry, pipe, call)
            record(report, "divergence", _divergence, pipe, call)
        del pipe
        if job_argv is not None:
            record(report, "job", _job_outputs, job_argv)
    return report


def _cfg_generate(checkpoint, mesh, call: dict) -> dict:
    import neuron_diffusers as nd

    pipe = nd.load_pipeline(checkpoint, mesh)
    before = pipe.times.calls.get("transformer forward", 0)
    outputs = pipe.generate(PROMPT, seed=0, negative_prompt=NEGATIVE, true_cfg_scale=4.0, output_type="latent",
                            **call)
    return {"latents": None if outputs is None else outputs[0].numpy(),
            "forwards": pipe.times.calls.get("transformer forward", 0) - before}


def runner_cfg(checkpoint, call: dict) -> dict:
    """On 4 ranks: true CFG on Qwen-Image at cfg=2 x ulysses=2 (tp=1)."""
    import neuron_diffusers as nd

    with one_thread():
        mesh = nd.init_distributed(tp=1, ulysses=2, cfg=2)
        report = {"mesh": (mesh.mesh_dim_names, tuple(mesh.shape))}
        record(report, "cfg", _cfg_generate, checkpoint, mesh, call)
    return report


def cp_job(checkpoints: dict, calls: dict, api_cases: dict, runner: tuple, compiled: tuple) -> dict:
    """Every multi-rank check of tests/test_context_parallel.py as one job of the pool, its cases recorded one by
    one: the API matrix per family (`("matrix", family)`), the other API checks (`"checks"`), the runner per family
    (`("runner", family)`), true CFG (`"cfg"`), then compiled under tp=2 x ulysses=2 (last: dynamo's state is per
    process). One job, in this order, as one spawn ran them before: split into several jobs of the pool, the runner's
    first generation after the API jobs hung on a mismatched collective (twice on 2026-12-04, not yet understood)."""
    from compile_jobs import compile_checks

    calls_by_family, jobs, cfg_call = runner
    report = {}
    for family, family_cases in api_cases.items():
        record(report, ("matrix", family), api_matrix, {family: checkpoints[family]}, {family: calls[family]},
               {family: family_cases})
    report["checks"] = api_checks(checkpoints, calls)
    for family, checkpoint in checkpoints.items():
        report[("runner", family)] = runner_family(family, checkpoint, calls_by_family[family], jobs.get(family))
    report["cfg"] = runner_cfg(checkpoints["qwenimage"], cfg_call)
    record(report, "compiled", compile_checks, *compiled, {"tp": 2, "ulysses": 2})
    return report
