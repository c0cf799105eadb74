"""`from_pretrained(quantization_config=..., parallel_config=...)` (gap 18 of `compat/__init__.py`).

diffusers 0.42 refuses a `quantization_config` with a tensor-parallel `parallel_config` (`_check_tp_supported`):
torchao packs whole weights, which cannot be sharded into DTensors, and torchao's scales of a shard would come from
that shard alone. We take the config off the call instead: the scheme it maps to (`parallel/quantize_config.py`) is
checked on the meta-device model (every quantized input piece per rank a multiple of the block) before any weight is
read, stock loads each rank's slice unquantized, and each rank then quantizes its own shards with the scales one
process uses (`parallel/quantize.py`). Without a `parallel_config` a diffusers config goes to stock (torchao's own
path); the package's own `Quantization` is taken here with or without one, so one process gets the same scheme.
"""

from __future__ import annotations

import functools

import torch
from diffusers.hooks import tensor_parallel

from ..parallel import quantize, quantize_config
from . import context, plans


def _tp_degree(parallel_config) -> int:
    tp_config = context.split(parallel_config)[2] if parallel_config is not None else None
    return 1 if tp_config is None else tensor_parallel._tp_degree(tp_config)


def _checked_names(cls, path, kwargs: dict, scheme, skip) -> tuple[str, ...]:
    """The Linears to quantize, checked against the TP degree on the meta-device model (no weight read)."""
    hub = {k: kwargs[k] for k in context.HUB_KWARGS if k in kwargs}
    config = cls.load_config(path, **hub)
    if config.get("quantization_config") is not None:
        raise ValueError(f"{path} holds a pre-quantized checkpoint (its config has a quantization_config): it cannot "
                         "be sharded per rank. Load an unquantized checkpoint and pass quantization_config= to "
                         "quantize each rank's shard.")
    with torch.device("meta"):
        meta = cls.from_config(config)
    names = quantize_config.selected(meta, skip)
    return tuple(quantize.check(meta, plans.tp_plan_of(cls), _tp_degree(kwargs.get("parallel_config")), scheme,
                                names))


def wrap_from_pretrained(stock):
    """`context`'s `from_pretrained` (CP next to TP), taught quantization under a `parallel_config` (gap 18)."""
    inner = context.wrap_from_pretrained(stock)

    @functools.wraps(stock)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        config = kwargs.get("quantization_config")
        if config is None or (kwargs.get("parallel_config") is None and not quantize_config.is_ours(config)):
            return inner(cls, pretrained_model_name_or_path, *args, **kwargs)
        scheme, skip = quantize_config.scheme_of(config)
        names = _checked_names(cls, pretrained_model_name_or_path, kwargs, scheme, skip)
        result = inner(cls, pretrained_model_name_or_path, *args, **{**kwargs, "quantization_config": None})
        model = result[0] if isinstance(result, tuple) else result
        quantize.quantize_model(model, scheme, patterns=names)
        return result

    return from_pretrained
