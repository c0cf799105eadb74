"""The one `install()`: rebinds diffusers' own functions to the wrappers of the other `compat` modules, once.

Each wrapper calls diffusers' function through `privates.StockCall` (looked up at each call), and is bound at every
name stock code looks it up by: modules that bound a function by name at their own import (`from x import f`) get
it rebound too (`ALSO_BOUND_IN`).
"""

from __future__ import annotations

import functools
import inspect

import diffusers
from diffusers import hooks
from diffusers.hooks import context_parallel, tensor_parallel, tensor_parallel_neuron
from diffusers.models import _modeling_parallel, attention_dispatch
from diffusers.models.modeling_utils import ModelMixin

from . import collectives, context, enable, privates, quantized, tp_loading

#: (owner, name, wrapper factory): each factory takes stock's function and returns ours.
WRAPPERS = (
    (tensor_parallel, "_check_tp_supported", tp_loading.wrap_check_tp_supported),
    (tensor_parallel, "resolve_tp_shard_specs", tp_loading.wrap_resolve_tp_shard_specs),
    (tensor_parallel, "_styles", functools.partial(tp_loading.wrap_style_dispatch, partition=True)),
    (tensor_parallel, "_hooks_only_styles", functools.partial(tp_loading.wrap_style_dispatch, partition=False)),
    (tensor_parallel, "apply_tensor_parallel", tp_loading.wrap_apply_tensor_parallel),
    (ModelMixin, "_resolve_parallel_config", context.wrap_resolve_parallel_config),
    (ModelMixin, "enable_parallelism", enable.wrap_enable_parallelism),
    (ModelMixin, "from_pretrained", quantized.wrap_from_pretrained),  # CP (`context`) and quantization
    (diffusers.ParallelConfig, "__post_init__", context.wrap_post_init),
    (attention_dispatch, "_native_attention_forward_op", collectives.wrap_native_forward_op),
    (_modeling_parallel, "gather_size_by_comm", collectives.wrap_gather_size_by_comm),
    (context_parallel, "_all_gather_anything", collectives.wrap_all_gather_anything),
)

#: Modules that bound a wrapped function by name at their import: (owner, name) -> where else to rebind it.
ALSO_BOUND_IN = {
    (tensor_parallel, "_hooks_only_styles"): (tensor_parallel_neuron,),  # the Neuron backend's own import
    (tensor_parallel, "apply_tensor_parallel"): (hooks,),
    (_modeling_parallel, "gather_size_by_comm"): (context_parallel, attention_dispatch),
}

_installed = False


def _bind(owner, name: str, factory) -> None:
    wrapper = factory(privates.keep_stock(owner, name))
    wrapper.__qualname__ = privates.stock(owner, name).__qualname__  # `StockCall` has none of its own
    if isinstance(inspect.getattr_static(owner, name), classmethod):
        wrapper = classmethod(wrapper)
    for target in (owner, *ALSO_BOUND_IN.get((owner, name), ())):
        setattr(target, name, wrapper)


def install() -> None:
    """Apply the extensions of `compat` once. Called by `import neuron_diffusers`; touches no device."""
    global _installed
    if _installed:
        return
    tp_loading.allow_cpu()
    for owner, name, factory in WRAPPERS:
        _bind(owner, name, factory)
    _installed = True
