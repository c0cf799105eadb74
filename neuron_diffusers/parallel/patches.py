"""The one module that reaches into diffusers' private internals; pinned to the diffusers 0.42 series.

diffusers 0.42 ships tensor parallelism (`TensorParallelConfig`, `hooks/tensor_parallel.py`, a
slice-streaming loader) that we build on rather than copy. These gaps are closed here, and only here:

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
   after a streaming load, on Neuron too). Their forward-time behaviour is installed by
   `coalesce.install` right after stock's `apply_tensor_parallel`.
5. Attention processors that split heads with `attn.heads` (MiniMax-H3's, HunyuanVideo's, the stock
   `AttnProcessor2_0`) see the rank's local head count once `to_q` is sharded.
6. The class attributes stock reads plans and repeated blocks from (`_tp_plan`, `_repeated_blocks`) are
   read and written through `tp_plan_of` / `using_plan` / `record_tp_plan` / `compile_blocks`, so no other module
   names them.
7. A LoRA factor must be sliced exactly like the weight shard it updates (`parallel/lora.py`): `local_shard` is the
   loader's own slicing (`_local_shard`, packed blocks included).
8. Image inputs on ranks without a VAE (`pipelines/image_inputs.py`): the posterior every diffusers KL VAE's
   `encode` returns, and its output container, are not exported; `vae_encode_output` rebuilds them from the
   leader's shared parameters so that stock `retrieve_latents` runs unchanged on every rank.
9. Step caches (`parallel/cache.py`): the block metadata FirstBlockCache and MagCache look up, which block lists
   they hook, the hooks' names, and the two decision points (FirstBlockCache's data-dependent one, TaylorSeer's
   counter) that `cache.py` wraps per hook instance so a group of ranks takes every decision together.
10. Parallel VAE (`parallel/vae_rows.py`) recognises the VAEs' building blocks by class: diffusers does not export
    them, so they are looked up here (`vae_blocks`), and listed in `PRIVATE_NAMES` so that a release that renames
    or moves one fails a test rather than an image (an unknown block is refused when parallel VAE is installed).

Context parallelism (Ulysses, ring) next to TP in one `ParallelConfig` (see `context.py`). diffusers 0.42 has both
halves but keeps them apart; diffusers PR #14725 and JingyaHuang/diffusers#2 (open) close the same gaps upstream:

11. `ParallelConfig.__post_init__` refuses a config carrying both. We allow it.
12. `_resolve_parallel_config` hands one mesh to both configs (TP would take the whole mesh as its degree) and
   computes the device as `rank % accelerator.device_count()` for CP too. We set CP up on a mesh with "ring" and
   "ulysses" dims and TP on its "tp" dim, the device from the mesh, after the layout checks (`context`).
13. `from_pretrained(parallel_config=...)` applies only the TP half when both are given: no error, right numbers,
   every rank computing the whole sequence. We attach the CP half after it returns; the checks run before loading.
14. `enable_parallelism` registers the CP hooks *before* TP; diffusers' hook registry captures a module's `forward`
   at registration, so the coalesced block forwards TP installs afterwards (a class swap) would be bypassed. We run
   stock with an empty CP plan (it still checks the backend and hands the config to the processors), then attach
   the real plan after TP, all or nothing (the processors' configs, outside the module snapshot, restored too).
15. Ring attention needs the log-sum-exp of each partial attention; the native backend refuses `return_lse`, so ring
   cannot run on CPU. We compute it with ATen's CPU flash-attention kernel (inference only).
16. The `*_anything` modes exchange per-rank lengths with `gather_size_by_comm`, which gathers on the CPU only when
   the backend string names "cpu" ("cpu:gloo,cuda:nccl"); a plain gloo group is sent to the accelerator (none on a
   CPU host). We gather on the CPU for gloo. Their output gather (`_all_gather_anything`) all-gathers tensors of
   unequal lengths, which gloo refuses: for gloo we pad to the longest and trim.
17. Qwen-Image-2.1 ships no `_cp_plan`: ours (`context_qwenimage21.py`) is set as the class default, like `_tp_plan`.

Exact text padding for Qwen-Image-2.1 (`pipelines/qwenimage21.py`):

18. `QwenImage21Rope` numbers the joint sequence's RoPE positions from the image-slot mask alone, so right-padded
   text would move the image's positions. `exact_text_padding` hooks one transformer's `pos_embed` (a
   `QwenImage21Rope`) so that padded text rows, masked out as keys anyway, take no position of their own.

Each name touched here is private and may move in another release: importing this module refuses any
diffusers outside the pinned series before it imports a single private module (`diffusers~=0.42.1` in
pyproject.toml; tests/test_patches.py checks every name still exists).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import weakref
from collections import OrderedDict

import diffusers
import torch

_PINNED_SERIES = "0.42."


def check_diffusers_version(version: str = diffusers.__version__) -> None:
    """Refuse a diffusers release whose privates this module was not written against."""
    if not version.startswith(_PINNED_SERIES):
        raise ImportError(
            f"neuron_diffusers needs diffusers {_PINNED_SERIES}x (found {version}): it extends diffusers' private "
            "tensor-parallel internals, which differ between releases. Install it with "
            "`pip install 'diffusers~=0.42.1'`."
        )


check_diffusers_version()  # before the private modules below are imported

from diffusers import hooks  # noqa: E402
from diffusers.hooks import (  # noqa: E402
    _common,
    _helpers,
    context_parallel,
    first_block_cache,
    mag_cache,
    taylorseer_cache,
    tensor_parallel,
    tensor_parallel_neuron,
)
from diffusers.models import (  # noqa: E402
    _modeling_parallel,
    attention_dispatch,
    attention_processor,
    downsampling,
    modeling_outputs,
)
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput  # noqa: E402
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry  # noqa: E402
from diffusers.models.autoencoders import autoencoder_kl_qwenimage, autoencoder_kl_qwenimage21  # noqa: E402
from diffusers.models.autoencoders import vae as vae_module  # noqa: E402
from diffusers.models.modeling_utils import ModelMixin  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: E402

from .. import families  # noqa: E402
from ..distributed import check_heads_divisible, mesh_device  # noqa: E402
from ..tp_plans.styles import GatheredColwiseParallel, PartialRowwiseParallel  # noqa: E402
from . import coalesce, context, context_qwenimage21, rules  # noqa: E402

_OUR_STYLES = (GatheredColwiseParallel, PartialRowwiseParallel)

#: diffusers' VAE building blocks (not exported) that parallel VAE handles, by what they do along the rows
#: (see `parallel/vae_rows.py`): self-attention over a whole frame ("gathered"), convolutions that pad their rows
#: themselves in `forward` ("self_padding_convs": (k - 1) / 2 rows, checked at run time), `Downsample2D`, whose
#: `padding=0` means one zero row below in `forward` then `conv` ("bottom_padded_downsample": reads `use_conv`,
#: `padding`, `conv`), and blocks whose output row depends only on its own input rows ("row_local").
VAE_BLOCKS = {
    "gathered": ((attention_processor, "Attention"), (autoencoder_kl_qwenimage, "QwenImageAttentionBlock"),
                 (autoencoder_kl_qwenimage21, "QwenImage21AttentionBlock")),
    "self_padding_convs": ((autoencoder_kl_qwenimage, "QwenImageCausalConv3d"),
                           (autoencoder_kl_qwenimage21, "QwenImage21CausalConv3d")),
    "bottom_padded_downsample": ((downsampling, "Downsample2D"),),
    "row_local": ((autoencoder_kl_qwenimage, "QwenImageRMS_norm"), (autoencoder_kl_qwenimage21, "QwenImage21RMS_norm"),
                  (autoencoder_kl_qwenimage, "QwenImageUpsample"), (autoencoder_kl_qwenimage21, "QwenImage21Upsample"),
                  (autoencoder_kl_qwenimage21, "QwenImage21AvgDown3D"),
                  (autoencoder_kl_qwenimage21, "QwenImage21DupUp3D")),
}
#: Every private diffusers name this module reads or replaces (tests/test_patches.py checks they all exist).
PRIVATE_NAMES = (
    (tensor_parallel, "_SUPPORTED_TP_DEVICES"),
    (tensor_parallel, "_check_tp_supported"),
    (tensor_parallel, "_tp_degree"),
    (tensor_parallel, "_styles"),
    (tensor_parallel, "_hooks_only_styles"),
    (tensor_parallel, "resolve_tp_shard_specs"),
    (tensor_parallel, "apply_tensor_parallel"),
    (tensor_parallel, "_local_shard"),
    (tensor_parallel_neuron, "_hooks_only_styles"),
    (ModelMixin, "_resolve_parallel_config"),
    (ModelMixin, "enable_parallelism"),
    (ModelMixin, "compile_repeated_blocks"),
    (ModelMixin, "from_pretrained"),
    (ModelMixin, "_parallel_config"),
    (ModelMixin, "_cp_plan"),
    (diffusers.ParallelConfig, "__post_init__"),
    (_modeling_parallel, "ContextParallelInput"),
    (_modeling_parallel, "ContextParallelOutput"),
    (_modeling_parallel, "gather_size_by_comm"),
    (diffusers.ContextParallelConfig, "_flattened_mesh"),
    (context_parallel, "gather_size_by_comm"),
    (context_parallel, "_all_gather_anything"),
    (attention_dispatch, "gather_size_by_comm"),
    (attention_dispatch, "_native_attention_forward_op"),
    (attention_dispatch, "_AttentionBackendRegistry"),
    (_AttentionBackendRegistry, "get_active_backend"),
    (_AttentionBackendRegistry, "_is_context_parallel_available"),
    (_AttentionBackendRegistry, "_supports_context_parallel"),
    (torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),  # torch's, for ring's log-sum-exp on CPU
    (vae_module, "DiagonalGaussianDistribution"),
    (modeling_outputs, "AutoencoderKLOutput"),
    (_common, "_ALL_TRANSFORMER_BLOCK_IDENTIFIERS"),
    (_helpers, "TransformerBlockRegistry"),
    (_helpers, "TransformerBlockMetadata"),
    (_helpers.TransformerBlockMetadata, "_cls"),
    (_helpers.TransformerBlockMetadata, "_cached_parameter_indices"),
    (first_block_cache, "_FBC_LEADER_BLOCK_HOOK"),
    (first_block_cache, "_FBC_BLOCK_HOOK"),
    (first_block_cache.FBCHeadBlockHook, "_should_compute_remaining_blocks"),
    (taylorseer_cache, "_TAYLORSEER_CACHE_HOOK"),
    (taylorseer_cache.TaylorSeerCacheHook, "_measure_should_compute"),
    (mag_cache, "_MAG_CACHE_LEADER_BLOCK_HOOK"),
    (mag_cache, "_MAG_CACHE_BLOCK_HOOK"),
    *(entry for entries in VAE_BLOCKS.values() for entry in entries),
)


def _module_with_hook_registry() -> torch.nn.Module:
    module = torch.nn.Identity()
    hooks.HookRegistry.check_if_exists_or_initialize(module)
    return module


#: Instance attributes this module reads (set at run time, so tests/test_patches.py checks them on a fresh instance
#: from the factory): (factory, attribute).
PRIVATE_INSTANCE_ATTRIBUTES = (
    (first_block_cache.FBCSharedBlockState, "head_block_residual"),
    (mag_cache.MagCacheState, "should_compute"),
    (_module_with_hook_registry, "_diffusers_hook"),  # where a module's HookRegistry lives
)

#: Internals the pipeline adapters read to find the largest size a model can make (`PipelineAdapter.size_limits`):
#: the stock pipelines' own timestep-shift functions and the Qwen rotary tables. Imported on first use through
#: `internal`, not with this module: the pipeline modules import whole text-encoder families.
LAZY_PRIVATE_NAMES = (
    ("diffusers.pipelines.flux.pipeline_flux", "calculate_shift"),
    ("diffusers.pipelines.qwenimage.pipeline_qwenimage", "calculate_shift"),
    ("diffusers.pipelines.qwenimage21.pipeline_qwenimage21", "calculate_shift"),
    ("diffusers.pipelines.flux2.pipeline_flux2", "compute_empirical_mu"),
    ("diffusers.models.transformers.transformer_qwenimage", "QwenEmbedRope"),
    ("diffusers.models.transformers.transformer_qwenimage21", "QwenImage21Rope"),
)


def internal(module: str, name: str):
    """The diffusers internal `module.name`, which must be listed in `LAZY_PRIVATE_NAMES` (so the list stays true)."""
    if (module, name) not in LAZY_PRIVATE_NAMES:
        raise KeyError(f"{module}.{name} is not in patches.LAZY_PRIVATE_NAMES: list it there and in "
                       "docs/architecture.md before reading it.")
    return getattr(importlib.import_module(module), name)


def vae_blocks(role: str) -> tuple[type, ...]:
    """The diffusers classes of one role of `VAE_BLOCKS`; a class this release lacks is left out (and refused)."""
    return tuple(getattr(module, name) for module, name in VAE_BLOCKS[role] if hasattr(module, name))


def _default_tp_device_type() -> str:
    """What stock builds a mesh on when only `tp_degree` is given: the active accelerator, else CPU."""
    return torch._C._get_accelerator().type


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
    device_type = mesh.device_type if mesh is not None else _default_tp_device_type()
    supported = tensor_parallel._SUPPORTED_TP_DEVICES
    if device_type not in supported:
        raise ValueError(
            f"Tensor parallelism cannot run on device type '{device_type}': only {list(supported)} have the "
            f"collectives it needs. Build the mesh on one of them, e.g. DeviceMesh('cpu', ranks) with the gloo "
            f"backend."
        )


def _wrap_check_tp_supported(stock):
    @functools.wraps(stock)
    def _check_tp_supported(model_name, tp_plan, num_heads, tp_config, **kwargs):
        check_heads_divisible(model_name, num_heads, tensor_parallel._tp_degree(tp_config))
        stock(model_name, tp_plan, num_heads, tp_config, **kwargs)
        _check_tp_mesh(tp_config)

    return _check_tp_supported


def _split(config):
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


def _check_context_parallel(model_name: str, num_heads: int | None, cp, tp) -> None:
    """Every check a context-parallel request gets before any weight is read (the same words on every rank)."""
    _require_process_group("context-parallel")
    context.check_layout(model_name, num_heads, torch.distributed.get_world_size(), tp=context.tp_size(tp),
                         ulysses=cp.ulysses_degree, ring=cp.ring_degree, ulysses_anything=cp.ulysses_anything)
    if model_name == context_qwenimage21.MODEL_CLASS and cp.ring_degree > 1:
        raise ValueError(context_qwenimage21.RING_REFUSAL)


def _wrap_resolve_parallel_config(stock):
    """Resolve the device from the mesh instead of `accelerator.device_count()`; CP and TP on one mesh (gaps 1, 11)."""

    @functools.wraps(stock)
    def _resolve_parallel_config(self, config):
        config, cp, tp_config = _split(config)
        if cp is not None:
            return _resolve_context_parallel(self, config, cp, tp_config)
        if tp_config is None:
            return stock(self, config)
        _require_process_group("tensor-parallel")
        mesh = tp_config.mesh or torch.distributed.device_mesh.init_device_mesh(
            _default_tp_device_type(), (tp_config.tp_degree,), mesh_dim_names=("tp",)
        )
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        config.setup(rank, world_size, mesh_device(mesh), mesh=mesh)
        self._parallel_config = config
        return config

    return _resolve_parallel_config


def _resolve_context_parallel(model, config, cp, tp):
    name = type(model).__name__
    _check_context_parallel(name, getattr(model.config, "num_attention_heads", None), cp, tp)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device_type = cp.mesh.device_type if cp.mesh is not None else _default_tp_device_type()
    root, tp_mesh = context.resolve_meshes(cp, tp, device_type, world_size)
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


def _wrap_post_init(stock):
    @functools.wraps(stock)
    def __post_init__(self):
        if self.context_parallel_config is not None and self.tensor_parallel_config is not None:
            return  # stock's only check is the refusal of exactly this combination (gap 10)
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


def _processors(model) -> list:
    """The attention processors that read a parallel config (the ones diffusers' CP dispatch consults)."""
    found = {id(p): p for m in model.modules() if hasattr(p := getattr(m, "processor", None), "_parallel_config")}
    return list(found.values())


_ATTACHED = "_neuron_diffusers_cp_plan"


def attach_context_parallel(model, config, plan: dict) -> None:
    """Register the CP half of `config` on a model whose TP half (if any) is already applied (gaps 12, 13)."""
    cp = config.context_parallel_config
    _check_attention_backends(model)
    for processor in _processors(model):
        processor._parallel_config = config
    context.install_split_checks(model, plan, cp)
    if type(model).__name__ == context_qwenimage21.MODEL_CLASS:
        region = cp._flattened_mesh
        context_qwenimage21.install(model, cp, region.get_local_rank(), region.size())
    hooks.apply_context_parallel(model, cp, plan)
    setattr(model, _ATTACHED, plan)


def _cp_plan_of(cls, cp_plan):
    plan = cp_plan if cp_plan is not None else cls._cp_plan
    if plan is None:
        raise ValueError(
            f"{cls.__name__} has no context-parallel plan (`_cp_plan`): diffusers cannot tell which inputs to "
            "split along the sequence. Pass `enable_parallelism(config=..., cp_plan=...)`, or use tensor "
            "parallelism alone."
        )
    return plan


def _wrap_from_pretrained(stock):
    """Checks first (config only), then stock (TP slices streamed), then the CP half it leaves out (gap 12)."""

    @functools.wraps(stock)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        _, cp, tp = _split(kwargs["parallel_config"]) if kwargs.get("parallel_config") is not None else (None,) * 3
        if cp is not None:
            # Stock reads `.tensor_parallel_config` off anything but a `TensorParallelConfig`: wrap a bare CP config.
            kwargs["parallel_config"] = _split(kwargs["parallel_config"])[0]
            _cp_plan_of(cls, None)
            hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "proxies", "local_files_only", "token",
                                          "revision", "subfolder") if k in kwargs}
            model_config = cls.load_config(pretrained_model_name_or_path, **hub)
            _check_context_parallel(cls.__name__, model_config.get("num_attention_heads"), cp, tp)
        result = stock(cls, pretrained_model_name_or_path, *args, **kwargs)
        model = result[0] if isinstance(result, tuple) else result
        if cp is not None and getattr(model, _ATTACHED, None) is None:
            attach_context_parallel(model, model._parallel_config, cls._cp_plan)
        return result

    return from_pretrained


