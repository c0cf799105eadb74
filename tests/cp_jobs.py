"""Context parallelism (tests/test_context_parallel.py): the transformer calls compared, and the rank jobs.

The calls are built in the test process (stock, one process); the jobs run on spawned gloo ranks and return the max
abs difference to those predictions, or the error a configuration raised (so the tests can check the words).
"""

from __future__ import annotations

import copy

import torch
from rank_jobs import _max_diff, _past_the_entry_check

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


def _with_predictions(model, args, kwargs):
    with torch.no_grad():
        return args, kwargs, predictions(model(*args, **kwargs))


def family_calls(checkpoint, family: str) -> dict:
    """Named transformer calls of `family` with their single-process predictions: the stock pipeline's first call
    ("pipeline"), its text cut to 7 tokens ("text7"), Qwen-Image's text padded with masked positions to a multiple of
    4 ("padded4"), and Qwen-Image-2.1's prefill, cached and uncached steps at an even and an odd joint length."""
    if family == "qwenimage21":
        return _qwenimage21_calls(checkpoint)
    model = _transformer(checkpoint)
    args, kwargs, expected = reference_call(checkpoint, family)
    calls = {"pipeline": (args, kwargs, expected)}
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
        cache = QwenImage21KVCache(len(model.transformer_blocks))
        steps = {f"extract{label}": {**base, "kv_cache": cache, "kv_cache_mode": "extract"},
                 f"cached{label}": {**base, "kv_cache": cache, "kv_cache_mode": "cached"},
                 f"nocache{label}": {**base, "kv_cache": None, "kv_cache_mode": None}}
        for name, step in steps.items():  # in this order: the cached step reads what the extract step stored
            calls[name] = _with_predictions(model, args, step)
        cache.layer_caches = QwenImage21KVCache(len(model.transformer_blocks)).layer_caches  # ranks start empty
    return calls


