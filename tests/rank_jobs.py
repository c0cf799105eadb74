"""Functions that run on spawned gloo ranks (module level, so `spawn` can import them)."""

from __future__ import annotations

import contextlib

import torch

from neuron_diffusers.tools.plan.cases import predictions


def _load_tp(checkpoint, mesh):
    from diffusers import TensorParallelConfig

    from neuron_diffusers.checkpoint import resolve

    cls = resolve(checkpoint).transformer_class()
    model = cls.from_pretrained(checkpoint, subfolder="transformer", parallel_config=TensorParallelConfig(mesh=mesh))
    return cls, model


def _max_diff(model, call) -> float:
    args, kwargs, reference = call
    with torch.no_grad():
        outputs = predictions(model(*args, **kwargs))
    assert len(outputs) == len(reference) > 0
    return max((out - ref).abs().max().item() for out, ref in zip(outputs, reference, strict=True))


def _shard_report(model, plan, tp) -> dict:
    """How many planned parameters are DTensor shards of exactly 1/tp of the full tensor (or replicated biases)."""
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs
    from torch.distributed.tensor import DTensor, Shard

    specs = resolve_tp_shard_specs(model, plan, tp)
    wrong = []
    for name, spec in specs.items():
        param = model.get_parameter(name)
        if not isinstance(param, DTensor):
            wrong.append(f"{name}: not a DTensor")
        elif spec.dim is not None and (
            param.placements[0] != Shard(spec.dim) or param.to_local().shape[spec.dim] * tp != param.shape[spec.dim]
        ):
            wrong.append(f"{name}: local {tuple(param.to_local().shape)} of {tuple(param.shape)}")
    return {"planned": len(specs), "wrong": wrong}


def mesh_shapes() -> dict:
    """The meshes `init_distributed` builds on 2 ranks for tp=2 and tp=1."""
    import neuron_diffusers as nd

    mesh, dp_mesh = nd.init_distributed(tp=2), nd.init_distributed(tp=1)
    return {"mesh": (mesh.mesh_dim_names, tuple(mesh.shape)),
            "mesh_tp1": (dp_mesh.mesh_dim_names, tuple(dp_mesh.shape))}


def tp2_load_check(checkpoint, call) -> dict:
    """`from_pretrained(parallel_config=TP 2)`: the output's max difference to one process, and the planned shards."""
    import neuron_diffusers as nd

    cls, model = _load_tp(checkpoint, nd.init_distributed(tp=2)["tp"])
    return {"diff": _max_diff(model, call), **_shard_report(model, cls._tp_plan, 2)}


def enable_parallelism_diff(flux, call) -> float:
    """`enable_parallelism` on a model already in memory: max difference to one process."""
    from diffusers import FluxTransformer2DModel, TensorParallelConfig

    import neuron_diffusers as nd

    model = FluxTransformer2DModel.from_pretrained(flux, subfolder="transformer")
    model.enable_parallelism(config=TensorParallelConfig(mesh=nd.init_distributed(tp=2)["tp"]))
    return _max_diff(model, call)


def enable_parallelism_rollback(flux, call) -> dict | str:
    """`enable_parallelism` all-or-nothing: a failure at the third sharded module leaves the model as it was, and
    enabling it again afterwards still matches one process (`diff_after`)."""
    import torch.distributed.tensor.parallel as tp_api
    from diffusers import FluxTransformer2DModel, TensorParallelConfig

    import neuron_diffusers as nd

    tp_mesh = nd.init_distributed(tp=2)["tp"]
    model = FluxTransformer2DModel.from_pretrained(flux, subfolder="transformer")
    before = {name: id(p) for name, p in model.named_parameters()}
    stock_parallelize = tp_api.parallelize_module
    calls_made = []

    def failing_parallelize(*args, **kwargs):
        calls_made.append(1)
        if len(calls_made) == 3:
            raise RuntimeError("injected failure while sharding")
        return stock_parallelize(*args, **kwargs)

    tp_api.parallelize_module = failing_parallelize
    try:
        model.enable_parallelism(config=TensorParallelConfig(mesh=tp_mesh))
        return "no failure raised"
    except RuntimeError as error:
        rollback = {
            "error": str(error),
            "sharded_before_failure": len(calls_made) - 1,
            "params_restored": {name: id(p) for name, p in model.named_parameters()} == before,
            "config_cleared": model._parallel_config is None,
            "hooks_left": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
        }
    finally:
        tp_api.parallelize_module = stock_parallelize
    model.enable_parallelism(config=TensorParallelConfig(mesh=tp_mesh))
    return {**rollback, "diff_after": _max_diff(model, call)}