def _snapshot(model: torch.nn.Module) -> list:
    """Every module's class and attributes, with the contents of its dicts (parameters, buffers, hooks, children).

    Restoring writes the saved contents back into the *same* dict objects, so hook handles taken
    before the failed call stay valid. Only plain dicts are mutable state here (a config's
    `FrozenDict` is restored by reference). Classes: `coalesce` swaps some modules' classes.
    """
    return [
        (module, type(module),
         {k: (v, dict(v) if type(v) in (dict, OrderedDict) else None) for k, v in vars(module).items()})
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
    """All or nothing: a failure anywhere leaves the model exactly as it was (gap 3); CP hooks after TP (gap 13)."""

    @functools.wraps(stock)
    def enable_parallelism(self, *, config, cp_plan=None):
        config, cp, _ = _split(config)
        plan = _cp_plan_of(type(self), cp_plan) if cp is not None else None
        snapshot = _snapshot(self)
        # Processors are plain objects, outside the module snapshot: a stale `_parallel_config` left on them would
        # keep routing attention through Ulysses/ring on a model that is no longer split.
        processors = [(p, p._parallel_config) for p in _processors(self)]
        try:
            if cp is None:
                return stock(self, config=config, cp_plan=cp_plan)
            stock(self, config=config, cp_plan={})  # checks, meshes, backend, processors, TP: no CP hooks yet
            attach_context_parallel(self, self._parallel_config, plan)
        except BaseException:
            _restore(snapshot)
            for processor, parallel_config in processors:
                processor._parallel_config = parallel_config
            raise

    return enable_parallelism


def _wrap_native_forward_op(stock):
    """The native backend's forward op with the log-sum-exp ring attention needs, on CPU (gap 14)."""

    @functools.wraps(stock)
    def _native_attention_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False, return_lse=False, _save_ctx=True,
                                     _parallel_config=None):
        if not return_lse or query.device.type != "cpu":
            return stock(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                         _save_ctx=_save_ctx, _parallel_config=_parallel_config)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            raise NotImplementedError("Ring attention on CPU is inference only: run it under torch.no_grad().")
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out.permute(0, 2, 1, 3), lse.permute(0, 2, 1)

    return _native_attention_forward_op


