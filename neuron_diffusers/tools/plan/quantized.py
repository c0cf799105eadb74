"""Per-rank transformer bytes under a quantization scheme (`plan report --quantize`, `bench memory --quantize`).

Counted on the meta-device model with the loader's own shard specs (`sharding.py`) and the Linears the scheme
selects (`parallel/quantize_config.selected`, what `from_pretrained(quantization_config=...)` and `load_pipeline(
quantize=...)` quantize): a quantized weight holds 1 byte per element (fp8 or int8) plus one float32 scale per output
row and block of `block` input columns (4 / block bytes per element); every other parameter (biases, norms,
embedders, the final projection, whatever the family keeps unquantized) stays bf16. The block is checked against
the degree first (`parallel/quantize.check`): a scheme a load would refuse is refused here too.
"""

from __future__ import annotations

import torch

from ...parallel import quantize, quantize_config
from .sharding import BF16_BYTES, GIB, param_group, sharded_names

QUANTIZED_BYTES = 1
SCALE_BYTES = 4


def quantized_bytes(model: torch.nn.Module, plan: dict | None, tp: int, scheme, top: int = 8) -> dict:
    """Per-rank bytes of `model` at degree `tp` under `plan`, quantized by `scheme` ("fp8", "int8:64", ...) and in
    bf16, with the largest groups of parameters left unquantized (what keeps the ratio above 0.5)."""
    scheme = quantize.Quantization.of(scheme)
    names = quantize.check(model, plan, tp, scheme, quantize_config.selected(model))
    weights = {f"{name}.weight" for name in names}
    sharded = sharded_names(model, plan, tp) if tp > 1 and plan else set()
    quantized, kept, groups = 0, 0, {}
    for name, param in model.named_parameters():
        local = param.numel() // tp if name in sharded else param.numel()
        if name in weights:
            quantized += local
        else:
            kept += local
            groups[param_group(name)] = groups.get(param_group(name), 0) + local
    scales = quantized // scheme.block * SCALE_BYTES
    total = quantized * QUANTIZED_BYTES + scales + kept * BF16_BYTES
    bf16 = (quantized + kept) * BF16_BYTES
    largest = sorted(groups.items(), key=lambda item: (-item[1], item[0]))[:top]
    return {
        "quantize": str(scheme),
        "tp": tp,
        "quantized_linears": len(names),
        "per_rank_quantized_params": quantized,
        "per_rank_unquantized_params": kept,
        "per_rank_scale_bytes": scales,
        "per_rank_bytes_quantized": total,
        "per_rank_gib_quantized": total / GIB,
        "per_rank_bytes_bf16": bf16,
        "ratio_to_bf16": total / bf16,
        "unquantized_share": kept / (quantized + kept),
        "largest_unquantized": [{"module": module, "params": n, "share": n / (quantized + kept)}
                                for module, n in largest],
    }


def format_quantized(row: dict) -> str:
    """The lines `plan report --quantize` appends to its table."""
    lines = [
        f"  quantize={row['quantize']}: {row['per_rank_gib_quantized']:.2f} GiB per rank "
        f"({row['ratio_to_bf16']:.3f}x of bf16; scales {row['per_rank_scale_bytes'] / GIB:.3f} GiB), "
        f"{row['quantized_linears']} Linears quantized, {row['unquantized_share']:.1%} of the rank's parameters kept "
        "in bf16:",
    ]
    lines += [f"    {r['module']:<50} {r['params']:>14,} {r['share']:>7.2%}" for r in row["largest_unquantized"]]
    return "\n".join(lines)