class _UnsupportedMesh:
    device_type, ndim = "mps", 1

    def size(self):
        return 2


def bad_mesh_rejections(flux) -> dict:
    """Bad meshes (2-D, an unsupported device) are rejected before a single weight is read."""
    import safetensors
    from diffusers import FluxTransformer2DModel, TensorParallelConfig

    import neuron_diffusers as nd

    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before the mesh was checked")

    stock_open = safetensors.safe_open
    safetensors.safe_open = no_reads
    rejections = {}
    try:
        for label, bad_mesh in (("2d", nd.init_distributed(tp=2)), ("mps", _UnsupportedMesh())):
            try:
                FluxTransformer2DModel.from_pretrained(
                    flux, subfolder="transformer", parallel_config=TensorParallelConfig(mesh=bad_mesh)
                )
                rejections[label] = "accepted"
            except (ValueError, AssertionError) as error:
                rejections[label] = f"{type(error).__name__}: {error}"
    finally:
        safetensors.safe_open = stock_open
    plain = FluxTransformer2DModel.from_pretrained(flux, subfolder="transformer")
    try:
        plain.enable_parallelism(config=TensorParallelConfig(mesh=_UnsupportedMesh()))
    except ValueError as error:
        rejections["enable_mps"] = str(error)
    rejections["enable_mps_untouched"] = plain._parallel_config is None
    return rejections


def plan_checks(checkpoints: dict, calls: dict, checkpoint_missing_a_key) -> dict:
    """Our plans for every family at TP=2 and TP=4 (on 4 ranks): the default one (the class default once imported)
    under `report[family, tp]`, each other variant (`lean`) under `report[(family, variant), tp]`; and the checks
    made before any weight is read."""
    import safetensors
    from diffusers import TensorParallelConfig

    import neuron_diffusers as nd
    from neuron_diffusers import families, using_plan

    report = {}
    for tp in (2, 4):
        mesh = nd.init_distributed(tp=tp)
        for family, checkpoint in checkpoints.items():
            cls, model = _load_tp(checkpoint, mesh["tp"])
            report[family, tp] = {
                "diff": _max_diff(model, calls[family]),
                "ours": cls._tp_plan is families.get(family).plan,
                **_shard_report(model, cls._tp_plan, tp),
            }
            for variant, plan in families.get(family).plan_variants.items():
                if variant != "default":
                    with using_plan(cls, plan):
                        _, model = _load_tp(checkpoint, mesh["tp"])
                    report[(family, variant), tp] = {"diff": _max_diff(model, calls[family]), "ours": True,
                                                     **_shard_report(model, plan, tp)}
            if family == "h3":
                report["h3_heads", tp] = {m.heads for m in model.modules() if type(m).__name__ == "MiniMaxH3Attention"}

    from neuron_diffusers.checkpoint import resolve

    cls = resolve(checkpoints["flux"]).transformer_class()
    tp_mesh = nd.init_distributed(tp=2)["tp"]

    class _ThreeRankMesh:
        device_type, ndim = "cpu", 1

        def size(self):
            return 3

    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before the plan was checked")

    errors = {}
    stock_open = safetensors.safe_open
    safetensors.safe_open = no_reads
    try:
        for label, plan, mesh in (
            ("typo", {**cls._tp_plan, "transformer_blocks.*.attn.to_qq": "colwise"}, tp_mesh),
            ("not_linear", {**cls._tp_plan, "transformer_blocks.*.attn": "colwise"}, tp_mesh),
            ("heads", cls._tp_plan, _ThreeRankMesh()),
        ):
            with using_plan(cls, plan):
                try:
                    cls.from_pretrained(checkpoints["flux"], subfolder="transformer",
                                        parallel_config=TensorParallelConfig(mesh=mesh))
                    errors[label] = "accepted"
                except (ValueError, AssertionError) as error:
                    errors[label] = f"{type(error).__name__}: {error}"
    finally:
        safetensors.safe_open = stock_open
    try:
        cls.from_pretrained(checkpoint_missing_a_key, subfolder="transformer",
                            parallel_config=TensorParallelConfig(mesh=tp_mesh))
        errors["missing_key"] = "accepted"
    except ValueError as error:
        errors["missing_key"] = str(error)
    report["errors"] = errors
    return report