def _wrap_gather_size_by_comm(stock):
    """Per-rank lengths gathered on the CPU over gloo (gap 15)."""

    @functools.wraps(stock)
    def gather_size_by_comm(size: int, group) -> list[int]:
        if torch.distributed.get_backend(group) != "gloo":
            return stock(size, group)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(sizes, torch.tensor([size], dtype=torch.int64), group=group)
        return [s[0].item() for s in sizes]

    return gather_size_by_comm


def _wrap_all_gather_anything(stock):
    """Unequal lengths over gloo: pad to the longest, gather, trim (gap 15)."""

    @functools.wraps(stock)
    def _all_gather_anything(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
        if torch.distributed.get_backend(group) != "gloo":
            return stock(tensor, dim, group)
        sizes = _modeling_parallel.gather_size_by_comm(tensor.shape[dim], group)
        pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, max(sizes) - tensor.shape[dim]]
        padded = torch.nn.functional.pad(tensor, pad).contiguous()
        gathered = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(gathered, padded, group=group)
        return torch.cat([part.narrow(dim, 0, size) for part, size in zip(gathered, sizes, strict=True)], dim=dim)

    return _all_gather_anything


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


def shard_specs(model: torch.nn.Module, plan: dict, tp: int, *, whole_plan: bool = True) -> dict:
    """diffusers' own layout of every planned parameter at degree `tp` (`resolve_tp_shard_specs`, our styles included).

    The function the loader streams each rank's slice with, so a lint built on it sees exactly what a load would
    do. Raises `ValueError` for a rule that matches no Linear, an unknown style, packed blocks that do not divide
    the Linear, a block that `tp` does not divide, or coalescing rules `coalesce` cannot honour
    (`whole_plan=False` skips the one check that needs every rule: which Linears a block forward reduces together).
    """
    rules.expand(model, plan)
    coalesce.check_plan(model, plan, whole_plan=whole_plan)
    layouts = {GatheredColwiseParallel: "colwise", PartialRowwiseParallel: "rowwise"}
    stock = tensor_parallel.resolve_tp_shard_specs.__wrapped__  # diffusers' own, under our wrapper
    return stock(model, {k: layouts.get(type(v), v) for k, v in plan.items()}, tp)


