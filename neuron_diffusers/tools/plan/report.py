"""What a tensor-parallel plan costs each rank: parameters held, and collectives per forward.

A plan is worth what it shards: a rank can never hold less than `total / tp`, and every Linear a
plan leaves replicated sits whole on every rank. The report measures this on the real module tree
built on the `meta` device (shapes only: no weight is read or allocated, a 60 GiB model takes a
second) with diffusers' own `resolve_tp_shard_specs`, the function the loader uses to stream each
rank's slice, so the figures are exactly what a load would place on a rank, never hand-maintained.

Collective counts are static: each rowwise / `PackedRowwiseParallel` Linear costs one all-reduce
per call; `PartialRowwiseParallel` Linears cost one all-reduce per block for each `reduced_at`;
each `GatheredColwiseParallel` Linear one all-gather per call, except hoisted ones: one all-gather
per `hoist_from` module. **Every planned Linear (and hoist source) is assumed to run once per
transformer forward** (true of the five supported transformers, whose forward visits each block
once). `bench collectives` checks these counts at run time.
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from ...cli import positive_int
from ...distributed import divisors
from ...families import Family
from ...parallel.patches import shard_specs, stock_plan
from ...parallel.rules import collectives_per_forward
from .meta import MetaModel, meta_transformer

PLANS = ("ours", "stock")
BF16_BYTES = 2
GIB = 2**30


def planned_model(model: str) -> MetaModel:
    """`meta_transformer(model)`, refused unless one of our families plans its class."""
    meta = meta_transformer(model)
    if meta.family is None:
        raise ValueError(f"{model} has a {type(meta.module).__name__} transformer, which has no tensor-parallel plan "
                         f"here. Plan one first (docs/authoring.md), or use `plan check` with a plan file.")
    return meta


def plan_dict(family: Family, plan: str) -> dict:
    """The plan named `plan` ("ours" or "stock") for `family`'s transformer."""
    if plan not in PLANS:
        raise ValueError(f"Unknown plan '{plan}': choose one of {', '.join(PLANS)}.")
    if plan == "ours":
        return family.plan
    stock = stock_plan(family.model_class())
    if stock is None:
        raise ValueError(f"diffusers ships no tensor-parallel plan for {family.model_class_name} ({family.name}): "
                         "stock loads the full model on every rank. Use --plan ours.")
    return stock


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
    heads = model.config.num_attention_heads
    valid = [1]
    for degree in divisors(heads)[1:]:
        try:
            shard_specs(model, plan, degree)
        except ValueError:
            continue
        valid.append(degree)
    return valid


def param_group(param_name: str) -> str:
    """`transformer_blocks.3.norm1.linear.weight` -> `transformer_blocks.*.norm1.linear` (first index = the block)."""
    module_path = param_name.rpartition(".")[0] or param_name
    return re.sub(r"\.\d+(?=\.|$)", ".*", module_path, count=1)


def _replicated(model: torch.nn.Module, sharded: set, total: int) -> list[dict]:
    groups: dict[str, int] = {}
    for name, param in model.named_parameters():
        if name not in sharded:
            groups[param_group(name)] = groups.get(param_group(name), 0) + param.numel()
    rows = [{"module": module, "params": n, "share": n / total} for module, n in groups.items()]
    return sorted(rows, key=lambda row: (-row["params"], row["module"]))


def plan_report(model: str, tp: int, plan: str = "ours") -> dict:
    """Per-rank parameters, bf16 bytes, replicated modules and collectives of `plan` at degree `tp`.

    `model` is a family name (its full-size default config) or a checkpoint folder (its
    `transformer/config.json`). Raises `ValueError` naming the valid degrees when `tp` does not
    split the model. Collectives assume each planned Linear runs once per forward (module docstring).
    """
    planned = planned_model(model)
    meta, family = planned.module, planned.family
    rules = plan_dict(family, plan)
    valid = valid_tp_degrees(meta, rules)
    if tp not in valid:
        raise ValueError(
            f"A tensor-parallel degree of {tp} cannot shard {type(meta).__name__} ({model}) with the '{plan}' plan: "
            f"each rank needs whole attention heads ({meta.config.num_attention_heads}) and an even slice of every "
            f"sharded block. Valid degrees: {valid}."
        )
    total = sum(p.numel() for p in meta.parameters())
    sharded = sharded_names(meta, rules, tp)
    per_rank = held_params(meta, sharded, tp)
    replicated = _replicated(meta, sharded, total)
    calls = collectives_per_forward(meta, rules)
    return {
        "model": str(model),
        "family": family.name,
        "model_class": type(meta).__name__,
        "config": planned.config,
        "tp": tp,
        "plan": plan,
        "total_params": total,
        "per_rank_params": per_rank,
        "limit_params": total / tp,
        "total_gib_bf16": total * BF16_BYTES / GIB,
        "per_rank_bytes_bf16": per_rank * BF16_BYTES,
        "per_rank_gib_bf16": per_rank * BF16_BYTES / GIB,
        "limit_gib_bf16": total * BF16_BYTES / tp / GIB,
        "ratio_to_limit": per_rank * tp / total,
        "replicated_params": sum(row["params"] for row in replicated),
        "replicated": replicated,
        "all_reduces_per_forward": calls["all_reduce"],
        "all_gathers_per_forward": calls["all_gather"],
        "valid_tp_degrees": valid,
    }


def human_params(count: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count:.0f}"


def format_report(report: dict, top: int = 12) -> str:
    """A readable table of `plan_report`'s result; the `top` largest replicated groups are listed."""
    tp = report["tp"]
    rows = [
        ("total", report["total_params"], report["total_gib_bf16"]),
        ("per rank", report["per_rank_params"], report["per_rank_gib_bf16"]),
        (f"limit (total / {tp})", report["limit_params"], report["limit_gib_bf16"]),
    ]
    lines = [
        f"{report['model_class']} ({report['model']}, {report['config']} config): {report['plan']} plan, TP={tp}",
        "",
        f"  {'':<20} {'params':>10} {'GiB bf16':>10}",
        *(f"  {label:<20} {human_params(n):>10} {gib:>10.2f}" for label, n, gib in rows),
        f"  {'per rank / limit':<20} {report['ratio_to_limit']:>10.3f}x",
        "",
        f"  collectives per forward: {report['all_reduces_per_forward']} all-reduces, "
        f"{report['all_gathers_per_forward']} all-gathers (each planned Linear and hoist source called once)",
        f"  valid TP degrees: {', '.join(map(str, report['valid_tp_degrees']))}",
        "",
        f"  replicated on every rank: {human_params(report['replicated_params'])} params "
        f"({report['replicated_params'] / report['total_params']:.1%} of the model)",
    ]
    replicated = report["replicated"]
    if replicated:
        lines.append(f"  {'module':<52} {'params':>10} {'share':>7}")
        lines += [f"  {r['module']:<52} {human_params(r['params']):>10} {r['share']:>7.2%}" for r in replicated[:top]]
        rest = replicated[top:]
        if rest:
            rest_params = sum(r["params"] for r in rest)
            lines.append(f"  {f'... {len(rest)} more':<52} {human_params(rest_params):>10} "
                         f"{rest_params / report['total_params']:>7.2%}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="family name (full-size default config) or checkpoint folder (its transformer config)")
    parser.add_argument("--tp", type=positive_int, required=True, help="tensor-parallel degree")
    parser.add_argument("--plan", choices=PLANS, default="ours")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def main(args: argparse.Namespace) -> None:
    report = plan_report(args.model, args.tp, args.plan)
    print(json.dumps(report) if args.json else format_report(report))
