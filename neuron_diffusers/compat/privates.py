"""The registry of every private name of diffusers (and torch) that neuron_diffusers reaches, anywhere.

`PRIVATE_NAMES` lists (owner, name) pairs, `SIGNATURES` the parameter names of the private functions we wrap or call
(tests/test_patches.py checks both against the installed releases, so a release that renames, moves or re-signs one
fails a test rather than an image). Modules outside `compat` that need one take it from here (`Flux2Modulation`,
`FLUX_MAG_RATIOS`, `ContextParallelInput`, ...); the few left where they are used are listed all the same.

`STOCK` keeps diffusers' own functions that `install` replaces; our wrappers call them through `StockCall`, which
looks the function up at each call, so rebinding one (a test, another extension) takes effect.
"""

from __future__ import annotations

import importlib
import inspect

import diffusers
import torch
import torch._dynamo.utils
from diffusers.hooks import context_parallel, tensor_parallel, tensor_parallel_neuron
from diffusers.models import _modeling_parallel, attention_dispatch
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.transformers import transformer_flux2, transformer_qwenimage

from . import attention_route, cache, plans, vae

#: Where diffusers' context-parallel plans say to split and gather the sequence (not exported by diffusers 0.42).
ContextParallelInput = _modeling_parallel.ContextParallelInput
ContextParallelOutput = _modeling_parallel.ContextParallelOutput
#: Flux.2's shared modulation (its `split` is called by Flux.2's coalesced block forward, `pipelines/flux2_blocks.py`).
Flux2Modulation = transformer_flux2.Flux2Modulation

#: Private names of the tensor- and context-parallel paths (`tp_loading`, `context`, `enable`, `install`).
_PARALLEL_NAMES = (
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
    (ModelMixin, "from_pretrained"),
    (ModelMixin, "_parallel_config"),
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
)

#: Reached outside `compat` (not exported by diffusers, or torch-private).
_ELSEWHERE = (
    (transformer_flux2, "Flux2Modulation"),  # pipelines/flux2_blocks.py
    (Flux2Modulation, "split"),
    (transformer_qwenimage.QwenImageTransformerBlock, "_modulate"),  # pipelines/qwenimage_blocks.py
    (tensor_parallel, "PackedColwiseParallel"),  # tp_plans/*.py, parallel/rules.py
    (tensor_parallel, "PackedRowwiseParallel"),
    (torch._C, "_get_accelerator"),  # `tp_loading`: the device stock builds a mesh on
    (torch.distributed.distributed_c10d, "_get_default_store"),  # distributed.default_store: the group's store
    (torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),  # `collectives`: ring's log-sum-exp on CPU
    (torch._dynamo.utils, "counters"),  # compile.py: recompiles and graph breaks
    (torch._dynamo.utils, "compilation_time_metrics"),
    (torch._dynamo.utils, "guard_failures"),
    (torch._dynamo, "reset"),  # compile.py, tools/bench
    (torch._dynamo.config, "recompile_limit"),
    (torch._dynamo.exc, "FailOnRecompileLimitHit"),  # tools/bench/device_family.py
)

#: Every private name the package reads or replaces (tests/test_patches.py checks they all exist).
PRIVATE_NAMES = (*_PARALLEL_NAMES, *attention_route.PRIVATE_NAMES, *plans.PRIVATE_NAMES, *cache.PRIVATE_NAMES,
                 *vae.PRIVATE_NAMES, *_ELSEWHERE)

#: Instance attributes read (set at run time: checked on a fresh instance from the factory): (factory, attribute).
PRIVATE_INSTANCE_ATTRIBUTES = cache.PRIVATE_INSTANCE_ATTRIBUTES