def local_shard(tensor: torch.Tensor, dim: int, block_sizes: list[int], mesh) -> torch.Tensor:
    """This rank's part of `tensor` along `dim`, block by block: the slicing diffusers' loader shards weights with
    (`_local_shard`), so a tensor sliced here lines up with the weight shard a rank holds."""
    return tensor_parallel._local_shard(tensor, dim, block_sizes, mesh)


def _set_local_heads(model: torch.nn.Module) -> None:
    """After sharding, `attn.heads` counts this rank's heads, so `unflatten(-1, (attn.heads, -1))` is right.

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


_STOCK_PLANS: dict[str, dict | None] = {}


def register_plans() -> None:
    """Make our plans the classes' `_tp_plan`, remembering stock's (MiniMax-H3 and HunyuanVideo have none); give
    Qwen-Image-2.1 our context-parallel plan, which diffusers does not ship (gap 16)."""
    for family in families.FAMILIES:
        cls = family.model_class()
        _STOCK_PLANS.setdefault(cls.__name__, cls.__dict__.get("_tp_plan"))
        cls._tp_plan = family.plan
    cls = getattr(diffusers, context_qwenimage21.MODEL_CLASS)
    if cls._cp_plan is None:
        cls._cp_plan = context_qwenimage21.cp_plan(ContextParallelInput, ContextParallelOutput)


def context_parallel_config_of(model: torch.nn.Module):
    """The `ContextParallelConfig` a model runs under, or None (no context parallelism)."""
    config = getattr(model, "_parallel_config", None)
    return getattr(config, "context_parallel_config", None)


def tp_plan_of(cls_or_model) -> dict | None:
    """The plan `from_pretrained(parallel_config=TensorParallelConfig(...))` shards a class with, or the plan a model
    was sharded with (`record_tp_plan`; else its class's)."""
    return cls_or_model._tp_plan


def record_tp_plan(model: torch.nn.Module, plan: dict) -> None:
    """Remember on `model` the plan it was sharded with (`using_plan` restores the class default after the load), so
    later readers see that plan: stock `enable_parallelism` reads `self._tp_plan`, LoRA fusing `tp_plan_of`."""
    model._tp_plan = plan


def cp_plan_of(cls) -> dict | None:
    """The context-parallel plan (`_cp_plan`) diffusers splits `cls`'s sequence with (None: the class has none)."""
    return getattr(cls, "_cp_plan", None)


def stock_plan(cls) -> dict | None:
    """The plan diffusers ships for `cls` (None for a class it does not plan)."""
    return _STOCK_PLANS[cls.__name__] if cls.__name__ in _STOCK_PLANS else cls._tp_plan


@contextlib.contextmanager
def using_plan(cls, plan: dict | None):
    """Load or shard `cls` with `plan` inside the block, e.g. `using_plan(cls, stock_plan(cls))`."""
    previous = cls.__dict__.get("_tp_plan")
    cls._tp_plan = plan
    try:
        yield
    finally:
        cls._tp_plan = previous


def compile_blocks(transformer: torch.nn.Module, block_classes: list[str], **compile_kwargs) -> None:
    """Stock `compile_repeated_blocks` over `block_classes` (which it reads from `_repeated_blocks`), in place."""
    stock_blocks = transformer.__dict__.get("_repeated_blocks")
    transformer._repeated_blocks = block_classes
    try:
        transformer.compile_repeated_blocks(**compile_kwargs)
    finally:
        if stock_blocks is None:
            del transformer._repeated_blocks
        else:
            transformer._repeated_blocks = stock_blocks


def repeated_blocks(transformer: torch.nn.Module) -> list[str]:
    """The block classes the model declares as repeated (what stock compiles by default)."""
    return list(getattr(transformer, "_repeated_blocks", ()) or ())


def posterior_parameters(encoded) -> torch.Tensor:
    """The mean and log-variance (`parameters`) of a KL VAE's `encode` output, refused for any other posterior:
    only a diagonal Gaussian can be rebuilt from its parameters on the ranks without a VAE."""
    posterior = encoded.latent_dist if hasattr(encoded, "latent_dist") else encoded[0]
    if type(posterior) is not vae_module.DiagonalGaussianDistribution or posterior.deterministic:
        raise NotImplementedError(
            f"The VAE's `encode` returned a {type(posterior).__name__}, not a (non-deterministic) diagonal Gaussian "
            "posterior: neuron_diffusers can only share KL-VAE encodings across a TP group."
        )
    return posterior.parameters


def vae_encode_output(parameters: torch.Tensor, return_dict: bool = True):
    """What a KL VAE's `encode(x, return_dict)` returns, rebuilt from its posterior's `parameters`."""
    posterior = vae_module.DiagonalGaussianDistribution(parameters)
    return modeling_outputs.AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)