def _as_arrays(output):
    """A generated image (PIL) or clip (`VideoWithAudio`) as numpy arrays, so it pickles small and compares."""
    import numpy as np

    if hasattr(output, "frames"):  # MiniMax-H3 with audio, Wan without
        return {"frames": output.frames.numpy(), "audio": None if output.audio is None else output.audio.numpy(),
                "fps": output.fps, "sampling_rate": output.sampling_rate}
    return {"image": np.asarray(output, dtype=np.float32) / 255.0}


def _loaded_models():
    """Class names of the text encoders and VAEs alive in this process whose weights are really in memory."""
    import gc

    import transformers
    from diffusers import ModelMixin

    names = set()
    for obj in gc.get_objects():
        if isinstance(obj, transformers.PreTrainedModel) or (
            isinstance(obj, ModelMixin) and type(obj).__name__.startswith("Autoencoder")
        ):
            if any(p.device.type != "meta" for p in obj.parameters()):
                names.add(type(obj).__name__)
    return sorted(names)


@contextlib.contextmanager
def _past_the_entry_check():
    """`generate`'s entry handshake skipped, so per-rank arguments (a seed per rank) reach the checks behind it: the
    latent and CFG-branch checks must still catch what gets past (per-rank noise, nondeterministic kernels)."""
    from neuron_diffusers.consistency import CallEntry

    enter = CallEntry.enter
    CallEntry.enter = lambda self, arguments: None
    try:
        yield
    finally:
        CallEntry.enter = enter


def _refusals(pipe, family: str, call: dict) -> dict:
    """What `generate` says to inputs it owns (prompt embeddings, generator, latents) or cannot run."""
    refused = {}
    for name in ("prompt_embeds", "generator", "latents", "caption_upsample_temperature"):  # owned / cannot run
        try:
            pipe.generate("a red fox", **{name: None}, **call)
            refused[name] = "accepted"
        except ValueError as error:
            refused[name] = str(error)
    if family == "qwenimage":  # its schedule ends at shift_terminal: one step would be 0 / 0, refused up front
        try:
            pipe.generate("a red fox", **{**call, "num_inference_steps": 1})
            refused["one_step"] = "accepted"
        except ValueError as error:
            refused["one_step"] = str(error)
    return refused


def _divergence(pipe, call: dict) -> str:
    """A different seed per rank, past the entry check: the noise diverges across the group, and is caught."""
    import torch.distributed as dist

    from neuron_diffusers.consistency import LatentsDivergedError

    try:
        with _past_the_entry_check():
            pipe.generate("a red fox in the snow", seed=dist.get_rank(), **call)
        return "not caught"
    except LatentsDivergedError as error:
        return str(error)


def runner_checks(family: str, checkpoint, call: dict) -> dict:
    """`load_pipeline(...).generate(...)` at TP=2 for one family, one case a key (`rank_cases.record`): the output,
    who loaded what, divergence caught, inputs refused. A case that raises fails only its own test."""
    import gc

    from rank_cases import CaseError, record

    import neuron_diffusers as nd

    report = {}
    pipe = record(report, "load", nd.load_pipeline, checkpoint, nd.init_distributed(tp=2))
    if isinstance(pipe, CaseError):  # every case reports the failed load
        return dict.fromkeys(("output", "holds_encoder", "models_in_memory", "divergence", "refused"), pipe)
    del report["load"]
    outputs = record(report, "output", pipe.generate, "a red fox in the snow", seed=0, **call)
    if outputs is not None and not isinstance(outputs, CaseError):  # only the TP leader returns images
        record(report, "output", _as_arrays, outputs[0])
    report["holds_encoder"] = pipe.encoder is not None
    record(report, "models_in_memory", _loaded_models)
    record(report, "divergence", _divergence, pipe, call)
    record(report, "refused", _refusals, pipe, family, call)
    del pipe, outputs
    gc.collect()
    return report