#: The parameter names of every private function we wrap or call, as the code here calls them.
SIGNATURES = {
    (tensor_parallel, "_check_tp_supported"): ("model_name", "tp_plan", "num_heads", "tp_config", "model",
                                               "device_map", "hf_quantizer", "low_cpu_mem_usage", "use_flashpack",
                                               "use_safetensors"),
    (tensor_parallel, "_tp_degree"): ("tp_config",),
    (tensor_parallel, "_styles"): ("relative_plan",),
    (tensor_parallel, "_hooks_only_styles"): ("relative_plan",),
    (tensor_parallel, "resolve_tp_shard_specs"): ("model", "tp_plan", "tp_degree"),
    (tensor_parallel, "apply_tensor_parallel"): ("model", "config", "tp_plan", "weights_already_sharded"),
    (tensor_parallel, "_local_shard"): ("tensor", "dim", "block_sizes", "tp_mesh"),
    (ModelMixin, "_resolve_parallel_config"): ("self", "config"),
    (ModelMixin, "enable_parallelism"): ("self", "config", "cp_plan"),
    (ModelMixin, "from_pretrained"): ("cls", "pretrained_model_name_or_path", "kwargs"),
    (ModelMixin, "compile_repeated_blocks"): ("self", "args", "kwargs"),
    (diffusers.ParallelConfig, "__post_init__"): ("self",),
    (_modeling_parallel, "gather_size_by_comm"): ("size", "group"),
    (context_parallel, "_all_gather_anything"): ("tensor", "dim", "group"),
    (attention_dispatch, "_native_attention_forward_op"): (
        "ctx", "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "return_lse",
        "_save_ctx", "_parallel_config"),
    (cache.first_block_cache.FBCHeadBlockHook, "_should_compute_remaining_blocks"): (
        "self", "hidden_states_residual"),
    (cache.taylorseer_cache.TaylorSeerCacheHook, "_measure_should_compute"): ("self",),
    (Flux2Modulation, "split"): ("mod", "mod_param_sets"),
    (transformer_qwenimage.QwenImageTransformerBlock, "_modulate"): ("self", "x", "mod_params", "index"),
}

#: Internals the pipeline adapters read to find the largest size a model can make (`PipelineAdapter.size_limits`):
#: the stock pipelines' own timestep-shift functions and the Qwen rotary tables; and torch's inductor switches the
#: compile benchmark flips. Imported on first use through `internal`: the pipeline modules import whole text-encoder
#: families.
LAZY_PRIVATE_NAMES = (
    ("diffusers.pipelines.flux.pipeline_flux", "calculate_shift"),
    ("diffusers.pipelines.qwenimage.pipeline_qwenimage", "calculate_shift"),
    ("diffusers.pipelines.qwenimage21.pipeline_qwenimage21", "calculate_shift"),
    ("diffusers.pipelines.flux2.pipeline_flux2", "compute_empirical_mu"),
    ("diffusers.models.transformers.transformer_qwenimage", "QwenEmbedRope"),
    ("diffusers.models.transformers.transformer_qwenimage21", "QwenImage21Rope"),
    ("torch._inductor.config", "force_disable_caches"),  # tools/bench/compile.py
)


def internal(module: str, name: str):
    """The internal `module.name`, which must be listed in `LAZY_PRIVATE_NAMES` (so the list stays true)."""
    if (module, name) not in LAZY_PRIVATE_NAMES:
        raise KeyError(f"{module}.{name} is not in compat.privates.LAZY_PRIVATE_NAMES: list it there and in "
                       "docs/architecture.md before reading it.")
    return getattr(importlib.import_module(module), name)


#: diffusers' own functions, as they were before `install` replaced them, keyed by (owner, name).
STOCK: dict[tuple[object, str], object] = {}


def _unbound(owner, name: str):
    raw = inspect.getattr_static(owner, name)
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw


def stock(owner, name: str):
    """diffusers' own `owner.name`: the one `install` replaced, else the current attribute (not installed yet)."""
    return STOCK[(owner, name)] if (owner, name) in STOCK else _unbound(owner, name)


class StockCall:
    # Calls diffusers' own `owner.name`, looked up in `STOCK` at each call (a wrapper never holds a stale reference);
    # `__wrapped__` (the current stock function) keeps `inspect.signature` of a wrapper around it stock's.
    __slots__ = ("key",)

    def __init__(self, owner, name: str):
        self.key = (owner, name)

    def __call__(self, *args, **kwargs):
        return STOCK[self.key](*args, **kwargs)

    @property
    def __wrapped__(self):
        return STOCK[self.key]

    @property
    def __name__(self):
        return self.key[1]


def keep_stock(owner, name: str) -> StockCall:
    """Remember diffusers' own `owner.name` (once: a second install keeps the first); return its late-bound caller."""
    STOCK.setdefault((owner, name), _unbound(owner, name))
    return StockCall(owner, name)
