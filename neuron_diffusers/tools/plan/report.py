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

`--plan` picks the plan reported (`default`, `lean`, `stock`: `parallel/plan_variants.py`); every report also lists
each plan the family has at the same degree, memory and collectives side by side, which is where a default that trades
memory for speed shows what it trades.

`plan report --cores N` reports layouts instead (`layout_report.py`): every (dp, cfg, ring, ulysses, tp) of N
ranks with its weights, FLOPs and bytes per rank and step.
"""

from __future__ import annotations

import argparse
import json

import torch

from ...cli import positive_int
from ...parallel.plan_variants import VARIANTS, variant_plan
from ...parallel.rules import collectives_per_forward
from .layout_report import DEFAULT_SIZE, format_layouts, layouts_report
from .profiles import PROFILES
from .quantized import format_quantized, quantized_bytes
from .sharding import (
    BF16_BYTES,
    GIB,
    held_params,
    param_group,
    planned_model,
    sharded_names,
    valid_tp_degrees,
)


def _replicated(model: torch.nn.Module, sharded: set, total: int) -> list[dict]:
    groups: dict[str, int] = {}
    for name, param in model.named_parameters():
        if name not in sharded:
            groups[param_group(name)] = groups.get(param_group(name), 0) + param.numel()
    rows = [{"module": module, "params": n, "share": n / total} for module, n in groups.items()]
    return sorted(rows, key=lambda row: (-row["params"], row["module"]))


def _variants(meta: torch.nn.Module, family, tp: int) -> list[dict]:
    """Per-rank GiB and collectives of every plan `family` has at degree `tp` (a plan that cannot: its reason)."""
    rows = []
    for name in VARIANTS:
        try:
            rules = variant_plan(family, name)
            calls = collectives_per_forward(meta, rules)
            gib = held_params(meta, sharded_names(meta, rules, tp), tp) * BF16_BYTES / GIB
        except ValueError as error:
            rows.append({"plan": name, "unavailable": str(error)})
            continue
        rows.append({"plan": name, "per_rank_gib_bf16": gib, "all_reduces_per_forward": calls["all_reduce"],
                     "all_gathers_per_forward": calls["all_gather"]})
    return rows


def plan_report(model: str, tp: int, plan: str = "default", quantize=None) -> dict:
    """Per-rank parameters, bf16 bytes, replicated modules and collectives of `plan` at degree `tp`; with
    `quantize` ("fp8", "int8", "fp8:64"), also the per-rank bytes under that scheme (`quantized.py`), under
    "quantized".

    `model` is a family name (its full-size default config) or a checkpoint folder (its
    `transformer/config.json`). Raises `ValueError` naming the valid degrees when `tp` does not
    split the model. Collectives assume each planned Linear runs once per forward (module docstring).
    """
    planned = planned_model(model)
    meta, family = planned.module, planned.family
    rules = variant_plan(family, plan)
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
    quantized = None if quantize is None else quantized_bytes(meta, rules, tp, quantize)
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
        "replicated_share": sum(row["params"] for row in replicated) / total,  # the share the docs quote
        "replicated": replicated,
        "all_reduces_per_forward": calls["all_reduce"],
        "all_gathers_per_forward": calls["all_gather"],
        "valid_tp_degrees": valid,
        "variants": _variants(meta, family, tp),
        **({} if quantized is None else {"quantized": quantized}),
    }


def human_params(count: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count:.0f}"


def _variant_line(row: dict) -> str:
    if "unavailable" in row:  # the reason's first clause: "FLUX.1 has no 'lean' plan"
        return f"  {row['plan']:<10} {'-':>18} {'-':>12} {'-':>12}  ({row['unavailable'].split(':')[0]})"
    return (f"  {row['plan']:<10} {row['per_rank_gib_bf16']:>18.2f} {row['all_reduces_per_forward']:>12} "
            f"{row['all_gathers_per_forward']:>12}")


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
        f"  {'plans':<10} {'GiB bf16 per rank':>18} {'all-reduces':>12} {'all-gathers':>12}",
        *(_variant_line(row) for row in report["variants"]),
        "",
        f"  replicated on every rank: {human_params(report['replicated_params'])} params "
        f"({report['replicated_params'] / report['total_params']:.1%} of the model)",
    ]
    if "quantized" in report:
        lines += ["", format_quantized(report["quantized"])]
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


def image_size(value: str) -> tuple[int, int]:
    """An argparse type: `WIDTHxHEIGHT` in pixels."""
    width, x, height = value.lower().partition("x")
    if not (x and width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, e.g. 1344x768, got '{value}'")
    return int(width), int(height)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="family name (full-size default config) or checkpoint folder (its transformer config)")
    degree = parser.add_mutually_exclusive_group(required=True)
    degree.add_argument("--tp", type=positive_int, help="tensor-parallel degree: memory and collectives of the plan")
    degree.add_argument("--cores", type=positive_int,
                        help="ranks: every valid (dp, cfg, ring, ulysses, tp) layout with its per-rank costs")
    parser.add_argument("--plan", choices=VARIANTS, default="default",
                        help="the plan to report: our default, our lean one (where a family has one) or diffusers' "
                             "own; every report also lists each plan's memory and collectives")
    parser.add_argument("--size", type=image_size, help="with --cores: WIDTHxHEIGHT of the image or video "
                                                        "(default 1024x1024; MiniMax-H3 videos have 124 frames)")
    parser.add_argument("--true-cfg", action="store_true",
                        help="with --cores: a call with true classifier-free guidance (two forwards per step)")
    parser.add_argument("--profile", choices=sorted(PROFILES),
                        help="with --cores: estimate the step time on this hardware (figures and sources: "
                             "docs/layouts.md)")
    parser.add_argument("--nodes", type=positive_int, default=1,
                        help="with --cores: the cores are this many nodes; shows which collectives cross them")
    parser.add_argument("--quantize", default=None, metavar="KIND[:BLOCK]",
                        help="with --tp: also the per-rank bytes with the blocks' Linears in fp8 or int8 (scales "
                             "counted; docs/quantization.md)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def main(args: argparse.Namespace) -> None:
    if args.cores is None:
        extra = [flag for flag, value in (("--size", args.size), ("--true-cfg", args.true_cfg),
                                          ("--profile", args.profile), ("--nodes", args.nodes != 1)) if value]
        if extra:
            raise ValueError(f"{', '.join(extra)} only apply to layouts: pass --cores N instead of --tp.")
        report = plan_report(args.model, args.tp, args.plan, args.quantize)
        print(json.dumps(report) if args.json else format_report(report))
        return
    if args.quantize is not None:
        raise ValueError("--quantize applies to one degree's memory: pass --tp N instead of --cores.")
    report = layouts_report(args.model, args.cores, args.size or DEFAULT_SIZE, plan=args.plan,
                            true_cfg=args.true_cfg, hardware=args.profile, nodes=args.nodes)
    print(json.dumps(report) if args.json else format_layouts(report))
