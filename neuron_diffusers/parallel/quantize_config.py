"""diffusers' `quantization_config` mapped onto the shard-safe scheme of `parallel/quantize.py`, for
`from_pretrained(quantization_config=..., parallel_config=...)` (`compat/quantized.py` calls it).

A torchao config names a kind and a granularity; the scheme always keeps `1 x block` scales (per output row and
block of input columns for weights, per token and block for activations), because only blocks that stop at shard
boundaries give every layout one process's scales without a collective (docs/quantization.md). So a config maps
only where its scales are those blocks or coarser blocks the scheme refines:

- `Float8DynamicActivationFloat8WeightConfig(granularity=[PerBlock([1, 128]), PerBlock([128, 128])])` -> fp8 with
  128-wide blocks: activations as asked (1 x 128 tiles), weights per row within each 128 x 128 block (finer).
- `Int8WeightOnlyConfig(granularity=PerGroup(g))` -> int8 with g-wide blocks: exactly torchao's groups.
- the package's own `Quantization` (or its text, "fp8:16") -> as given: any block width (tiny models need 16).

Everything else is refused before any weight is read, saying what, why and how to fix: per-tensor and per-row
scales (over a row-sharded Linear one process's scale spans every rank's part: one all-reduce MAX per Linear per
forward for activations), other float8 dtypes, activation clamps, other torchao configs.
"""

from __future__ import annotations

import torch

from .quantize import Quantization, selected_linears

#: Per transformer class: its family's `QUANTIZE` module patterns (None: the blocks' Linears), pushed by
#: `families.install` so that `from_pretrained` selects what `load_pipeline` selects.
_RULES: dict[type, tuple[str, ...] | None] = {}

_FIX_FP8 = ("TorchAoConfig(Float8DynamicActivationFloat8WeightConfig(granularity=[PerBlock([1, 128]), "
            "PerBlock([128, 128])]))")
_WHY_BLOCKS = ("the shard-safe scheme keeps 1 x block scales that stop at shard boundaries, so every rank "
               "quantizes its own shard with the scales one process would use and nothing is reduced; a per-tensor "
               "or per-row scale over a row-sharded Linear spans every rank's part of the row")


def register_rules(model_class: type, patterns: tuple[str, ...] | None) -> None:
    """Remember a family's `QUANTIZE` rules for its transformer class (None: the default selection)."""
    _RULES[model_class] = None if patterns is None else tuple(patterns)


def rules_of(model_class: type) -> tuple[str, ...] | None:
    """The registered `QUANTIZE` rules of a class (or of its nearest registered base), else None."""
    return next((_RULES[base] for base in model_class.__mro__ if base in _RULES), None)


def is_ours(config) -> bool:
    """Whether `config` is the package's own scheme (a `Quantization` or its text) rather than a diffusers config."""
    return isinstance(config, (Quantization, str))


def scheme_of(config) -> tuple[Quantization, tuple[str, ...]]:
    """(the scheme, the module names not to convert) for a `quantization_config`; `ValueError` (what, why, how to
    fix) for one the scheme cannot honour."""
    if is_ours(config):
        return Quantization.of(config), ()
    from diffusers import TorchAoConfig

    if not isinstance(config, TorchAoConfig):
        raise ValueError(
            f"quantization_config={type(config).__name__} cannot be combined with a `parallel_config`: only torchao's "
            f"float8 (dynamic activations) and int8 weight-only configs map onto the shard-safe scheme, where each "
            f"rank quantizes its own shard. Pass {_FIX_FP8}, TorchAoConfig(Int8WeightOnlyConfig(granularity="
            f"PerGroup(128))), or neuron_diffusers' Quantization('fp8', block).")
    skip = config.modules_to_not_convert or []
    return _torchao_scheme(config.quant_type), tuple(skip if isinstance(skip, list) else [skip])


def _torchao_scheme(quant_type) -> Quantization:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Int8WeightOnlyConfig, PerBlock, PerGroup

    name = type(quant_type).__name__
    if isinstance(quant_type, Int8WeightOnlyConfig):
        granularity = quant_type.granularity
        if not isinstance(granularity, PerGroup):
            raise ValueError(f"TorchAoConfig({name}(granularity={granularity})) with a `parallel_config`: "
                             f"{_WHY_BLOCKS}. Pass Int8WeightOnlyConfig(granularity=PerGroup(128)) (a group width "
                             f"that divides every rank's input pieces).")
        return Quantization("int8", granularity.group_size)
    if not isinstance(quant_type, Float8DynamicActivationFloat8WeightConfig):
        raise ValueError(f"TorchAoConfig({name}) cannot be combined with a `parallel_config`: the shard-safe scheme "
                         f"has float8 weights with dynamic float8 activations and int8 weight-only. Pass {_FIX_FP8} "
                         "or TorchAoConfig(Int8WeightOnlyConfig(granularity=PerGroup(128))).")
    _check_fp8(quant_type, name)
    activation, weight = quant_type.granularity
    if not (isinstance(activation, PerBlock) and isinstance(weight, PerBlock)):
        raise ValueError(f"TorchAoConfig({name}(granularity={list(quant_type.granularity)})) with a "
                         f"`parallel_config`: {_WHY_BLOCKS}, which would need one all-reduce MAX per such Linear per "
                         f"forward for the activations. Pass {_FIX_FP8}.")
    return Quantization("fp8", list(activation.block_size)[-1])


def _check_fp8(quant_type, name: str) -> None:
    dtypes = {quant_type.activation_dtype, quant_type.weight_dtype}
    if dtypes != {torch.float8_e4m3fn}:
        raise ValueError(f"TorchAoConfig({name}) with {sorted(map(str, dtypes))}: the shard-safe fp8 scheme keeps "
                         "float8_e4m3fn weights and activations only. Leave activation_dtype and weight_dtype at "
                         "torch.float8_e4m3fn.")
    bounds = (quant_type.activation_value_lb, quant_type.activation_value_ub)
    if bounds != (None, None):
        raise ValueError(f"TorchAoConfig({name}(activation_value_lb={bounds[0]}, activation_value_ub={bounds[1]})): "
                         "the shard-safe scheme scales each activation tile by its own maximum and clamps nothing. "
                         "Leave both bounds None.")


def selected(model: torch.nn.Module, skip=()) -> tuple[str, ...]:
    """The Linears `from_pretrained` quantizes: the family's rules (or the blocks' Linears), less `skip` and the
    class's `_keep_in_fp32_modules`, matched on parameter names as diffusers' torchao quantizer matches them."""
    skip = (*skip, *(getattr(type(model), "_keep_in_fp32_modules", None) or ()))
    return tuple(name for name in selected_linears(model, rules_of(type(model)))
                 if not any(f"{key}." in f"{name}.weight" or key == f"{name}.weight" for key in skip))