def runner_lean_check(checkpoint, call: dict) -> dict:
    """The lean plan by name (Qwen-Image-2.1): modulation sharded too, same image."""
    from torch.distributed.tensor import DTensor

    import neuron_diffusers as nd

    pipe = nd.load_pipeline(checkpoint, nd.init_distributed(tp=2), plan="lean")
    outputs = pipe.generate("a red fox in the snow", seed=0, **call)
    modulation = pipe.adapter.transformer_of(pipe.pipe).modulation[1].weight
    return {"output": None if outputs is None else _as_arrays(outputs[0]),
            "modulation_sharded": isinstance(modulation, DTensor)}


def compile_checks(checkpoints: dict, call_kwargs: dict, load_kwargs: dict, prompts: list, backend: str,
                   mesh_kwargs: dict | None = None) -> dict:
    """On `init_distributed(**mesh_kwargs)` (default TP=2): warm up, then count graphs, breaks and recompiles over
    `prompts` (a list, or a list per family); compare to eager."""
    import torch

    import neuron_diffusers as nd
    from neuron_diffusers.compile import compile_repeated_blocks, compile_report, warmup

    torch.set_num_threads(1)  # as torchrun does: ranks share the cores
    mesh = nd.init_distributed(**(mesh_kwargs or {"tp": 2}))
    report = {}
    for family, checkpoint in checkpoints.items():
        family_prompts = prompts[family] if isinstance(prompts, dict) else prompts
        torch._dynamo.reset()
        start = compile_report()  # dynamo's counters are per process: count this family's graphs from here
        pipe = nd.load_pipeline(checkpoint, mesh, **load_kwargs.get(family, {}))
        kwargs = dict(call_kwargs[family])
        if family != "h3":
            kwargs["output_type"] = "pt"
        eager = pipe.generate(family_prompts[0], seed=0, **kwargs)
        compile_repeated_blocks(pipe, backend=backend)
        guard = warmup(pipe, [(kwargs["height"], kwargs["width"])], on_recompile="raise",
                       **{k: v for k, v in kwargs.items() if k not in ("height", "width")})
        warm = compile_report()
        compiled = [pipe.generate(prompt, seed=0, **kwargs) for prompt in family_prompts]
        guard.remove()
        after = compile_report()
        report[family] = {
            "graphs_after_warmup": warm["graphs"] - start["graphs"],
            "new_graphs": after["graphs"] - warm["graphs"],
            "new_recompiles": after["recompiles"] - warm["recompiles"],
            "graph_breaks": after["graph_breaks"] - start["graph_breaks"],
            "diff": None if eager is None else _max_output_diff(compiled[0][0], eager[0]),
        }
    return report


def _max_output_diff(a, b) -> float:
    if hasattr(a, "frames"):
        audio = 0.0 if a.audio is None else (a.audio - b.audio).abs().max().item()  # Wan makes no audio
        return max((a.frames - b.frames).abs().max().item(), audio)
    return (a - b).abs().max().item()


# -- CFG parallelism (tests/test_cfg_parallel.py) ------------------------------------------------------------------

CFG_PROMPT, CFG_NEGATIVE = "a red fox in the snow", "blurry, low quality"


def _forwards(pipe) -> int:
    return pipe.times.calls.get("transformer forward", 0)


