"""What a plan shards on a model: the helpers every plan tool shares (`plan report`, its layouts, `plan check`,
`plan verify`, `bench memory`).

All of it runs on meta-device models (`meta.py`) through diffusers' own `resolve_tp_shard_specs`
(`compat.tp_loading.shard_specs`), the function the loader streams each rank's slice with, so the figures are what a
load would place on a rank.
"""

from __future__ import annotations

import re

import torch

from ...compat.tp_loading import shard_specs
from ...distributed import divisors
from .meta import MetaModel, meta_transformer

BF16_BYTES = 2
GIB = 2**30


def planned_model(model: str) -> MetaModel:
    """`meta_transformer(model)`, refused unless one of our families plans its class."""
    meta = meta_transformer(model)
    if meta.family is None:
        raise ValueError(f"{model} has a {type(meta.module).__name__} transformer, which has no tensor-parallel plan "
                         f"here. Plan one first (docs/authoring.md), or use `plan check` with a plan file.")
    return meta


def param_group(param_name: str) -> str:
    """`transformer_blocks.3.norm1.linear.weight` -> `transformer_blocks.*.norm1.linear` (first index = the block)."""
    module_path = param_name.rpartition(".")[0] or param_name
    return re.sub(r"\.\d+(?=\.|$)", ".*", module_path, count=1)


def sharded_names(model: torch.nn.Module, plan: dict | None, tp: int) -> set[str]:
    """Parameters `plan` splits across ranks (`None`: no plan; a rowwise bias has `dim=None`: replicated)."""
    specs = shard_specs(model, plan, tp) if plan else {}
    return {name for name, spec in specs.items() if spec.dim is not None}


def per_rank_params(model: torch.nn.Module, plan: dict | None, tp: int) -> int:
    """Parameters one rank holds under `plan` (`None`: no plan, the whole model on every rank)."""
    return held_params(model, sharded_names(model, plan, tp), tp)


def held_params(model: torch.nn.Module, sharded: set[str], tp: int) -> int:
    """Parameters one rank holds when the parameters named in `sharded` are split `tp` ways."""
    return sum(p.numel() // tp if name in sharded else p.numel() for name, p in model.named_parameters())


def valid_tp_degrees(model: torch.nn.Module, plan: dict) -> list[int]:
    """Degrees dividing the attention heads for which every sharded block splits evenly."""
    shard_specs(model, plan, 1)  # a plan that does not fit the model fails here, loudly
    return degrees_that_shard(model, plan, divisors(model.config.num_attention_heads)[1:])


def degrees_that_shard(model: torch.nn.Module, plan: dict, candidates) -> list[int]:
    """1, then each candidate degree for which the loader's own shard specs split every planned block evenly."""
    valid = [1]
    for degree in candidates:
        try:
            shard_specs(model, plan, degree)
        except ValueError:
            continue
        valid.append(degree)
    return valid
