"""Per-rank weight memory of every family at TP 1/2/4/8, our plans vs stock, against the total/N limit.

`neuron-diffusers bench memory [--out DIR]` prints a markdown table and writes `memory.json` (the rows, under
`record.metadata`'s header: command, date, machine, versions), `memory.md` and `memory.png` into DIR. Every figure is
measured by `plan report` on the full-size default configs built on the `meta` device, so the run
takes seconds on a laptop and nothing in it is hand-maintained. MiniMax-H3 has no stock plan:
stock loads the full model on every rank, so its stock per-rank figure is the total. "ours" is a family's leanest
plan: its default, or its `lean` plan where it has one (Qwen-Image-2.1, whose default is stock's plan).

`--rss` runs the other benchmark instead: peak RSS of a real tensor-parallel load and of fusing a LoRA into its
shards (`rss.py`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ... import families
from ...compat.plans import stock_plan
from ..plan.meta import meta_transformer
from ..plan.sharding import BF16_BYTES, GIB, per_rank_params
from . import plot, record, rss

DEGREES = (1, 2, 4, 8)
ALL_FAMILIES = tuple(family.name for family in families.FAMILIES)


def _gib(params: float) -> float:
    return params * BF16_BYTES / GIB


def measure(names=ALL_FAMILIES, degrees=DEGREES) -> list[dict]:
    """One row per (family, degree): total, limit, stock and our per-rank GiB in bf16.

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
            rows.append(row)
    return rows


def _cell(gib: float | None, limit: float) -> str:
    return "n/a" if gib is None else f"{gib:.2f} ({gib / limit:.2f}x)"


def markdown(rows: list[dict]) -> str:
    """The table `memory.md` holds: per-rank GiB (bf16) and its ratio to total/N."""
    lines = [
        "| Model | TP | total/N limit (GiB) | stock per rank (GiB) | ours per rank (GiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        stock = _cell(row["stock_gib"], row["limit_gib"]) + ("" if row["stock_has_plan"] else " no plan")
        lean = "" if row["ours_plan"] == "default" else f" {row['ours_plan']}"
        ours = _cell(row["ours_gib"], row["limit_gib"]) + lean
        lines.append(f"| {row['name']} ({row['total_gib']:.2f} GiB) | {row['tp']} | {row['limit_gib']:.2f} | "
                     f"{stock} | {ours} |")
    if not all(row["stock_has_plan"] for row in rows):
        lines += ["", "\"no plan\": diffusers ships no tensor-parallel plan for the model, so stock loads the full "
                      "model on every rank (per rank = total)."]
    if any(row["ours_plan"] != "default" for row in rows):
        lines += ["", "\"lean\": the family's lean plan (`plan=\"lean\"`), which holds less per rank for more "
                      "collectives per forward; its default plan is stock's, with the fewest."]
    return "\n".join(lines) + "\n"


def run(out: Path, names=ALL_FAMILIES, degrees=DEGREES) -> dict[str, Path]:
    """Measure, print the table, and write `memory.json`, `memory.md`, `memory.png` into `out`."""
    rows = measure(names, degrees)
    table = markdown(rows)
    print(table, end="")
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "memory.json", "md": out / "memory.md", "png": out / "memory.png"}
    header = record.metadata(f"neuron-diffusers bench memory --out {out}")
    paths["json"].write_text(json.dumps({**header, "rows": rows}, indent=2) + "\n")
    paths["md"].write_text(table)
    plot.grouped_bars(rows, paths["png"])
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for memory.json / .md / .png (default: bench-results)")
    parser.add_argument("--rss", action="store_true",
                        help="instead: peak RSS of a plain vs a TP=2 load of a generated ~0.5 GB checkpoint, and of "
                             "fusing a LoRA into the TP=2 shards")


def main(args: argparse.Namespace) -> None:
    if args.rss:
        rss.run()
    else:
        paths = run(args.out)
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
