"""The one module that reaches into diffusers' private tensor-parallel internals.

diffusers 0.42 ships tensor parallelism (`TensorParallelConfig`, `hooks/tensor_parallel.py`, a
slice-streaming loader) that we build on rather than copy. Five gaps are closed here, and only here:

1. CPU meshes. Stock lists the device types it accepts in `_SUPPORTED_TP_DEVICES` (no `cpu`) and
   computes the rank's device as `rank % torch.accelerator.device_count()`, which divides by zero on
   a CPU-only host. We add `cpu` and derive the device from the mesh the user passed.
2. Checks before any weight is read. Stock validates the mesh's device type only in
   `apply_tensor_parallel`, after the whole checkpoint was streamed. We run that check (and a mesh
   shape check) inside `_check_tp_supported`, which both entry points call before loading.
3. A failed `enable_parallelism` leaves the model half-sharded and marked "already applied". We
   snapshot the model and restore it exactly on any failure.
4. Our plan styles, `GatheredColwiseParallel` and `PartialRowwiseParallel` (see `tp_plans/styles.py`),
   taught to the three stock dispatchers: shard specs (so the loader streams only each rank's slice:
   they are laid out exactly like colwise / rowwise), partitioning styles, and hooks-only styles (used
   after a streaming load, on Neuron too). Their forward-time behaviour (one all-reduce for a pair of
   partial sums, one all-gather for all hoisted modulation) is installed by `coalesce.install` right
   after stock's `apply_tensor_parallel`.
5. Attention processors that split heads with `attn.heads` (MiniMax-H3's, HunyuanVideo's, the stock
   `AttnProcessor2_0`) see the rank's local head count once `to_q` is sharded, so they split by
   head_dim as Flux and Qwen already do.

Everything is pinned to the diffusers 0.42 series (`diffusers~=0.42.1` in pyproject): each name we
touch is private and may move in another release, so `install()` refuses other versions loudly.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch

from . import coalesce
from .distributed import divisors
from .tp_plans.styles import GatheredColwiseParallel, PartialRowwiseParallel

_OUR_STYLES = (GatheredColwiseParallel, PartialRowwiseParallel)

_PINNED_SERIES = "0.42."


def _check_diffusers_version() -> None:
    import diffusers

    if not diffusers.__version__.startswith(_PINNED_SERIES):
        raise ImportError(
            f"neuron_diffusers needs diffusers {_PINNED_SERIES}x (found {diffusers.__version__}): it extends "
            "diffusers' private tensor-parallel internals, which differ between releases. Install it with "
            "`pip install 'diffusers~=0.42.1'`."
        )


def mesh_device(mesh) -> torch.device:
    """The device this rank computes on for `mesh`: its own accelerator, or the CPU."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _default_tp_device_type() -> str:
    """What stock builds a mesh on when only `tp_degree` is given: the active accelerator, else CPU."""
    return torch._C._get_accelerator().type


def _check_tp_mesh(tp_config) -> None:
    """Reject a mesh that tensor parallelism cannot use, before any weight is read."""
    from diffusers.hooks import tensor_parallel

    mesh = tp_config.mesh
    if mesh is not None and mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        hint = "mesh['tp']" if "tp" in names else "the 1-D sub-mesh of the tensor-parallel dimension"
        raise ValueError(
            f"`TensorParallelConfig(mesh=...)` got a {mesh.ndim}-D mesh {tuple(names) or mesh.shape}: tensor "
            f"parallelism shards over exactly one mesh dimension. Pass {hint} instead."
        )
    device_type = mesh.device_type if mesh is not None else _default_tp_device_type()
    supported = tensor_parallel._SUPPORTED_TP_DEVICES
    if device_type not in supported:
        raise ValueError(
            f"Tensor parallelism cannot run on device type '{device_type}': only {list(supported)} have the "
            f"collectives it needs. Build the mesh on one of them, e.g. DeviceMesh('cpu', ranks) with the gloo "
            f"backend."
        )


