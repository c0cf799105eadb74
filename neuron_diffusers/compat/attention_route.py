"""Context parallelism for attention processors that bypass diffusers' dispatch: their SDPA call routed through it.

diffusers splits a sequence across ranks (Ulysses, ring) inside `dispatch_attention_fn`, which reads the
`_parallel_config` that `enable_parallelism` sets on each processor that has one. Many processors (the
`attention_processor.py` family: `AttnProcessor2_0`, `JointAttnProcessor2_0`, CogVideoX's, HunyuanDiT's...) call
`torch.nn.functional.scaled_dot_product_attention` themselves, so their model cannot be context-parallel: each rank
would attend over its own slice only. `route_attention` wraps each such processor, unchanged, in one that has a
`_parallel_config`; while that is set, the processor's own SDPA calls go to `dispatch_attention_fn` with the
same arguments (a torch function mode: the layout `[batch, heads, tokens, dim]` transposed to dispatch's and back),
so the math is the processor's own and only the attention op is split. A processor that never calls SDPA (linear
attention, explicit softmax) raises instead of silently attending locally. Without a parallel config the wrapper
calls the processor directly: one process runs exactly as stock.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from diffusers.models import attention_dispatch
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention, MochiAttention
from torch.overrides import TorchFunctionMode

#: diffusers' attention modules whose processor `enable_parallelism` hands the parallel config to.
ATTENTION_CLASSES = (Attention, MochiAttention, AttentionModuleMixin)
#: Read here: dispatch (public function, private module) and the processor attributes `enable_parallelism` sets.
PRIVATE_NAMES = ((attention_dispatch, "dispatch_attention_fn"),)


def _head_free_mask(mask, heads: int):
    """A mask without a per-head dim (Ulysses hands each rank a subset of heads): `[b, h, q, k]` whose heads all
    agree becomes `[b, 1, q, k]`; one that differs per head cannot follow the heads and is refused."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] == 1:
        return mask
    first = mask[:, :1]
    if mask.shape[1] != heads or not torch.equal(mask, first.expand_as(mask)):
        raise ValueError(f"an attention mask of shape {tuple(mask.shape)} differs per head; context parallelism "
                         "splits the heads across ranks, so it cannot be routed through diffusers' dispatch")
    return first


class _SdpaToDispatch(TorchFunctionMode):
    """`F.scaled_dot_product_attention(q, k, v, ...)` on `[b, h, s, d]` -> `dispatch_attention_fn` on `[b, s, h, d]`."""

    def __init__(self, parallel_config, backend):
        super().__init__()
        self.parallel_config, self.backend, self.calls = parallel_config, backend, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        bound = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args, strict=False))
        bound.update(kwargs)
        query, key, value = bound.pop("query"), bound.pop("key"), bound.pop("value")
        if query.dim() != 4:
            raise ValueError(f"scaled_dot_product_attention on {query.dim()}-D tensors cannot be routed through "
                             "diffusers' dispatch (it takes [batch, heads, tokens, dim])")
        bound["attn_mask"] = _head_free_mask(bound.get("attn_mask"), query.shape[1])
        self.calls += 1
        out = attention_dispatch.dispatch_attention_fn(
            *(x.transpose(1, 2) for x in (query, key, value)), **bound, backend=self.backend,
            parallel_config=self.parallel_config)
        return out.transpose(1, 2)


class _Routed:
    """A processor wrapped so `enable_parallelism` gives it the parallel config (see the module docstring)."""

    _parallel_config = None
    _attention_backend = None

    def __init__(self, processor):
        self.processor = processor

    def _call(self, attn, *args, **kwargs):
        if self._parallel_config is None:
            return self.processor(attn, *args, **kwargs)
        mode = _SdpaToDispatch(self._parallel_config, self._attention_backend)
        with mode:
            out = self.processor(attn, *args, **kwargs)
        if not mode.calls:
            raise ValueError(f"{type(self.processor).__name__} computes attention without "
                             "scaled_dot_product_attention, so context parallelism cannot split it")
        return out


@functools.cache
def _routed_class(processor_class: type) -> type:
    """A `_Routed` subclass whose `__call__` has `processor_class.__call__`'s signature (diffusers' `Attention`
    drops the keyword arguments a processor's signature does not name)."""
    def __call__(self, attn, *args, **kwargs):
        return self._call(attn, *args, **kwargs)

    functools.update_wrapper(__call__, processor_class.__call__)
    return type(f"Dispatched{processor_class.__name__}", (_Routed,), {"__call__": __call__})


def is_routed(processor) -> bool:
    """Whether `processor` is one `route_attention` wrapped."""
    return isinstance(processor, _Routed)


def needs_route(module: torch.nn.Module) -> bool:
    """A diffusers attention module whose processor does not take a parallel config (it bypasses dispatch)."""
    processor = getattr(module, "processor", None)
    return isinstance(module, ATTENTION_CLASSES) and processor is not None and \
        not hasattr(processor, "_parallel_config")


def _split_region(model: torch.nn.Module, cp_plan: dict | None) -> list[torch.nn.Module]:
    """The top-level modules a CP plan splits inputs of (the whole model for a forward-input rule or no plan):
    attention outside them (a text refiner before the blocks) runs on whole sequences and must stay local."""
    roots = {key.split(".")[0] for key, rule in (cp_plan or {"": {}}).items() if isinstance(rule, dict)}
    return [model] if "" in roots else [getattr(model, root) for root in sorted(roots)]


def bypassing(model: torch.nn.Module, cp_plan: dict | None = None) -> list[torch.nn.Module]:
    """The attention modules in the region `cp_plan` splits whose processors bypass dispatch (on the meta device
    too: processors are set when a model is built)."""
    return [module for region in _split_region(model, cp_plan) for module in region.modules() if needs_route(module)]


def route_attention(model: torch.nn.Module, cp_plan: dict | None = None) -> int:
    """Wrap every processor that bypasses dispatch in the region `cp_plan` splits (before `enable_parallelism`);
    the number wrapped."""
    routed = bypassing(model, cp_plan)
    for module in routed:
        wrapped = _routed_class(type(module.processor))(module.processor)
        if hasattr(module, "set_processor"):
            module.set_processor(wrapped)
        else:
            module.processor = wrapped
    return len(routed)