def _cfg_generations(mesh, checkpoints: dict, cases: dict) -> dict:
    """Per case: the CFG-parallel image, the same image made serially by this rank's TP group alone, and the real
    transformer forwards each took on this rank."""
    import gc

    import numpy as np

    import neuron_diffusers as nd

    report, pipes = {}, {}
    for case, (family, call) in cases.items():
        pipe = pipes.get(family) or nd.load_pipeline(checkpoints[family], mesh)
        pipes = {family: pipe}  # consecutive cases of one family share the pipeline
        kwargs = dict(call, negative_prompt=CFG_NEGATIVE, true_cfg_scale=4.0, output_type="np")
        before = _forwards(pipe)
        parallel = pipe.generate(CFG_PROMPT, seed=0, **kwargs)
        middle = _forwards(pipe)
        serial = pipe.generate(CFG_PROMPT, seed=0, alone=True, **kwargs)
        report[case] = {
            "image": None if parallel is None else parallel[0],
            "equals_serial": None if parallel is None else bool(np.array_equal(parallel[0], serial[0])),
            "forwards": middle - before,
            "serial_forwards": _forwards(pipe) - middle,
            "transformer_is_real": type(pipe.pipe.transformer).__name__ != "CFGParallelTransformer",
        }
        gc.collect()
    return report


def _job_outputs(argv: list[str]) -> dict:
    """Run the `generate` job in this process group (as torchrun would) and read back what rank 0 wrote."""
    import numpy as np
    from PIL import Image

    from neuron_diffusers.cli import _parser
    from neuron_diffusers.distributed import detect_runtime
    from neuron_diffusers.job import plan_job, run_job

    args = _parser().parse_args(["generate", *argv])
    runtime = detect_runtime()
    plan = plan_job(args, runtime.world_size, runtime.device_type)
    summary = run_job(plan, overwrite=False, compile_backend=None, warm=False, timeout_s=300)
    if summary is None:
        return None
    return {
        "summary": summary,
        "notes": plan.notes,
        "pixels": {image["file"]: np.asarray(Image.open(args.out / image["file"]))
                   for image in summary["images"]},
        "settings": {image["file"]: dict(Image.open(args.out / image["file"]).text) for image in summary["images"]},
    }


