"""fp8 and int8 weights under every parallelism: each rank quantizes its own shard, with the scales one process uses.

The scheme (docs/quantization.md says why): scales per block of `block` input columns, for each output row of a
weight (`1 x block` groups) and for each token of an activation (`1 x block` tiles). A block never straddles a shard
boundary (checked before any weight is read: every row-sharded piece's width is a multiple of `block`), so a rank's
blocks are exactly the blocks one process has, scaled alike, and nothing is reduced: no collective at load, none per
step. Column sharding splits output rows (whole rows, their own scales); row sharding splits the input dimension on
block boundaries; context parallelism splits tokens (per-token tiles). TP=2, TP=4 and one process then compute the
same products; only the float32 summation order of the blocks' partial sums differs, as in unquantized TP.

- `fp8`: float8_e4m3fn weights and dynamic float8 activations, multiplied block by block with `torch._scaled_mm`
  (row-wise scales: one per token and one per output row inside a block), accumulated in float32.
- `int8`: int8 weights (symmetric, per row and block), dequantized to the compute dtype at each call (weight-only).

Which Linears: a family's `QUANTIZE` rules (module-name patterns, in its plan file) or by default every Linear inside
the transformer's repeated blocks, AdaLN modulation included (27-39% of the weights; hoisted modulation keeps its
class and `coalesce` computes it through `hoisted_local`). Embeddings, norms, the final projection and `norm_out`
sit outside the blocks and stay in the model's dtype (together under 3% of each full-size family).
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..compat import plans as compat_plans
from ..compat import tp_loading
from . import blocks

KINDS = ("fp8", "int8")
DEFAULT_BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
INT8_MAX = 127.0
#: The smallest scale: an all-zero block quantizes to zeros instead of dividing by zero (the same on every layout).
_TINY = 1e-12


@dataclass(frozen=True)
class Quantization:
    """A quantization scheme: `kind` ("fp8" or "int8") and the `block` width (input columns per scale)."""

    kind: str
    block: int = DEFAULT_BLOCK

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"quantize={self.kind!r} is not a scheme: choose one of {', '.join(KINDS)} (optionally "
                             f"with a block width, e.g. 'fp8:64'), or None for unquantized weights.")
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"The quantization block must be a positive number of input columns, not {self.block!r} "
                             f"(default {DEFAULT_BLOCK}).")

    @classmethod
    def of(cls, value) -> Quantization | None:
        """None, a `Quantization`, or text: "fp8", "int8", "fp8:64" (kind:block)."""
        if value is None or isinstance(value, Quantization):
            return value
        if not isinstance(value, str):
            raise ValueError(f"quantize={value!r}: give 'fp8' or 'int8' (optionally ':BLOCK'), or None.")
        kind, _, block = value.partition(":")
        if block and not block.isdigit():
            raise ValueError(f"quantize={value!r}: the block after ':' must be a positive integer, e.g. 'fp8:64'.")
        return cls(kind, int(block) if block else DEFAULT_BLOCK)

    def __str__(self) -> str:
        return self.kind if self.block == DEFAULT_BLOCK else f"{self.kind}:{self.block}"


# -- which Linears --------------------------------------------------------------------------------------------------


def selected_linears(model: torch.nn.Module, patterns=None) -> list[str]:
    """The names of the Linears the scheme quantizes, the same on every layout (read from the module tree, never from
    the shards): `patterns` (fnmatch on module names), else every Linear inside the repeated blocks."""
    if patterns is not None:
        return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
                and any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    kinds = blocks.block_types_of(model, compat_plans.repeated_blocks(model))
    names = []
    for block_name, block in model.named_modules():
        if kinds and isinstance(block, kinds):
            names += [f"{block_name}.{path}" for path, module in block.named_modules()
                      if isinstance(module, torch.nn.Linear)]
    return list(dict.fromkeys(names))


def check(model: torch.nn.Module, plan: dict | None, tp: int, scheme: Quantization, patterns=None) -> list[str]:
    """Refuse a scheme whose blocks would straddle a shard at degree `tp` (works on a meta-device model: before any
    weight is read). Returns the selected Linears."""
    names = selected_linears(model, patterns)
    if not names:
        raise ValueError(f"quantize={scheme}: {type(model).__name__} has no Linear to quantize (no repeated block, "
                         "or the family's QUANTIZE rules match nothing).")
    specs = tp_loading.shard_specs(model, plan, tp, whole_plan=False) if tp > 1 and plan else {}
    for name in names:
        width = model.get_submodule(name).in_features
        spec = specs.get(f"{name}.weight")
        pieces = (spec.block_sizes or [width]) if spec is not None and spec.dim == 1 else [width * tp]
        bad = [p // tp for p in pieces if (p // tp) % scheme.block]
        if bad:
            largest = _largest_block([p // tp for p in pieces])
            raise ValueError(
                f"quantize={scheme}: {name} has input pieces of width {bad} per rank at tp={tp}, not multiples of "
                f"the block ({scheme.block}), so a block would straddle a shard and its scale would depend on the "
                f"layout. Use a block that divides them (the largest power of two that does: {largest}, e.g. "
                f"quantize='{scheme.kind}:{largest}'), or another tp.")
    return names


def check_launch_quantize(checkpoint, plan: dict | None, tp: int, value) -> Quantization | None:
    """`quantize=` of `load_pipeline`, `generate` and `serve`, checked before any weight is read (on the meta-device
    transformer, with the family's `QUANTIZE` rules): the scheme, or None. LoRAs fuse into quantized shards
    (`requantize_rows`), so they need no check here."""
    scheme = Quantization.of(value)
    if scheme is None:
        return None
    check(checkpoint.meta("transformer"), plan, tp, scheme, quantize_rules(checkpoint.family))
    return scheme


def quantize_rules(family) -> tuple[str, ...] | None:
    """A family's `QUANTIZE` module patterns (its plan file), or None for the default (the blocks' Linears)."""
    return getattr(getattr(family, "plan_module", None), "QUANTIZE", None)


def _largest_block(widths: list[int]) -> int:
    block = 1
    while all(w % (block * 2) == 0 for w in widths) and block * 2 <= DEFAULT_BLOCK:
        block *= 2
    return block


# -- the arithmetic -------------------------------------------------------------------------------------------------


def quantize_weight(weight: torch.Tensor, scheme: Quantization) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, scales `(blocks, out)` float32) of a local `(out, in)` weight, block by block."""
    out_features, width = weight.shape
    grouped = weight.detach().float().reshape(out_features, width // scheme.block, scheme.block)
    top = FP8_MAX if scheme.kind == "fp8" else INT8_MAX
    scale = grouped.abs().amax(-1).clamp(min=_TINY) / top
    scaled = (grouped / scale.unsqueeze(-1)).clamp(-top, top)
    data = scaled.to(FP8) if scheme.kind == "fp8" else scaled.round().to(torch.int8)
    return data.reshape(out_features, width), scale.t().contiguous()


def dequantize_weight(data: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The float32 weight a quantized one stands for (what int8 multiplies with, and what tests compare)."""
    out_features, width = data.shape
    grouped = data.float().reshape(out_features, width // block, block)
    return (grouped * scale.t().unsqueeze(-1)).reshape(out_features, width)


def fp8_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """`x @ W.T` in float32 with `x` quantized per token and block (dynamic) and `W` the fp8 `data` with its `scale`:
    one row-wise `torch._scaled_mm` per block, summed in float32 in block order. CUDA's row-wise kernel writes only
    bfloat16 (`f8f8bf16_rowwise`), so there each block's product is rounded to bfloat16 before the float32 sum (not
    run here: no GPU; the CPU path, float32 throughout, is the tested one)."""
    tokens, width = x.shape
    tiles = x.float().reshape(tokens, width // block, block)
    x_scale = tiles.abs().amax(-1).clamp(min=_TINY) / FP8_MAX
    x_data = (tiles / x_scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    product = torch.float32 if x.device.type == "cpu" else torch.bfloat16
    out = None
    for j in range(width // block):
        part = torch._scaled_mm(x_data[:, j].contiguous(), data[:, j * block:(j + 1) * block].t(),
                                scale_a=x_scale[:, j:j + 1].contiguous(), scale_b=scale[j:j + 1],
                                out_dtype=product).float()
        out = part if out is None else out + part
    return out


@torch.library.custom_op("neuron_diffusers::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """`fp8_linear` as one opaque op for `torch.compile`: traced inline, its loop unrolls into several ops per block,
    which made compiling tiny FLUX.1 several times slower (docs/quantization.md). As one node it runs the same code
    as eager, so compiled and eager give the same numbers; inductor calls it as an extern kernel."""
    return fp8_linear(x, data, scale, block)


@fp8_block_linear.register_fake
def _fp8_block_linear_shape(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], data.shape[0]), dtype=torch.float32)


def local_output(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A quantized Linear's product with this rank's local input, in the input's dtype, before any bias."""
    data = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
    flat = x.reshape(-1, x.shape[-1])
    if module.scheme.kind == "fp8":
        out = fp8_block_linear(flat, data.view(FP8), module.weight_scale, module.scheme.block)
    else:
        out = F.linear(flat.float(), dequantize_weight(data, module.weight_scale, module.scheme.block))
    return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def _hoisted_local(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A hoisted (column-sharded, gathered by `coalesce`) quantized Linear's local output, its bias shard added."""
    out = local_output(module, x)
    bias = module.bias
    return out if bias is None else out + (bias.to_local() if isinstance(bias, DTensor) else bias)


class QuantizedLinear(torch.nn.Linear):
    """A Linear whose (local) weight is quantized: `weight` keeps its layout (a DTensor stays one, with the quantized
    local shard: int8, or fp8's bytes as uint8), `weight_scale` holds this rank's scales. Its forward works on local
    tensors and hands the TP hooks the placement stock's `F.linear` on DTensors would give: column shard ->
    `Shard(-1)`, row shard -> `Partial()` (each rank adding `bias / tp`, as DTensor's rowwise does before the
    all-reduce)."""

    scheme: Quantization

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        out = local_output(self, x.to_local() if isinstance(x, DTensor) else x)
        if not isinstance(weight, DTensor):
            return out if bias is None else out + bias
        placement = _output_placement(weight)
        if bias is not None:
            local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
            out = out + (local_bias / weight.device_mesh.size() if isinstance(placement, Partial) else local_bias)
        return DTensor.from_local(out, weight.device_mesh, [placement], run_check=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quantize={self.scheme}"


def is_quantized(module: torch.nn.Module) -> bool:
    """Whether `quantize_model` quantized this Linear (a `QuantizedLinear`, or a hoisted one keeping its class)."""
    return isinstance(getattr(module, "scheme", None), Quantization)


def _output_placement(weight: DTensor):
    (placement,) = weight.placements
    if isinstance(placement, Shard):
        return Shard(-1) if placement.dim == 0 else Partial()
    return Replicate()


@torch.no_grad()
def quantize_model(model: torch.nn.Module, scheme: Quantization | str, plan: dict | None = None,
                   patterns=None) -> list[str]:
    """Quantize each selected Linear's local shard in place (after the plan was applied, or on one process); returns
    their names. Everything is checked (block widths of the actual shards) before any weight changes."""
    scheme = Quantization.of(scheme)
    plan = compat_plans.tp_plan_of(model) if plan is None else plan
    names = selected_linears(model, patterns)
    modules = [model.get_submodule(name) for name in names]
    for name, module in zip(names, modules, strict=True):
        local = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
        if is_quantized(module) or local.shape[1] % scheme.block:
            raise ValueError(f"quantize={scheme}: {name} is already quantized or its local input width "
                             f"{local.shape[1]} is not a multiple of the block {scheme.block}; nothing was changed.")
    for module in modules:
        _quantize_linear(module, scheme)
    return names


def _quantize_linear(module: torch.nn.Linear, scheme: Quantization) -> None:
    weight = module.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    data, scale = quantize_weight(local, scheme)
    # fp8 bytes are kept as uint8 (a free view): diffusers' `get_parameter_dtype` takes a module's first floating
    # parameter as its compute dtype (MiniMax-H3 casts its modulation input to it), which must stay the model's.
    data = data.view(torch.uint8) if scheme.kind == "fp8" else data
    if isinstance(weight, DTensor):
        data = DTensor.from_local(data, weight.device_mesh, weight.placements, run_check=False,
                                  shape=weight.shape, stride=weight.stride())
    module.weight = torch.nn.Parameter(data, requires_grad=False)
    module.register_buffer("weight_scale", scale)
    module.scheme, module.compute_dtype = scheme, local.dtype
    if hasattr(module, "_nd_hoist"):  # computed by `coalesce`'s hoist from its local shard: it reads these two
        module.hoisted_local = functools.partial(_hoisted_local, module)
    else:
        module.__class__ = QuantizedLinear


# -- LoRAs fused into quantized shards (`parallel/lora.py`) ---------------------------------------------------------


def quantized_local(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's stored quantized weight (fp8's bytes as uint8, or int8) and its scales `(blocks, out)`: the two
    tensors a LoRA rewrites in place (so compiled graphs keep them) and `set_loras([])` copies back."""
    weight = module.weight
    return (weight.to_local() if isinstance(weight, DTensor) else weight.data), module.weight_scale


@torch.no_grad()
def requantize_rows(module: torch.nn.Linear, start: int, stop: int, add) -> None:
    """Rows `start:stop` of a quantized Linear's local shard dequantized (to float64), `add(rows)` adding a LoRA's
    delta into them in place, then quantized again by the load's own rule (`quantize_weight`: per row and block) and
    written back in place. A row's new data and scales depend on that row's values only, and a rank's rows and blocks
    are one process's, so the fused shards are one process's fused weights, whatever the layout."""
    data, scale = quantized_local(module)
    scheme, rows = module.scheme, data[start:stop]
    stored = rows.view(FP8) if scheme.kind == "fp8" else rows
    weight = dequantize_weight(stored, scale[:, start:stop], scheme.block).double()
    add(weight)
    new_data, new_scale = quantize_weight(weight, scheme)
    rows.copy_(new_data.view(rows.dtype))
    scale[:, start:stop].copy_(new_scale)
