"""Per-rank weight memory of every family at TP 1/2/4/8, our plans vs stock, against the total/N limit.

`neuron-diffusers bench memory [--out DIR]` prints a markdown table and writes `memory.json` (the rows, under
`record.metadata`'s header: command, date, machine, versions), `memory.md` and `memory.png` into DIR. Every figure is
measured by `plan report` on the full-size default configs built on the `meta` device, so the run
takes seconds on a laptop and nothing in it is hand-maintained. MiniMax-H3 has no stock plan:
stock loads the full model on every rank, so its stock per-rank figure is the total. "ours" is a family's leanest
plan: its default, or its `lean` plan where it has one (Qwen-Image-2.1, whose default is stock's plan).

`--quantize fp8` (or int8, KIND:BLOCK) adds each row's per-rank bytes with our plan's blocks' Linears quantized
(scales counted: `plan/quantized.py`) and their ratio to bf16, and writes `memory_fp8.json` / `memory_fp8.md`
instead.

`--rss` runs the other benchmark instead: peak RSS of a real tensor-parallel load and of fusing a LoRA into its
shards (`rss.py`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ... import families
from ...compat.plans import stock_plan
from ...parallel.quantize import Quantization
from ..plan.meta import meta_transformer
from ..plan.quantized import quantized_bytes
from ..plan.sharding import BF16_BYTES, GIB, per_rank_params
from . import plot, record, rss

DEGREES = (1, 2, 4, 8)
ALL_FAMILIES = tuple(family.name for family in families.FAMILIES)


def _gib(params: float) -> float:
    return params * BF16_BYTES / GIB


def measure(names=ALL_FAMILIES, degrees=DEGREES, quantize=None) -> list[dict]:
    """One row per (family, degree): total, limit, stock and our per-rank GiB in bf16 (and with `quantize`, ours
    quantized: `ours_quantized_gib`, its ratio to ours in bf16, the bf16 share left).

    A degree a plan cannot split evenly gets `None` for that plan (none of the defaults hit this).
    """
    rows = []
    for name in names:
        family = families.get(name)
        model = meta_transformer(name).module
        total = sum(p.numel() for p in model.parameters())
        ours_plan = "lean" if "lean" in family.plan_variants else "default"
        ours, stock = family.plan_variants[ours_plan], stock_plan(family.model_class())
        for tp in degrees:
            row = {"family": name, "name": family.display_name, "model_class": type(model).__name__, "tp": tp,
                   "total_gib": _gib(total), "limit_gib": _gib(total / tp), "stock_has_plan": stock is not None,
                   "ours_plan": ours_plan}
            for label, plan in (("stock", stock), ("ours", ours)):
                try:
                    row[f"{label}_gib"] = _gib(per_rank_params(model, plan, tp))
                except ValueError:
                    row[f"{label}_gib"] = None
                gib = row[f"{label}_gib"]
                row[f"{label}_ratio"] = None if gib is None else gib / row["limit_gib"]  # the table's "(1.28x)"
            if quantize is not None:
                row.update(_quantized(model, ours, tp, quantize))
            rows.append(row)
    return rows


def _quantized(model, plan, tp: int, quantize) -> dict:
    """Ours quantized at `tp`; a block that would straddle a shard there (a load refuses it) gets None and why."""
    try:
        found = quantized_bytes(model, plan, tp, quantize)
    except ValueError as error:
        return {"quantize": str(Quantization.of(quantize)), "ours_quantized_gib": None,
                "ours_quantized_ratio_to_bf16": None, "ours_unquantized_share": None, "quantized_refused": str(error)}
    return {"quantize": found["quantize"], "ours_quantized_gib": found["per_rank_gib_quantized"],
            "ours_quantized_ratio_to_bf16": found["ratio_to_bf16"],
            "ours_unquantized_share": found["unquantized_share"]}


def _quantized_cell(row: dict) -> str:
    if row["ours_quantized_gib"] is None:  # the refusal's own advice: "the largest power of two that does: 64"
        return "refused: block " + row["quantized_refused"].partition("that does: ")[2].partition(",")[0] + " fits"
    return f"{row['ours_quantized_gib']:.2f} ({row['ours_quantized_ratio_to_bf16']:.3f}x)"


def _cell(gib: float | None, limit: float) -> str:
    return "n/a" if gib is None else f"{gib:.2f} ({gib / limit:.2f}x)"


def markdown(rows: list[dict]) -> str:
    """The table `memory.md` holds: per-rank GiB (bf16) and its ratio to total/N."""
    kind = rows[0].get("quantize") if rows else None
    extra = ("", "") if kind is None else (f" ours {kind} per rank (GiB, x of ours bf16) |", "---:|")
    lines = [
        "| Model | TP | total/N limit (GiB) | stock per rank (GiB) | ours per rank (GiB) |" + extra[0],
        "|---|---:|---:|---:|---:|" + extra[1],
    ]
    for row in rows:
        stock = _cell(row["stock_gib"], row["limit_gib"]) + ("" if row["stock_has_plan"] else " no plan")
        lean = "" if row["ours_plan"] == "default" else f" {row['ours_plan']}"
        ours = _cell(row["ours_gib"], row["limit_gib"]) + lean
        quantized = "" if kind is None else f" {_quantized_cell(row)} |"
        lines.append(f"| {row['name']} ({row['total_gib']:.2f} GiB) | {row['tp']} | {row['limit_gib']:.2f} | "
                     f"{stock} | {ours} |" + quantized)
    if not all(row["stock_has_plan"] for row in rows):
        lines += ["", "\"no plan\": diffusers ships no tensor-parallel plan for the model, so stock loads the full "
                      "model on every rank (per rank = total)."]
    if any(row["ours_plan"] != "default" for row in rows):
        lines += ["", "\"lean\": the family's lean plan (`plan=\"lean\"`), which holds less per rank for more "
                      "collectives per forward; its default plan is stock's, with the fewest."]
    return "\n".join(lines) + "\n"


def run(out: Path, names=ALL_FAMILIES, degrees=DEGREES, quantize=None) -> dict[str, Path]:
    """Measure, print the table, and write `memory.json`, `memory.md`, `memory.png` into `out` (with `quantize`:
    `memory_KIND.json` and `memory_KIND.md`, the chart being the bf16 one)."""
    rows = measure(names, degrees, quantize)
    table = markdown(rows)
    print(table, end="")
    out.mkdir(parents=True, exist_ok=True)
    stem = "memory" if quantize is None else f"memory_{str(rows[0]['quantize']).replace(':', '_')}"
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    command = f"neuron-diffusers bench memory --out {out}" + ("" if quantize is None else f" --quantize {quantize}")
    paths["json"].write_text(json.dumps({**record.metadata(command), "rows": rows}, indent=2) + "\n")
    paths["md"].write_text(table)
    if quantize is None:
        paths["png"] = out / "memory.png"
        plot.grouped_bars(rows, paths["png"])
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for memory.json / .md / .png (default: bench-results)")
    parser.add_argument("--quantize", default=None, metavar="KIND[:BLOCK]",
                        help="also ours with the blocks' Linears in fp8 or int8 (scales counted), written to "
                             "memory_KIND.json / .md")
    parser.add_argument("--rss", action="store_true",
                        help="instead: peak RSS of a plain vs a TP=2 load of a generated ~0.5 GB checkpoint, and of "
                             "fusing a LoRA into the TP=2 shards")


def main(args: argparse.Namespace) -> None:
    if args.rss:
        rss.run()
    else:
        paths = run(args.out, quantize=args.quantize)
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