def check_heads_divisible(model_name: str, num_heads: int | None, tp: int) -> None:
    """Each rank must own whole attention heads; name the TP degrees that work."""
    if num_heads is not None and num_heads % tp != 0:
        raise ValueError(
            f"A tensor-parallel degree of {tp} does not divide the {num_heads} attention heads of {model_name}: "
            f"each rank must own whole heads. Valid degrees for this model: {divisors(num_heads)}."
        )


def _wrap_check_tp_supported(stock):
    @functools.wraps(stock)
    def _check_tp_supported(model_name, tp_plan, num_heads, tp_config, **kwargs):
        from diffusers.hooks import tensor_parallel

        check_heads_divisible(model_name, num_heads, tensor_parallel._tp_degree(tp_config))
        stock(model_name, tp_plan, num_heads, tp_config, **kwargs)
        _check_tp_mesh(tp_config)

    return _check_tp_supported


def _wrap_resolve_parallel_config(stock):
    """Resolve a tensor-parallel config's device from its mesh instead of `accelerator.device_count()`."""

    @functools.wraps(stock)
    def _resolve_parallel_config(self, config):
        from diffusers import ParallelConfig, TensorParallelConfig

        tp_config = config if isinstance(config, TensorParallelConfig) else getattr(config, "tensor_parallel_config", None)
        if tp_config is None:
            return stock(self, config)  # context parallelism: untouched
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise RuntimeError(
                "torch.distributed must be initialized before applying a tensor-parallel `parallel_config`: call "
                "`neuron_diffusers.init_distributed()` (or `torch.distributed.init_process_group`) first."
            )
        if isinstance(config, TensorParallelConfig):
            config = ParallelConfig(tensor_parallel_config=config)
        mesh = tp_config.mesh or torch.distributed.device_mesh.init_device_mesh(
            _default_tp_device_type(), (tp_config.tp_degree,), mesh_dim_names=("tp",)
        )
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        config.setup(rank, world_size, mesh_device(mesh), mesh=mesh)
        self._parallel_config = config
        return config

    return _resolve_parallel_config


def _snapshot(model: torch.nn.Module) -> list:
    """Every module's class and attributes, with the contents of its dicts (parameters, buffers, hooks, children).

    Restoring writes the saved contents back into the *same* dict objects, so hook handles taken
    before the failed call stay valid. Only plain dicts are mutable state here (a config's
    `FrozenDict` is restored by reference). Classes: `coalesce` swaps some modules' classes.
    """
    return [
        (module, type(module), {k: (v, dict(v) if type(v) in (dict, OrderedDict) else None) for k, v in vars(module).items()})
        for module in model.modules()
    ]


def _restore(snapshot: list) -> None:
    for module, cls, saved in snapshot:
        module.__class__ = cls
        for key in [k for k in vars(module) if k not in saved]:
            del module.__dict__[key]
        for key, (value, contents) in saved.items():
            if contents is not None:
                value.clear()
                value.update(contents)
            module.__dict__[key] = value


def _wrap_enable_parallelism(stock):
    """All or nothing: a failure anywhere in `enable_parallelism` leaves the model exactly as it was."""

    @functools.wraps(stock)
    def enable_parallelism(self, *, config, cp_plan=None):
        snapshot = _snapshot(self)
        try:
            return stock(self, config=config, cp_plan=cp_plan)
        except BaseException:
            _restore(snapshot)
            raise

    return enable_parallelism


def _wrap_resolve_tp_shard_specs(stock):
    """Our styles are laid out exactly like colwise (gathered) and rowwise (partial): translate, then reuse stock."""

    @functools.wraps(stock)  # also keeps `stock` as `__wrapped__`, which `shard_specs` calls
    def resolve_tp_shard_specs(model, tp_plan, tp_degree):
        return shard_specs(model, tp_plan, tp_degree)

    return resolve_tp_shard_specs


