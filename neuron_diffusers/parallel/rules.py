"""Plan rules expanded into the modules they name, once, for every reader of a plan.

A plan maps module-path globs to styles: `"transformer_blocks.*.attn.to_q": "colwise"`, where `*` stands for each
block of a ModuleList, or a plain path for a module of the model itself. Sharding (diffusers), coalescing
(`coalesce.py`), `plan check` and `plan report` all need the same answer to "which Linear does this rule name, in
which block", so `expand` is the one place that answers it, with the errors a user can act on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.hooks.tensor_parallel import PackedColwiseParallel, PackedRowwiseParallel

from ..tp_plans.styles import GatheredColwiseParallel, PartialRowwiseParallel, ShardedRMSNorm
from . import sharded_norm


@dataclass(frozen=True)
class Target:
    """One module a rule names: the block it sits in (the model itself for a rule without `*`) and its path there."""

    rule: str
    style: object
    block: torch.nn.Module
    #: "transformer_blocks.3", or "" when the rule names a module of the model itself.
    block_name: str
    #: The module's path relative to `block` ("attn.to_q"), or the whole rule for a rule without `*`.
    path: str
    module: torch.nn.Module

    @property
    def name(self) -> str:
        """The module's full path in the model."""
        return f"{self.block_name}.{self.path}" if self.block_name else self.path

    @property
    def container(self) -> str:
        """The ModuleList of blocks a `*` rule ranges over ("" for a rule without `*`)."""
        return self.block_name.rpartition(".")[0]


def expand_rule(model: torch.nn.Module, rule: str, style=None) -> list[Target]:
    """The modules `rule` names, one per block for a `*` rule; a `ValueError` says why a rule fits nothing."""
    prefix, star, suffix = rule.partition("*")
    try:
        if not star:
            return [Target(rule, style, model, "", rule, model.get_submodule(rule))]
        container_name = prefix.strip(".")
        container = model.get_submodule(container_name)
        if not isinstance(container, torch.nn.ModuleList):
            raise ValueError(
                f"Tensor-parallel plan rule '{rule}' puts '*' after '{container_name}' "
                f"({type(container).__name__}), which is not a ModuleList: '*' stands for a block's index. "
                "Point the prefix at the ModuleList of blocks, or drop the '*'."
            )
        path = suffix.strip(".")
        targets = []
        for index, block in enumerate(container):
            try:
                targets.append(Target(rule, style, block, f"{container_name}.{index}", path, block.get_submodule(path)))
            except AttributeError as error:
                if index == 0:
                    raise
                raise ValueError(
                    f"Tensor-parallel plan rule '{rule}' fits blocks 0 to {index - 1} but not block {index}: {error}. "
                    "A '*' rule applies to every block and cannot skip one, so leave this module, and the Linears "
                    "that feed it, out of the plan."
                ) from None
        return targets
    except AttributeError as error:
        raise ValueError(
            f"Tensor-parallel plan rule '{rule}' matches nothing in {type(model).__name__}: {error}. Fix the rule's "
            "module path (see `model.named_modules()`) or remove it."
        ) from None


def expand(model: torch.nn.Module, plan: dict) -> list[Target]:
    """Every module `plan` names, in plan order (sharding issues collectives in this order: it must not vary).

    Each must be an `nn.Linear` (an RMSNorm for `ShardedRMSNorm`): a rule naming anything else would silently shard
    nothing.
    """
    targets = []
    for rule, style in plan.items():
        matched = expand_rule(model, rule, style)
        if isinstance(style, ShardedRMSNorm):
            if not matched or not all(sharded_norm.supports(t.module) for t in matched):
                raise ValueError(
                    f"Tensor-parallel plan rule '{rule}' is ShardedRMSNorm(), which splits an RMSNorm over one "
                    f"dimension, but it matches {sorted({type(t.module).__name__ for t in matched}) or 'no module'} "
                    f"in {type(model).__name__}. Point it at the norm module (torch.nn.RMSNorm or diffusers' RMSNorm)."
                )
            targets += matched
            continue
        if not matched or not all(isinstance(t.module, torch.nn.Linear) for t in matched):
            raise ValueError(
                f"Tensor-parallel plan rule '{rule}' must match nn.Linear modules in {type(model).__name__}, got "
                f"{sorted({type(t.module).__name__ for t in matched}) or 'no module'}. Point it at the Linear itself."
            )
        targets += matched
    return targets


def style_kind(style) -> str | None:
    """What a plan style does to its Linear: `"colwise"` (output left split across the ranks, packed or not),
    `"rowwise"` (input split, output all-reduced, now or together with partners later), `"gathered"` (output
    all-gathered, alone or hoisted), `"norm"` (an RMSNorm over split features: one all-reduce), or None (not a
    style)."""
    if isinstance(style, ShardedRMSNorm):
        return "norm"
    if isinstance(style, GatheredColwiseParallel):
        return "gathered"
    if style == "colwise" or isinstance(style, PackedColwiseParallel):
        return "colwise"
    if style == "rowwise" or isinstance(style, (PackedRowwiseParallel, PartialRowwiseParallel)):
        return "rowwise"
    return None


def collective_groups(model: torch.nn.Module, plan: dict) -> list[tuple[str, list[Target]]]:
    """One `("all_reduce" | "all_gather", targets)` per collective a forward issues, in plan order, assuming every
    planned Linear runs once per forward.

    One per module a rule matches, except for the coalescing styles: partial sums share one all-reduce per block and
    reduction point, hoisted modulation one all-gather per hoist source. `targets` are the Linears whose outputs that
    one collective carries (several for the coalesced ones).
    """
    groups: dict[tuple, tuple[str, list[Target]]] = {}
    for index, target in enumerate(expand(model, plan)):
        kind = {"rowwise": "all_reduce", "norm": "all_reduce", "gathered": "all_gather"}.get(style_kind(target.style))
        if kind is None:
            continue
        hoisted = getattr(target.style, "hoist_from", None)
        reduced_at = getattr(target.style, "reduced_at", None)
        key = ("hoist", hoisted) if hoisted else ("reduce", target.block_name, reduced_at) if reduced_at else index
        groups.setdefault(key, (kind, []))[1].append(target)
    return list(groups.values())


def collectives_per_forward(model: torch.nn.Module, plan: dict) -> dict[str, int]:
    """All-reduces and all-gathers one forward issues (`collective_groups`, counted)."""
    counts = {"all_reduce": 0, "all_gather": 0}
    for kind, _ in collective_groups(model, plan):
        counts[kind] += 1
    return counts
