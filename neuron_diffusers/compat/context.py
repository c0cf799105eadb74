"""Context parallelism (Ulysses, ring) next to TP in one `ParallelConfig` (gaps 11-13 and 17 of
`compat/__init__.py`): the config refusal lifted, one mesh for both halves, the CP half `from_pretrained` leaves out,
and the checks every context-parallel request gets before any weight is read."""

from __future__ import annotations

import functools

import diffusers
import torch
from diffusers import hooks
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from ..distributed import mesh_device
from ..parallel import context as layouts
from . import plans
from .attention_route import route_attention
from .tp_loading import default_tp_device_type


def split(config):
    """(ParallelConfig, its CP part, its TP part) for any config `enable_parallelism` / `from_pretrained` accept."""
    if isinstance(config, diffusers.ContextParallelConfig):
        return diffusers.ParallelConfig(context_parallel_config=config), config, None
    if isinstance(config, diffusers.TensorParallelConfig):
        return diffusers.ParallelConfig(tensor_parallel_config=config), None, config
    return config, getattr(config, "context_parallel_config", None), getattr(config, "tensor_parallel_config", None)


def _require_process_group(what: str) -> None:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise RuntimeError(
            f"torch.distributed must be initialized before applying a {what} `parallel_config`: call "
            "`neuron_diffusers.init_distributed()` (or `torch.distributed.init_process_group`) first."
        )


def _check_context_parallel(model_class: type, num_heads: int | None, cp, tp) -> None:
    """Every check a context-parallel request gets before any weight is read (the same words on every rank)."""
    _require_process_group("context-parallel")
    layouts.check_layout(model_class.__name__, num_heads, torch.distributed.get_world_size(), tp=layouts.tp_size(tp),
                         ulysses=cp.ulysses_degree, ring=cp.ring_degree, ulysses_anything=cp.ulysses_anything)
    quirks = plans.cp_quirks_of(model_class)
    if quirks is not None:
        quirks.check(cp)


def wrap_resolve_parallel_config(stock):
    """Resolve the device from the mesh instead of `accelerator.device_count()`; CP and TP on one mesh (gaps 1, 12)."""

    @functools.wraps(stock)
    def _resolve_parallel_config(self, config):
        config, cp, tp_config = split(config)
        if cp is not None:
            return _resolve_context_parallel(self, config, cp, tp_config)
        if tp_config is None:
            return stock(self, config)
        _require_process_group("tensor-parallel")
        mesh = tp_config.mesh or torch.distributed.device_mesh.init_device_mesh(
            default_tp_device_type(), (tp_config.tp_degree,), mesh_dim_names=("tp",)
        )
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        config.setup(rank, world_size, mesh_device(mesh), mesh=mesh)
        self._parallel_config = config
        return config

    return _resolve_parallel_config


def _resolve_context_parallel(model, config, cp, tp):
    _check_context_parallel(type(model), getattr(model.config, "num_attention_heads", None), cp, tp)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device_type = cp.mesh.device_type if cp.mesh is not None else default_tp_device_type()
    root, tp_mesh = layouts.resolve_meshes(cp, tp, device_type, world_size)
    device = mesh_device(root)
    config.tensor_parallel_config = None  # stock `setup` would hand TP the whole mesh
    try:
        config.setup(rank, world_size, device, mesh=root)  # CP slices "ring" and "ulysses" out of it
    finally:
        config.tensor_parallel_config = tp
    if tp is not None:
        tp.setup(rank, world_size, device, tp_mesh)
    model._parallel_config = config
    return config


def wrap_post_init(stock):
    """`ParallelConfig` may carry both halves (gap 11)."""

    @functools.wraps(stock)
    def __post_init__(self):
        if self.context_parallel_config is not None and self.tensor_parallel_config is not None:
            return  # stock's only check is the refusal of exactly this combination
        stock(self)

    return __post_init__


def _check_attention_backends(model) -> None:
    """Every attention processor's backend must support context parallelism (stock checks one, on one path)."""
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(processor, "_attention_backend"):
            continue
        backend = processor._attention_backend
        if backend is None:
            backend = _AttentionBackendRegistry.get_active_backend()[0]
        backend = AttentionBackendName(backend)
        if not _AttentionBackendRegistry._is_context_parallel_available(backend):
            raise ValueError(
                f"{type(model).__name__}'s attention processor {type(processor).__name__} uses the '{backend.value}' "
                f"attention backend, which has no context-parallel implementation. Choose one of "
                f"{sorted(_AttentionBackendRegistry._supports_context_parallel)} with `model.set_attention_backend()`."
            )


def processors(model) -> list:
    """The attention processors that read a parallel config (the ones diffusers' CP dispatch consults)."""
    found = {id(p): p for m in model.modules() if hasattr(p := getattr(m, "processor", None), "_parallel_config")}
    return list(found.values())


_ATTACHED = "_nd_cp_plan"


def attach_context_parallel(model, config, plan: dict) -> None:
    """Register the CP half of `config` on a model whose TP half (if any) is already applied (gaps 13, 14)."""
    cp = config.context_parallel_config
    if plans.routes_attention(model):  # before the processors get the config: the routed ones take it too
        route_attention(model, plan)
    _check_attention_backends(model)
    for processor in processors(model):
        processor._parallel_config = config
    layouts.install_split_checks(model, plan, cp)
    quirks = plans.cp_quirks_of(model)
    if quirks is not None:
        region = cp._flattened_mesh
        quirks.install(model, cp, region.get_local_rank(), region.size())
    hooks.apply_context_parallel(model, cp, plan)
    setattr(model, _ATTACHED, plan)


def cp_plan_or_refuse(cls, cp_plan):
    """`cp_plan` if given, else the class's `_cp_plan`; refused (before any weight is read) when neither exists."""
    plan = cp_plan if cp_plan is not None else cls._cp_plan
    if plan is None:
        raise ValueError(
            f"{cls.__name__} has no context-parallel plan (`_cp_plan`): diffusers cannot tell which inputs to "
            "split along the sequence. Pass `enable_parallelism(config=..., cp_plan=...)`, or use tensor "
            "parallelism alone."
        )
    return plan


HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


def wrap_from_pretrained(stock):
    """Checks first (config only), then stock (TP slices streamed), then the CP half it leaves out (gap 13)."""

    @functools.wraps(stock)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        _, cp, tp = split(kwargs["parallel_config"]) if kwargs.get("parallel_config") is not None else (None,) * 3
        if cp is not None:
            # Stock reads `.tensor_parallel_config` off anything but a `TensorParallelConfig`: wrap a bare CP config.
            kwargs["parallel_config"] = split(kwargs["parallel_config"])[0]
            cp_plan_or_refuse(cls, None)
            hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
            model_config = cls.load_config(pretrained_model_name_or_path, **hub)
            _check_context_parallel(cls, model_config.get("num_attention_heads"), cp, tp)
        result = stock(cls, pretrained_model_name_or_path, *args, **kwargs)
        model = result[0] if isinstance(result, tuple) else result
        if cp is not None and getattr(model, _ATTACHED, None) is None:
            attach_context_parallel(model, model._parallel_config, cls._cp_plan)
        return result

    return from_pretrained


def context_parallel_config_of(model: torch.nn.Module):
    """The `ContextParallelConfig` a model runs under, or None (no context parallelism)."""
    config = getattr(model, "_parallel_config", None)
    return getattr(config, "context_parallel_config", None)