def _torch_style(style, partition: bool):
    """The `torch.distributed.tensor.parallel` style that lays out and hooks one of our styles.

    - `GatheredColwiseParallel()`: colwise, output all-gathered to a replicated plain tensor.
    - `GatheredColwiseParallel(hoist_from=...)`: colwise layout and no hooks: `coalesce` computes it.
    - `PartialRowwiseParallel`: rowwise, output left as this rank's partial sum (`Partial()`), for `coalesce`
      to reduce together with its partners.
    `partition=False` (after a streaming load) keeps the weights the loader already placed as shards.
    """
    from torch.distributed.tensor import Partial, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

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


def _wrap_style_dispatch(stock, partition: bool):
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


def _glob_targets(pattern: str, container: torch.nn.ModuleList) -> list:
    """The module a `prefix.*.suffix` rule names in each block; the first block that lacks it is named."""
    suffix = pattern.partition("*")[2].strip(".")
    targets = []
    for index, block in enumerate(container):
        try:
            targets.append(block.get_submodule(suffix))
        except AttributeError as error:
            if index == 0:
                raise
            raise ValueError(
                f"Tensor-parallel plan rule '{pattern}' fits blocks 0 to {index - 1} but not block {index}: {error}. "
                "A '*' rule applies to every block and cannot skip one, so leave this module, and the Linears that "
                "feed it, out of the plan."
            ) from None
    return targets


def check_plan_matches(model: torch.nn.Module, plan: dict) -> None:
    """Every plan rule must name a Linear in `model`: a typo would otherwise silently shard nothing."""
    for pattern in plan:
        prefix, star, suffix = pattern.partition("*")
        try:
            if star:
                container = model.get_submodule(prefix.strip("."))
                if not isinstance(container, torch.nn.ModuleList):
                    raise ValueError(
                        f"Tensor-parallel plan rule '{pattern}' puts '*' after '{prefix.strip('.')}' "
                        f"({type(container).__name__}), which is not a ModuleList: '*' stands for a block's index. "
                        "Point the prefix at the ModuleList of blocks, or drop the '*'."
                    )
                targets = _glob_targets(pattern, container)
            else:
                targets = [model.get_submodule(pattern)]
        except AttributeError as error:
            raise ValueError(
                f"Tensor-parallel plan rule '{pattern}' matches nothing in {type(model).__name__}: {error}. Fix the "
                "rule's module path (see `model.named_modules()`) or remove it."
            ) from None
        if not targets or not all(isinstance(t, torch.nn.Linear) for t in targets):
            raise ValueError(
                f"Tensor-parallel plan rule '{pattern}' must match nn.Linear modules in {type(model).__name__}, got "
                f"{sorted({type(t).__name__ for t in targets}) or 'no module'}. Point it at the Linear itself."
            )


def shard_specs(model: torch.nn.Module, plan: dict, tp: int, *, whole_plan: bool = True) -> dict:
    """diffusers' own layout of every planned parameter at degree `tp` (`resolve_tp_shard_specs`, our styles included).

    The function the loader streams each rank's slice with, so a lint built on it sees exactly what a load would
    do. Raises `ValueError` for a rule that matches no Linear, an unknown style, packed blocks that do not divide
    the Linear, a block that `tp` does not divide, or coalescing rules `coalesce` cannot honour
    (`whole_plan=False` skips the one check that needs every rule: which Linears a block forward reduces together).
    """
    from diffusers.hooks import tensor_parallel

    check_plan_matches(model, plan)
    coalesce.check_plan(model, plan, whole_plan=whole_plan)
    layouts = {GatheredColwiseParallel: "colwise", PartialRowwiseParallel: "rowwise"}
    stock = tensor_parallel.resolve_tp_shard_specs.__wrapped__  # diffusers' own, under our wrapper
    return stock(model, {k: layouts.get(type(v), v) for k, v in plan.items()}, tp)