# --- Qwen-Image-2.1: exact text padding (pipelines/qwenimage21.py) ----------------------------------------------


class _UnpaddedPositions:
    """Stock `QwenImage21Rope.forward(img_shapes, image_pad_mask, device)` walks `image_pad_mask`: every text row
    advances the position, each image block starts after the text before it, padding included, so right-padded text
    would move the image. Padded rows are masked out as keys (the forward's `encoder_hidden_states_mask`, laid out on
    the joint sequence as stock lays out `joint_key_valid`), so their positions change nothing: the rope runs on the
    sequence without them, and each padded row takes the position of the row before it. Real rows get exactly their
    unpadded positions; shapes stay static. Rows of a batch padded differently keep stock's positions."""

    def __init__(self, transformer: torch.nn.Module):
        # The classes' signatures: what a call passes, whatever hooks wrap the instances' `forward` later.
        self._forward = inspect.signature(type(transformer).forward)
        self._rope = inspect.signature(type(transformer.pos_embed).forward)
        self.masks = None  # (encoder_hidden_states_mask, img_mask) of the transformer forward in flight
        self.kept = None  # the joint rows the rope numbered, between its pre-hook and its hook

    def capture(self, module, args, kwargs):
        arguments = self._forward.bind_partial(module, *args, **kwargs).arguments
        self.masks = arguments.get("encoder_hidden_states_mask"), arguments.get("img_mask")

    def release(self, module, args, kwargs, output):
        self.masks = None

    def drop_padding(self, rope, args, kwargs):
        self.kept = None
        text_mask, img_mask = self.masks or (None, None)
        if text_mask is None or img_mask is None:
            return None
        bound = self._rope.bind(rope, *args, **kwargs)
        image_pad_mask = bound.arguments["image_pad_mask"]
        valid = text_mask.bool()[:, ~img_mask[0][: text_mask.shape[1]]]  # the joint text rows, in order
        if valid.all() or not (valid == valid[:1]).all():
            return None
        kept = torch.ones_like(image_pad_mask)
        kept[~image_pad_mask] = valid[0]
        bound.arguments["image_pad_mask"] = image_pad_mask[kept]
        self.kept = kept
        return bound.args[1:], bound.kwargs

    def spread(self, rope, args, kwargs, output):
        if self.kept is None:
            return None
        kept, self.kept = self.kept, None
        return output[(kept.cumsum(0) - 1).clamp(min=0)]