# --- on the ranks --------------------------------------------------------------------------------------------------


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:400]}"


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
    names)]): the max abs difference to one process, or the error it raised."""
    torch.set_num_threads(1)
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
                    report[family, path, label, name] = _max_diff(model, family_calls[name])
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


def api_checks(checkpoints: dict, calls: dict) -> dict:
    """User meshes in both orders, why CP goes on after TP, all-or-nothing, and checks before any weight is read."""
    import diffusers.hooks
    import safetensors
    from diffusers import ContextParallelConfig

    import neuron_diffusers as nd
    from neuron_diffusers.distributed import TP_INNER, ULYSSES_INNER

    torch.set_num_threads(1)
    report = {}
    flux, qwen = checkpoints["flux"], checkpoints["qwenimage"]

    # One mesh from the user, in each order: who is contiguous, and the output.
    for label, order in (("ulysses_inner", ULYSSES_INNER), ("tp_inner", TP_INNER)):
        mesh = nd.init_distributed(tp=2, ulysses=2, order=order)
        report["groups", label] = _groups(mesh)
        model = _load(flux, _config({"ulysses_degree": 2}, mesh=mesh), "from_pretrained")
        report["user_mesh", label] = _max_diff(model, calls["flux"]["pipeline"])

    # Context parallelism alone through `from_pretrained` (stock cannot take a bare ContextParallelConfig there).
    model = resolve(flux).transformer_class().from_pretrained(
        flux, subfolder="transformer", parallel_config=ContextParallelConfig(ulysses_degree=2))
    report["cp_only_from_pretrained"] = _max_diff(model, calls["flux"]["pipeline"])

    # Stock order (CP hooks, then TP): the hooks keep the block forward that TP's coalescing replaces afterwards.
    model = resolve(qwen).transformer_class().from_pretrained(qwen, subfolder="transformer")
    type(model).enable_parallelism.__wrapped__(model, config=_config({"ulysses_degree": 2}))
    report["stock_order_qwen"] = _max_diff(model, calls["qwenimage"]["padded4"])

    # All or nothing: a failure while the CP hooks go on leaves the model exactly as it was.
    model = _transformer(flux)
    before = {name: id(p) for name, p in model.named_parameters()}
    stock_apply = diffusers.hooks.apply_context_parallel

    def failing_apply(module, config, plan):
        stock_apply(module, config, plan)  # the hooks are on: the failure hits a fully sharded, hooked model
        raise RuntimeError("injected failure after the CP hooks")

    diffusers.hooks.apply_context_parallel = failing_apply
    try:
        model.enable_parallelism(config=_config({"ulysses_degree": 2}))
        report["rollback"] = "no failure raised"
    except RuntimeError as error:
        report["rollback"] = {
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
    args, kwargs, _ = calls["flux"]["pipeline"]
    with torch.no_grad():
        report["rollback_output_diff"] = (predictions(model(*args, **kwargs))[0]
                                          - predictions(_transformer(flux)(*args, **kwargs))[0]).abs().max().item()

    # Bad requests are refused before a single weight is read, with the same words on every rank.
    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before the request was checked")

    root = nd.init_distributed(tp=2, ulysses=2)
    bad = {
        "world": (flux, _config({"ulysses_degree": 4})),
        "mesh_degree": (flux, _config({"ring_degree": 2}, mesh=root)),
        "cp_only_world": (flux, ContextParallelConfig(ulysses_degree=8)),
        "qwenimage21_ring": (checkpoints["qwenimage21"], _config({"ring_degree": 2})),
    }
    from diffusers import ParallelConfig, TensorParallelConfig

    bad["tp_mesh_only"] = (flux, ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=2),
                                                tensor_parallel_config=TensorParallelConfig(mesh=root["tp"])))
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
    report["rejections"] = rejections
    return report


# --- the runner and the job (load_pipeline / generate, `neuron-diffusers generate --ulysses`) ----------------------

PROMPT, NEGATIVE = "a red fox in the snow", "blurry, low quality"


def _job_outputs(argv: list[str]) -> dict | None:
    """The `generate` job in this process group (as torchrun runs it): rank 0's summary and written files' bytes."""
    from neuron_diffusers.cli import _parser
    from neuron_diffusers.distributed import detect_runtime
    from neuron_diffusers.job import plan_job, run_job

    args = _parser().parse_args(["generate", *argv])
    runtime = detect_runtime()
    summary = run_job(plan_job(args, runtime.world_size, runtime.device_type), overwrite=False, compile_backend=None,
                      warm=False, timeout_s=300)
    if summary is None:
        return None
    return {"summary": summary, "files": {path.name: path.read_bytes() for path in args.out.iterdir()}}


def _arrays(output):
    """A generated image (PIL or numpy) or clip (`VideoWithAudio`) as numpy arrays, so it pickles small."""
    import numpy as np

    if hasattr(output, "frames"):
        return {"frames": output.frames.numpy(), "audio": None if output.audio is None else output.audio.numpy()}
    image = np.asarray(output, dtype=np.float32)
    return {"image": image / 255.0 if image.max() > 1.0 else image}


def runner_job(checkpoints: dict, calls: dict, jobs: dict, cfg_call: dict) -> dict:
    """On 4 ranks: `generate` at tp=2 x ulysses=2 for every family, the job for those `jobs` names, then true CFG on
    Qwen-Image at cfg=2 x ulysses=2 (tp=1)."""
    import torch.distributed as dist

    import neuron_diffusers as nd
    from neuron_diffusers.consistency import GroupOutOfStepError, LatentsDivergedError
    from neuron_diffusers.distributed import image_group
    from neuron_diffusers.tools.bench.context import count_forward

    torch.set_num_threads(1)
    mesh = nd.init_distributed(tp=2, ulysses=2)
    report = {"mesh": (mesh.mesh_dim_names, tuple(mesh.shape)), "leader": nd.is_group_leader(mesh),
              "group": dist.get_process_group_ranks(image_group(mesh)), "generate": {}}
    for family, checkpoint in checkpoints.items():
        pipe = nd.load_pipeline(checkpoint, mesh)
        counter, _ = count_forward(pipe.adapter.transformer_of(pipe.pipe))  # `bench cp`'s count of one forward
        outputs = pipe.generate(PROMPT, seed=0, **calls[family])
        result = {"output": None if outputs is None else _arrays(outputs[0]), "buckets": pipe.buckets,
                  "mode": tuple(pipe.cp_mode), "encoder": pipe.encoder is not None, "collectives": dict(counter.calls),
                  "attentions": sum(hasattr(m, "processor") for m in pipe.adapter.transformer_of(pipe.pipe).modules())}
        if family == "flux":  # a different seed per rank: the whole image group (not only TP) must notice
            try:  # the entry handshake spans the image group: it refuses the call before any work
                pipe.generate(PROMPT, seed=dist.get_rank() % 2, **calls[family])  # equal within each TP group
                result["entry"] = "not caught"
            except GroupOutOfStepError as error:
                result["entry"] = str(error)
            try:  # and past it, the latent check does too
                with _past_the_entry_check():
                    pipe.generate(PROMPT, seed=dist.get_rank() % 2, **calls[family])
                result["divergence"] = "not caught"
            except LatentsDivergedError as error:
                result["divergence"] = str(error)
        report["generate"][family] = result
        del pipe, outputs
    report["jobs"] = {family: _job_outputs(argv) for family, argv in jobs.items()}

    mesh = nd.init_distributed(tp=1, ulysses=2, cfg=2)
    report["cfg_mesh"] = (mesh.mesh_dim_names, tuple(mesh.shape))
    pipe = nd.load_pipeline(checkpoints["qwenimage"], mesh)
    before = pipe.times.calls.get("transformer forward", 0)
    outputs = pipe.generate(PROMPT, seed=0, negative_prompt=NEGATIVE, true_cfg_scale=4.0, **cfg_call)
    report["cfg"] = {"output": None if outputs is None else _arrays(outputs[0]),
                     "forwards": pipe.times.calls.get("transformer forward", 0) - before}
    return report


def cp_job(checkpoints: dict, calls: dict, api_cases: dict, runner: tuple, compiled: tuple) -> dict:
    """Every multi-rank check of tests/test_context_parallel.py in one 4-rank spawn (each spawn costs seconds of
    imports per rank): diffusers' API, the runner and the job, then compiled under tp=2 x ulysses=2 (last: dynamo's
    state is per process). `seconds` says what each part cost on this rank."""
    import time
    import traceback

    from rank_jobs import compile_checks

    report, seconds = {}, {}
    for name, run in (("matrix", lambda: api_matrix(checkpoints, calls, api_cases)),
                      ("checks", lambda: api_checks(checkpoints, calls)),
                      ("runner", lambda: runner_job(checkpoints, *runner)),
                      ("compiled", lambda: compile_checks(*compiled, mesh_kwargs={"tp": 2, "ulysses": 2}))):
        start = time.perf_counter()
        try:
            report[name] = run()
        except Exception:  # one part's failure fails its tests (with this text), not every test of the spawn
            report[name] = {"error": traceback.format_exc()}
        seconds[name] = round(time.perf_counter() - start, 1)
    report["seconds"] = seconds
    return report