def style_kind(style) -> str | None:
    """What a plan style does to its Linear: `"colwise"` (output left split across the ranks, packed or not),
    `"rowwise"` (input split, output all-reduced, now or together with partners later), `"gathered"` (output
    all-gathered, alone or hoisted), or None (not a style)."""
    from diffusers.hooks.tensor_parallel import PackedColwiseParallel, PackedRowwiseParallel

    if isinstance(style, GatheredColwiseParallel):
        return "gathered"
    if style == "colwise" or isinstance(style, PackedColwiseParallel):
        return "colwise"
    if style == "rowwise" or isinstance(style, (PackedRowwiseParallel, PartialRowwiseParallel)):
        return "rowwise"
    return None


def _set_local_heads(model: torch.nn.Module) -> None:
    """After sharding, `attn.heads` counts this rank's heads, so `unflatten(-1, (attn.heads, -1))` is right.

    diffusers' shared `Attention` class has no `head_dim`: its processors derive it as `inner_dim // heads`
    (Qwen-Image) or from the local width and `attn.heads` (`AttnProcessor2_0`, HunyuanVideo). There `heads`
    and `inner_dim` shrink together, keeping their ratio, the head size, for both kinds (and a second call
    changes nothing).
    """
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        weight = getattr(getattr(module, "to_q", None), "weight", None)
        heads, head_dim = getattr(module, "heads", None), getattr(module, "head_dim", None)
        if not (isinstance(heads, int) and isinstance(weight, DTensor)):
            continue
        local_width = weight.to_local().shape[0]
        if isinstance(head_dim, int):
            module.heads = local_width // head_dim
        elif isinstance(getattr(module, "inner_dim", None), int):
            module.heads = local_width // (module.inner_dim // heads)
            module.inner_dim = local_width


def _wrap_apply_tensor_parallel(stock):
    @functools.wraps(stock)
    def apply_tensor_parallel(model, config, tp_plan, weights_already_sharded=False):
        stock(model, config, tp_plan, weights_already_sharded=weights_already_sharded)
        _set_local_heads(model)
        coalesce.install(model, tp_plan, config._mesh)

    return apply_tensor_parallel


_installed = False


def install() -> None:
    """Apply the extensions above once. Called by `import neuron_diffusers`; touches no device."""
    global _installed
    if _installed:
        return
    _check_diffusers_version()
    from diffusers import hooks
    from diffusers.hooks import tensor_parallel, tensor_parallel_neuron
    from diffusers.models.modeling_utils import ModelMixin

    from . import tp_plans

    if "cpu" not in tensor_parallel._SUPPORTED_TP_DEVICES:
        tensor_parallel._SUPPORTED_TP_DEVICES = (*tensor_parallel._SUPPORTED_TP_DEVICES, "cpu")
    tensor_parallel._check_tp_supported = _wrap_check_tp_supported(tensor_parallel._check_tp_supported)
    tensor_parallel.resolve_tp_shard_specs = _wrap_resolve_tp_shard_specs(tensor_parallel.resolve_tp_shard_specs)
    tensor_parallel._styles = _wrap_style_dispatch(tensor_parallel._styles, partition=True)
    tensor_parallel._hooks_only_styles = _wrap_style_dispatch(tensor_parallel._hooks_only_styles, partition=False)
    # The Neuron backend bound `_hooks_only_styles` by name at its import; rebind it there too.
    tensor_parallel_neuron._hooks_only_styles = tensor_parallel._hooks_only_styles
    tensor_parallel.apply_tensor_parallel = _wrap_apply_tensor_parallel(tensor_parallel.apply_tensor_parallel)
    hooks.apply_tensor_parallel = tensor_parallel.apply_tensor_parallel
    tp_plans.register()
    ModelMixin._resolve_parallel_config = _wrap_resolve_parallel_config(ModelMixin._resolve_parallel_config)
    ModelMixin.enable_parallelism = _wrap_enable_parallelism(ModelMixin.enable_parallelism)
    _installed = True