class _EchoTransformer(torch.nn.Module):
    """A stand-in transformer whose output spans text + image, so cond and uncond differ in length (as
    Qwen-Image-2.1's do when it does not read its text KV cache); it records the cache contexts it is called in."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)
        self.contexts = []

    def cache_context(self, name: str, **kwargs):
        import contextlib

        self.contexts.append(name)
        return contextlib.nullcontext()

    def forward(self, hidden_states, encoder_hidden_states, return_dict: bool = False):
        joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        return (self.proj(joint) * joint.mean(),)


def _echo_denoise(pipe, latents, text, negative, guided_steps, steps=3, **call):
    """A stock-style loop: cond, then uncond on `guided_steps` only (the others are CFG-truncated steps)."""
    for step in range(steps):
        with pipe.transformer.cache_context("cond"):
            pred = pipe.transformer(hidden_states=latents, encoder_hidden_states=text, **call)[0][:, -latents.shape[1]:]
        if step in guided_steps:
            with pipe.transformer.cache_context("uncond"):
                uncond = pipe.transformer(hidden_states=latents, encoder_hidden_states=negative)[0]
            uncond = uncond[:, -latents.shape[1]:]
            pred = uncond + 4.0 * (pred - uncond)
        latents = latents - 0.1 * pred
    return latents


def _proxy_checks(real_transformer, group) -> dict:
    """`CFGParallelTransformer` on its own, on the 2-rank CFG pair: exactness with a truncated step and unequal
    branch lengths, the contexts and forwards of the real model, attribute forwarding, and every refusal."""
    import inspect
    import types

    import torch.distributed as dist

    from neuron_diffusers.parallel.cfg import CFGParallelTransformer, cfg_parallel_transformer

    rank = dist.get_rank()
    text, negative = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(1)), torch.randn(
        1, 5, 4, generator=torch.Generator().manual_seed(2))
    latents = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(3))
    mine = (text, negative) if rank == 0 else (negative, text)  # what the runner's swap does for CFG rank 1
    pipe = types.SimpleNamespace(transformer=_EchoTransformer())
    reference = _echo_denoise(pipe, latents, text, negative, guided_steps={0, 2})
    pipe.transformer.contexts.clear()
    with cfg_parallel_transformer(pipe, group):
        parallel = _echo_denoise(pipe, latents, *mine, guided_steps={0, 2})
    report = {"exact": torch.equal(parallel, reference), "contexts": list(pipe.transformer.contexts)}

    proxy = CFGParallelTransformer(real_transformer, group)
    report["forwarded"] = {
        "config": proxy.config is real_transformer.config,
        "dtype": proxy.dtype == real_transformer.dtype,
        "blocks": proxy.transformer_blocks is real_transformer.transformer_blocks,
        "signature": inspect.signature(proxy.forward) == inspect.signature(real_transformer.forward),
        "device": proxy.device == real_transformer.device,
        "compile_repeated_blocks": proxy.compile_repeated_blocks.__self__ is real_transformer,
    }

    def error_of(run) -> str:
        try:
            with cfg_parallel_transformer(pipe, group):
                run()
            return "no error"
        except (RuntimeError, ValueError) as error:
            return f"{type(error).__name__}: {error}"

    wrong_negative = negative + 1.0
    report["errors"] = {
        "wrong_branch": error_of(lambda: _echo_denoise(
            pipe, latents, *((text, negative) if rank == 0 else (wrong_negative, text)), guided_steps={0})),
        "diverged": error_of(lambda: _echo_denoise(pipe, latents + rank, *mine, guided_steps={0})),
        "no_context": error_of(lambda: pipe.transformer(hidden_states=latents, encoder_hidden_states=text)),
        "uncond_first": error_of(lambda: _uncond_first(pipe, latents, text)),
        "ip_adapter": error_of(lambda: _echo_denoise(
            pipe, latents, *mine, guided_steps={0}, joint_attention_kwargs={"ip_adapter_image_embeds": [text]})),
    }
    return report


def _uncond_first(pipe, latents, text):
    with pipe.transformer.cache_context("uncond"):
        pipe.transformer(hidden_states=latents, encoder_hidden_states=text)


def _compiled_cfg_parallel(pipe, call: dict) -> dict:
    """The real model's blocks compiled and warmed up (no negative prompt), then a CFG-parallel call: no recompile,
    and the image of the uncompiled model."""
    import numpy as np

    from neuron_diffusers.compile import compile_repeated_blocks, compile_report, warmup

    kwargs = dict(call, negative_prompt=CFG_NEGATIVE, output_type="np")
    eager = pipe.generate(CFG_PROMPT, seed=0, **kwargs)
    start = compile_report()
    compile_repeated_blocks(pipe, backend="eager")
    guard = warmup(pipe, [(call["height"], call["width"])], on_recompile="raise",
                   num_inference_steps=call["num_inference_steps"])
    before = compile_report()
    compiled = pipe.generate(CFG_PROMPT, seed=0, **kwargs)
    guard.remove()
    after = compile_report()
    return {"warm_up_graphs": before["graphs"] - start["graphs"], "new_graphs": after["graphs"] - before["graphs"],
            "recompiles": after["recompiles"] - before["recompiles"],
            "equal": None if eager is None else bool(np.array_equal(eager[0], compiled[0]))}


def cfg_pair_checks(checkpoints: dict, cases: dict, split_call: dict, jobs: dict) -> dict:
    """On 2 CPU ranks (one CFG pair, tp=1): CFG-parallel generation and forwards per case, the pair splitting
    prompts without true CFG, a divergent seed, the IP-Adapter refusal, the proxy alone, and the job."""
    import torch.distributed as dist

    import neuron_diffusers as nd
    from neuron_diffusers.parallel.cfg import CFGBranchMismatchError

    torch.set_num_threads(1)  # as torchrun does: ranks share the cores
    mesh = nd.init_distributed(tp=1, cfg=2)
    report = {"mesh": (mesh.mesh_dim_names, tuple(mesh.shape)), "cases": _cfg_generations(mesh, checkpoints, cases)}

    pipe = nd.load_pipeline(checkpoints["qwenimage"], mesh)
    before = _forwards(pipe)
    split = pipe.generate([CFG_PROMPT, "a blue bird"], seed=0, output_type="np", **split_call)
    report["split"] = {"images": split, "forwards": _forwards(pipe) - before}
    try:
        with _past_the_entry_check():
            pipe.generate(CFG_PROMPT, seed=dist.get_rank(), negative_prompt=CFG_NEGATIVE, **split_call)
        report["divergence"] = "not caught"
    except CFGBranchMismatchError as error:
        report["divergence"] = str(error)
    try:
        pipe.generate(CFG_PROMPT, negative_prompt=CFG_NEGATIVE, ip_adapter_image=object(), **split_call)
        report["ip_adapter"] = "accepted"
    except ValueError as error:
        report["ip_adapter"] = str(error)
    report["proxy"] = _proxy_checks(pipe.adapter.transformer_of(pipe.pipe), mesh["cfg"].get_group())
    report["compiled"] = _compiled_cfg_parallel(pipe, split_call)
    del pipe
    report["jobs"] = {name: _job_outputs(argv) for name, argv in jobs.items()}
    rerun = _job_outputs(jobs["qwenimage"])  # every output exists: the pair resumes with nothing to do
    report["rerun_generated"] = None if rerun is None else rerun["summary"]["generated"]
    return report


def cfg_tp_checks(checkpoints: dict, cases: dict, jobs: dict) -> dict:
    """On 4 CPU ranks (one CFG pair of TP=2 groups): CFG-parallel generation per case, and the job."""
    import neuron_diffusers as nd

    torch.set_num_threads(1)  # as torchrun does: ranks share the cores
    mesh = nd.init_distributed(tp=2, cfg=2)
    return {"mesh": (mesh.mesh_dim_names, tuple(mesh.shape)), "cases": _cfg_generations(mesh, checkpoints, cases),
            "jobs": {name: _job_outputs(argv) for name, argv in jobs.items()}}


# -- Qwen-Image-2.1's exact text buckets (tests/test_pipelines.py) -------------------------------------------------

#: The layouts bucketed Qwen-Image-2.1 must match its unpadded self on, two ranks each.
QI21_LAYOUTS = {"tp2": {"tp": 2}, "cfg2": {"tp": 1, "cfg": 2}, "tp1 x ulysses2": {"tp": 1, "ulysses": 2}}


def _recording_outputs(transformer, record: list):
    """Per forward: the text length it saw and its target-image rows (what the pipeline keeps of its output)."""
    def hook(module, args, kwargs, output):
        rows = kwargs["hidden_states"].shape[1]
        record.append((kwargs["encoder_hidden_states"].shape[1], output[0][:, -rows:].detach().clone()))
    return transformer.register_forward_hook(hook, with_kwargs=True)


def qwenimage21_bucket_checks(checkpoint, call: dict, prompts: list) -> dict:
    """Per layout, KV cache on and off, and prompt (with a negative, true CFG): the default (bucketed) pipeline against
    `buckets=()` on the same ranks: the text lengths each transformer saw, the largest difference of its outputs
    (target rows, this rank's forwards), and on the leader the mean image difference."""
    import numpy as np

    import neuron_diffusers as nd

    torch.set_num_threads(1)
    report = {}
    for layout, mesh_kwargs in QI21_LAYOUTS.items():
        mesh = nd.init_distributed(**mesh_kwargs)
        pipes = {"bucketed": nd.load_pipeline(checkpoint, mesh), "unpadded": nd.load_pipeline(checkpoint, mesh,
                                                                                              buckets=())}
        for use_kv_cache in (True, False):
            for index, prompt in enumerate(prompts):
                seen, images = {}, {}
                for label, pipe in pipes.items():
                    seen[label] = []
                    handle = _recording_outputs(pipe.adapter.transformer_of(pipe.pipe), seen[label])
                    images[label] = pipe.generate(prompt, seed=0, negative_prompt=CFG_NEGATIVE, true_cfg_scale=4.0,
                                                  use_kv_cache=use_kv_cache, output_type="np", **call)
                    handle.remove()
                pairs = list(zip(seen["bucketed"], seen["unpadded"], strict=True))
                report[layout, use_kv_cache, index] = {
                    "text_lengths": {label: sorted({length for length, _ in rows}) for label, rows in seen.items()},
                    "output_diff": max((a - b).abs().max().item() for (_, a), (_, b) in pairs),
                    "image_diff": None if images["bucketed"] is None else float(np.abs(
                        images["bucketed"][0].astype(np.float64) - images["unpadded"][0]).mean()),
                    "modes": {label: pipe.cp_mode and tuple(pipe.cp_mode) for label, pipe in pipes.items()},
                }
        del pipes
    return report
