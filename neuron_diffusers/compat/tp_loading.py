"""Tensor-parallel loading (gaps 1, 2, 4, 5 and 7 of `compat/__init__.py`): CPU meshes, checks before any weight is
read, our plan styles taught to stock's shard-spec and style dispatchers, local head counts, the loader's slicing."""

from __future__ import annotations

import functools

import torch
from diffusers.hooks import tensor_parallel
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..distributed import check_heads_divisible
from ..parallel import coalesce, rules, sharded_norm
from ..tp_plans.styles import GatheredColwiseParallel, PartialRowwiseParallel, ShardedRMSNorm
from . import privates

_OUR_STYLES = (GatheredColwiseParallel, PartialRowwiseParallel, ShardedRMSNorm)


def default_tp_device_type() -> str:
    """What stock builds a mesh on when only `tp_degree` is given: the active accelerator, else CPU."""
    return torch._C._get_accelerator().type


def allow_cpu() -> None:
    """Add `cpu` to the device types stock accepts for TP (gap 1): gloo has every collective TP needs."""
    if "cpu" not in tensor_parallel._SUPPORTED_TP_DEVICES:
        tensor_parallel._SUPPORTED_TP_DEVICES = (*tensor_parallel._SUPPORTED_TP_DEVICES, "cpu")


def _check_tp_mesh(tp_config) -> None:
    """Reject a mesh that tensor parallelism cannot use, before any weight is read."""
    mesh = tp_config.mesh
    if mesh is not None and mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        hint = "mesh['tp']" if "tp" in names else "the 1-D sub-mesh of the tensor-parallel dimension"
        raise ValueError(
            f"`TensorParallelConfig(mesh=...)` got a {mesh.ndim}-D mesh {tuple(names) or mesh.shape}: tensor "
            f"parallelism shards over exactly one mesh dimension. Pass {hint} instead."
        )
    device_type = mesh.device_type if mesh is not None else default_tp_device_type()
    supported = tensor_parallel._SUPPORTED_TP_DEVICES
    if device_type not in supported:
        raise ValueError(
            f"Tensor parallelism cannot run on device type '{device_type}': only {list(supported)} have the "
            f"collectives it needs. Build the mesh on one of them, e.g. DeviceMesh('cpu', ranks) with the gloo "
            f"backend."
        )


def wrap_check_tp_supported(stock):
    """Heads and mesh checked with stock's, before any weight is read (gap 2)."""

    @functools.wraps(stock)
    def _check_tp_supported(model_name, tp_plan, num_heads, tp_config, **kwargs):
        check_heads_divisible(model_name, num_heads, tensor_parallel._tp_degree(tp_config))
        stock(model_name, tp_plan, num_heads, tp_config, **kwargs)
        _check_tp_mesh(tp_config)

    return _check_tp_supported


def wrap_resolve_tp_shard_specs(stock):
    """Our styles are laid out exactly like colwise (gathered) and rowwise (partial): translate, then reuse stock."""

    @functools.wraps(stock)
    def resolve_tp_shard_specs(model, tp_plan, tp_degree):
        return shard_specs(model, tp_plan, tp_degree)

    return resolve_tp_shard_specs


def _torch_style(style, partition: bool):
    """The `torch.distributed.tensor.parallel` style that lays out and hooks one of our styles.

    - `GatheredColwiseParallel()`: colwise, output all-gathered to a replicated plain tensor.
    - `GatheredColwiseParallel(hoist_from=...)`: colwise layout and no hooks: `coalesce` computes it.
    - `PartialRowwiseParallel`: rowwise, output left as this rank's partial sum (`Partial()`), for `coalesce`
      to reduce together with its partners.
    - `ShardedRMSNorm`: the norm's weight split like the colwise output it normalizes, and a forward with one
      all-reduce (`parallel/sharded_norm.py`).
    `partition=False` (after a streaming load) keeps the weights the loader already placed as shards.
    """
    if isinstance(style, ShardedRMSNorm):
        return sharded_norm.ShardedNormStyle(partition)
    base = RowwiseParallel if isinstance(style, PartialRowwiseParallel) else ColwiseParallel

    class _Style(base):
        def _partition_linear_fn(self, name, module, device_mesh):
            if partition:
                super()._partition_linear_fn(name, module, device_mesh)

        def _apply(self, module, device_mesh):
            if getattr(style, "hoist_from", None) is None:
                return super()._apply(module, device_mesh)
            return distribute_module(module, device_mesh, self._partition_linear_fn)  # layout only, no hooks

    if isinstance(style, PartialRowwiseParallel):
        return _Style(output_layouts=Partial())
    return _Style(output_layouts=Replicate())