class ExactTextPadding:
    """The hooks `exact_text_padding` installed on one Qwen-Image-2.1 transformer; `remove()` takes them off."""

    def __init__(self, transformer: torch.nn.Module):
        positions = _UnpaddedPositions(transformer)
        rope = transformer.pos_embed
        self._transformer = weakref.ref(transformer)
        self._handles = [
            transformer.register_forward_pre_hook(positions.capture, with_kwargs=True),
            transformer.register_forward_hook(positions.release, with_kwargs=True, always_call=True),
            rope.register_forward_pre_hook(positions.drop_padding, with_kwargs=True),
            rope.register_forward_hook(positions.spread, with_kwargs=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        transformer = self._transformer()
        if transformer is not None and _EXACT_TEXT_PADDING.get(transformer) is self:
            del _EXACT_TEXT_PADDING[transformer]


_EXACT_TEXT_PADDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def exact_text_padding(transformer: torch.nn.Module) -> ExactTextPadding:
    """Make right-padded text (masked rows) give a Qwen-Image-2.1 transformer the unpadded output; idempotent."""
    rope_class = internal("diffusers.models.transformers.transformer_qwenimage21", "QwenImage21Rope")
    if not isinstance(getattr(transformer, "pos_embed", None), rope_class):
        raise TypeError("exact_text_padding needs a Qwen-Image-2.1 transformer (its `pos_embed` a QwenImage21Rope), "
                        f"got {type(transformer).__name__}.")
    if transformer not in _EXACT_TEXT_PADDING:
        _EXACT_TEXT_PADDING[transformer] = ExactTextPadding(transformer)
    return _EXACT_TEXT_PADDING[transformer]


# --- step caches (parallel/cache.py) -----------------------------------------------------------------------------


def cache_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks diffusers' block caches hook: every block of the top-level ModuleLists it recognises by name."""
    return [block for name, child in transformer.named_children()
            if name in _common._ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
            for block in child]


def block_metadata(cls: type) -> tuple[int, int | None] | None:
    """Which outputs of block class `cls` are `hidden_states` and `encoder_hidden_states` (None: unregistered)."""
    try:
        metadata = _helpers.TransformerBlockRegistry.get(cls)
    except ValueError:
        return None
    return metadata.return_hidden_states_index, metadata.return_encoder_hidden_states_index


def register_block_metadata(cls: type, hidden_states_index: int, encoder_hidden_states_index: int | None) -> None:
    """Tell FirstBlockCache and MagCache which outputs of `cls` are which (its inputs keep the stock names)."""
    _helpers.TransformerBlockRegistry.register(cls, _helpers.TransformerBlockMetadata(
        return_hidden_states_index=hidden_states_index, return_encoder_hidden_states_index=encoder_hidden_states_index))


def inherit_block_metadata(cls: type, base: type) -> None:
    """Register `cls`, a subclass with `base`'s forward signature (`coalesce`), with a copy of `base`'s metadata."""
    copy = dataclasses.replace(_helpers.TransformerBlockRegistry.get(base), _cls=None, _cached_parameter_indices=None)
    _helpers.TransformerBlockRegistry.register(cls, copy)


_CACHE_HOOKS = (first_block_cache._FBC_LEADER_BLOCK_HOOK, first_block_cache._FBC_BLOCK_HOOK,
                mag_cache._MAG_CACHE_LEADER_BLOCK_HOOK, mag_cache._MAG_CACHE_BLOCK_HOOK,
                taylorseer_cache._TAYLORSEER_CACHE_HOOK)


def _hooks(transformer: torch.nn.Module, hook_name: str) -> list[tuple[str, hooks.ModelHook]]:
    registries = ((name, getattr(module, "_diffusers_hook", None)) for name, module in transformer.named_modules())
    return [(name, registry.get_hook(hook_name)) for name, registry in registries
            if registry is not None and registry.get_hook(hook_name) is not None]


def cache_hooked_modules(transformer: torch.nn.Module) -> list[str]:
    """The names of the modules that hold a FirstBlockCache, MagCache or TaylorSeer hook."""
    return sorted({module for name in _CACHE_HOOKS for module, _ in _hooks(transformer, name)})


def wrap_first_block_decisions(transformer: torch.nn.Module, decide) -> int:
    """Route each FirstBlockCache head hook's skip decision through `decide`; returns how many hooks.

    `decide(stock, residual, previous, context)` gets stock's decision function, this step's first-block residual,
    the one kept from the last computed step (None at the first) and the `cache_context` name, and returns whether
    to compute the remaining blocks. Replaced per hook instance: `disable_cache` drops the hook and the override.
    """
    leaders = _hooks(transformer, first_block_cache._FBC_LEADER_BLOCK_HOOK)
    for _, hook in leaders:
        stock = hook._should_compute_remaining_blocks

        @torch.compiler.disable  # as stock's: a Python branch on a float, never traced
        def decision(residual, *, hook=hook, stock=stock):
            previous = hook.state_manager.get_state().head_block_residual
            return decide(stock, residual, previous, hook.state_manager.context.name)

        hook._should_compute_remaining_blocks = decision
    return len(leaders)


def wrap_taylorseer_decisions(transformer: torch.nn.Module, record) -> int:
    """Call `record(context, should_compute)` with each TaylorSeer hook's decision; returns how many hooks."""
    hooked = _hooks(transformer, taylorseer_cache._TAYLORSEER_CACHE_HOOK)
    for _, hook in hooked:
        stock = hook._measure_should_compute

        @torch.compiler.disable  # as stock's
        def decision(*, hook=hook, stock=stock):
            should_compute, state = stock()
            record(hook.state_manager.context.name, should_compute)
            return should_compute, state

        hook._measure_should_compute = decision
    return len(hooked)


def mag_cache_decision(transformer: torch.nn.Module) -> tuple[str, bool]:
    """What MagCache's head hook decided at the last forward: (`cache_context` name, computed the blocks)."""
    (_, hook), = _hooks(transformer, mag_cache._MAG_CACHE_LEADER_BLOCK_HOOK)
    return hook.state_manager.context.name, hook.state_manager.get_state().should_compute


_installed = False


def install() -> None:
    """Apply the extensions above once. Called by `import neuron_diffusers`; touches no device."""
    global _installed
    if _installed:
        return
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
    ModelMixin._resolve_parallel_config = _wrap_resolve_parallel_config(ModelMixin._resolve_parallel_config)
    ModelMixin.enable_parallelism = _wrap_enable_parallelism(ModelMixin.enable_parallelism)
    ModelMixin.from_pretrained = classmethod(_wrap_from_pretrained(ModelMixin.from_pretrained.__func__))
    diffusers.ParallelConfig.__post_init__ = _wrap_post_init(diffusers.ParallelConfig.__post_init__)
    attention_dispatch._native_attention_forward_op = _wrap_native_forward_op(
        attention_dispatch._native_attention_forward_op)
    gather = _wrap_gather_size_by_comm(_modeling_parallel.gather_size_by_comm)
    # Both modules bound `gather_size_by_comm` by name at import: rebind it in each.
    _modeling_parallel.gather_size_by_comm = context_parallel.gather_size_by_comm = gather
    attention_dispatch.gather_size_by_comm = gather
    context_parallel._all_gather_anything = _wrap_all_gather_anything(context_parallel._all_gather_anything)
    register_plans()
    _installed = True
