"""Functions that run on spawned gloo ranks (module level, so `spawn` can import them)."""

from __future__ import annotations

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


# -- CFG parallelism: its jobs are in tests/cfg_jobs.py; the prompts are shared with the buckets' checks -------

CFG_PROMPT, CFG_NEGATIVE = "a red fox in the snow", "blurry, low quality"


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