def wrap_style_dispatch(stock, partition: bool):
    """Stock's style dispatch (`_styles`, `_hooks_only_styles`) taught our two styles (gap 4)."""

    @functools.wraps(stock)
    def dispatch(relative_plan):
        # Keep the plan's order: `parallelize_module` shards in dict order, issuing collectives
        # (scatters) as it goes, so every rank must walk the modules in the same sequence.
        resolved = stock({k: v for k, v in relative_plan.items() if not isinstance(v, _OUR_STYLES)})
        return {
            path: _torch_style(style, partition) if isinstance(style, _OUR_STYLES) else resolved[path]
            for path, style in relative_plan.items()
        }

    return dispatch


def shard_specs(model: torch.nn.Module, plan: dict, tp: int, *, whole_plan: bool = True) -> dict:
    """diffusers' own layout of every planned parameter at degree `tp` (`resolve_tp_shard_specs`, our styles included).

    The function the loader streams each rank's slice with, so a lint built on it sees exactly what a load would
    do. Raises `ValueError` for a rule that matches no Linear, an unknown style, packed blocks that do not divide
    the Linear, a block that `tp` does not divide, or coalescing rules `coalesce` cannot honour
    (`whole_plan=False` skips the one check that needs every rule: which Linears a block forward reduces together).
    """
    targets = rules.expand(model, plan)
    coalesce.check_plan(model, plan, whole_plan=whole_plan)
    layouts = {GatheredColwiseParallel: "colwise", PartialRowwiseParallel: "rowwise"}
    stock = privates.stock(tensor_parallel, "resolve_tp_shard_specs")  # diffusers' own, under our wrapper
    linears = {k: layouts.get(type(v), v) for k, v in plan.items() if not isinstance(v, ShardedRMSNorm)}
    norms = [t for t in targets if isinstance(t.style, ShardedRMSNorm)]  # stock lays out Linears only
    return {**stock(model, linears, tp), **sharded_norm.shard_specs(norms, tp)}


def local_shard(tensor: torch.Tensor, dim: int, block_sizes: list[int], mesh) -> torch.Tensor:
    """This rank's part of `tensor` along `dim`, block by block: the slicing diffusers' loader shards weights with
    (`_local_shard`), so a tensor sliced here lines up with the weight shard a rank holds."""
    return tensor_parallel._local_shard(tensor, dim, block_sizes, mesh)


def _set_local_heads(model: torch.nn.Module) -> None:
    """After sharding, `attn.heads` counts this rank's heads, so `unflatten(-1, (attn.heads, -1))` is right (gap 5).

    diffusers' shared `Attention` class has no `head_dim`: its processors derive it as `inner_dim // heads`
    (Qwen-Image) or from the local width and `attn.heads` (`AttnProcessor2_0`, HunyuanVideo). There `heads`
    and `inner_dim` shrink together, keeping their ratio, the head size, for both kinds (and a second call
    changes nothing).
    """
    for module in model.modules():
        weight = getattr(getattr(module, "to_q", None), "weight", None)
        heads, head_dim = getattr(module, "heads", None), getattr(module, "head_dim", None)
        if not (isinstance(heads, int) and isinstance(weight, DTensor)):
            continue
        local_width = weight.to_local().shape[0]
        inner = getattr(module, "inner_dim", None)
        head_size = head_dim if isinstance(head_dim, int) else (inner // heads if isinstance(inner, int) else None)
        if head_size:
            _set_local_kv(module, head_size)
        if isinstance(head_dim, int):
            module.heads = local_width // head_dim
        elif isinstance(getattr(module, "inner_dim", None), int):
            module.heads = local_width // (module.inner_dim // heads)
            module.inner_dim = local_width


def _set_local_kv(module: torch.nn.Module, head_size: int) -> None:
    """Grouped-query attention: processors also read the K/V head count or width from the module (`kv_heads`,
    `inner_kv_dim`, named per class). Each int attribute named for heads or an inner width that counts `to_k`'s
    whole output (in heads or features) is set to this rank's share, read from `to_k`'s local shard."""
    key = getattr(getattr(module, "to_k", None), "weight", None)
    if not isinstance(key, DTensor) or key.shape[0] == key.to_local().shape[0]:
        return
    whole, local = key.shape[0], key.to_local().shape[0]
    for name, value in list(vars(module).items()):
        if name in ("heads", "inner_dim", "head_dim") or type(value) is not int:
            continue
        if "heads" in name and value * head_size == whole:
            setattr(module, name, local // head_size)
        elif name.startswith("inner") and name.endswith("dim") and value == whole:
            setattr(module, name, local)


def wrap_apply_tensor_parallel(stock):
    """Stock's sharding, then local head counts and the coalesced block forwards (`coalesce.install`)."""

    @functools.wraps(stock)
    def apply_tensor_parallel(model, config, tp_plan, weights_already_sharded=False):
        stock(model, config, tp_plan, weights_already_sharded=weights_already_sharded)
        _set_local_heads(model)
        coalesce.install(model, tp_plan, config._mesh)

    return apply_tensor_parallel
