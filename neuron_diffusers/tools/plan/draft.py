"""`neuron-diffusers plan draft`: a tensor-parallel plan drafted from a transformer's module tree, verified by numbers.

`plan draft MODEL_CLASS|DIR` reads the module tree on the meta device (`neuron_diffusers.drafting`), prints the plan
as a plan file (or `--json`), lints it with `plan check`, and proves its tiny instance at TP=2 against one process
(`--no-verify` skips the spawn). `--out FILE` writes the plan file, ready for `plan check` / `plan verify` and
hand-editing. `plan draft --all` does this for every transformer class diffusers exports and writes the coverage
table to docs/coverage.md and docs/coverage.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import diffusers

from ... import __version__
from ...drafting import Draft, draft_plan, shipped
from ...drafting.coverage import coverage, tiny_entry, verified_plans
from ...drafting.proof import verify_drafts
from ...drafting.shipped import style_text
from .meta import meta_transformer


def plan_file(draft: Draft, source: str) -> str:
    """The draft as a plan file (data only, like `tp_plans/*.py`), with what it left whole and why."""
    styles = {type(s).__name__ for s in draft.plan.values() if not isinstance(s, str)}
    lines = [f'"""Drafted by `neuron-diffusers plan draft {source}` from the module tree (neuron_diffusers '
             f'{__version__}, diffusers {diffusers.__version__}). Review before relying on it."""', ""]
    packed = sorted(s for s in styles if s.startswith("Packed"))
    if packed:
        lines.append(f"from diffusers.hooks.tensor_parallel import {', '.join(packed)}")
    ours = sorted(styles & {"GatheredColwiseParallel", "ShardedRMSNorm"})
    if ours:
        lines.append(f"from neuron_diffusers.tp_plans.styles import {', '.join(ours)}")
    lines += ["", f'MODEL_CLASS = "{draft.model_class}"', "", "# Left whole (module: reason):"]
    lines += [f"# - {note.module}: {note.reason}{'' if note.decided else ' [undecided]'}" for note in draft.notes]
    lines.append("PLAN = {")
    lines += [f'    "{rule}": {style_text(style)},' for rule, style in draft.plan.items()]
    lines.append("}")
    return "\n".join(lines) + "\n"


def draft_json(draft: Draft, verified: dict | None) -> dict:
    return {"model_class": draft.model_class, "plan": {rule: style_text(s) for rule, s in draft.plan.items()},
            "degrees": draft.degrees, "check_errors": draft.check_errors,
            "left_whole": [asdict(note) for note in draft.notes], "verified_tp2": verified}


def _verify_one(model_class: str, base: dict | None) -> dict:
    """The TP=2 proof on a tiny instance: of the class's default config, or of `base` (a folder's config) shrunk."""
    with tempfile.TemporaryDirectory(prefix="plan-draft-") as workdir:
        tiny, entry = tiny_entry(model_class, Path(workdir), base)
        if entry is None:
            return {"ok": False, "error": tiny["miss"]}
        return verify_drafts({model_class: entry})[model_class]


def _draft_one(args) -> int:
    meta = meta_transformer(args.model)
    draft = draft_plan(meta.module)
    base = dict(meta.module.config) if meta.config == "checkpoint" else None
    verified = None if args.no_verify or draft.check_errors or not draft.plan else _verify_one(draft.model_class, base)
    if args.out:
        Path(args.out).write_text(plan_file(draft, args.model))
    if args.json:
        print(json.dumps(draft_json(draft, verified), indent=2))
    else:
        print(plan_file(draft, args.model), end="")
        print(f"# {meta.description}: {len(draft.plan)} rules, {draft.sharded_linears} of {draft.total_linears} "
              f"Linears sharded; TP degrees {draft.degrees or 'none'}")
        for error in draft.check_errors:
            print(f"# plan check error: {error}")
        if verified is not None:
            print("# TP=2 vs one process: " + (f"{verified['diff']:.2e}" if "diff" in verified
                                               else verified.get("error", "")) + (" ok" if verified["ok"] else ""))
    ok = not draft.check_errors and bool(draft.plan) and (verified is None or verified["ok"])
    return 0 if ok else 1


def _provenance(argv: str) -> dict:
    return {"command": f"neuron-diffusers plan draft {argv}", "date": datetime.datetime.now(datetime.UTC)
            .strftime("%Y-%m-%d %H:%M UTC"), "machine": f"{platform.machine()} {platform.node()}, "
            f"{platform.python_implementation()} {platform.python_version()}", "neuron_diffusers": __version__,
            "diffusers": diffusers.__version__}


def _cell_weights(weights: dict | None) -> str:
    """Per-rank weights against the ideal, and all-reduces + all-gathers per forward."""
    if not weights:
        return "-"
    counts = weights.get("collectives") or {}
    return f"{weights['ratio']:.3f} x ({counts.get('all_reduce', 0)} AR + {counts.get('all_gather', 0)} AG)"


def _cp_cell(result: dict | None) -> str:
    """The CP plan that matched at tp=2 x ulysses=2 (its difference and candidate), or '-'."""
    if not result or result.get("plan") is None:
        return "-"
    return f"{result['tried'][result['plan']]['diff']:.1e} ok ({result['plan']})"


def cp_verified_row(row: dict) -> bool:
    """tp=2 x ulysses=2 equal to one process: with the drafted CP plan, or else with the stock `_cp_plan`."""
    return bool((row.get("cp") or {}).get("plan") or (row.get("cp_stock") or {}).get("plan"))


def _stock_cell(row: dict) -> str:
    stock = row.get("cp_stock")
    if stock is None:
        return "-"
    tried = stock["tried"].get("stock", {})
    if stock["plan"]:
        return f"composes ({tried['diff']:.1e})"
    return "fails: " + (f"differs by {tried['diff']:.1e}" if "diff" in tried else tried.get("error",
                                                                                         stock.get("error", "")))


def _hand_wins(r: dict) -> str:
    """Where the hand plan beats the draft: collectives per forward (and per-rank weights) at TP=8."""
    draft, hand = r.get("weights_tp8"), (r.get("hand_plan") or {}).get("weights_tp8")
    if not draft or not hand:
        return ""
    count = lambda w: sum((w.get("collectives") or {}).values())  # noqa: E731
    fewer, lighter = count(draft) - count(hand), draft["ratio"] - hand["ratio"]
    wins = [f"{fewer} fewer collectives" if fewer > 0 else "", f"{lighter:.3f} x less weight" if lighter > 5e-4 else ""]
    wins = [w for w in wins if w]
    return f"hand plan wins ({', '.join(wins)} per forward at TP=8): it stays the default" if wins else \
        "the draft is as lean as the hand plan"


def _miss_cell(r: dict) -> str:
    notes = r.get("miss") or "; ".join(f"{n['module']}: {n['reason']}" for n in r.get("undecided", [])[:2])
    if r.get("sharded_norms_failed") and not r.get("miss"):
        notes = ("verified with attentions whose Q/K norm spans all heads left whole (ShardedRMSNorm draft: "
                 f"{r['sharded_norms_failed']})")
    notes = "; ".join(n for n in (_hand_wins(r), notes) if n)
    if r.get("cp_miss") and not r.get("miss"):
        notes = f"CP: {r['cp_miss']}" + (f"; {notes}" if notes else "")
    if r.get("config_unconfirmed"):
        notes = f"TP=8: full-size config unconfirmed, {r['config_unconfirmed']}" + (f"; {notes}" if notes else "")
    return _cell_text(notes)[:240]


def _cell_text(text: str) -> str:
    """Error text safe in a table cell: no column breaks, no brackets read as links (DTensor placements)."""
    return text.replace("|", "/").replace("[", "&#91;").replace("]", "&#93;")


def coverage_markdown(rows: list[dict], meta: dict) -> str:
    drafted = sum("rules" in r and not r.get("check_errors") for r in rows)
    verified = sum(bool(r.get("verified", {}).get("ok")) for r in rows)
    cp_verified = sum(cp_verified_row(r) for r in rows)
    stock = [r for r in rows if "cp_stock" in r]
    lines = ["# Tensor- and context-parallel coverage: drafted plans for every diffusers transformer", "",
             f"Generated by `{meta['command']}` on {meta['date']} ({meta['machine']}; neuron_diffusers "
             f"{meta['neuron_diffusers']}, diffusers {meta['diffusers']}). Do not edit by hand.", "",
             *[f"Rows of {', '.join(u['classes'])} re-run by `{u['command']}` on {u['date']} ({u['machine']})."
               for u in meta.get("updates", ())], *([""] if meta.get("updates") else []),
             f"{len(rows)} classes; {drafted} drafted with a clean `plan check` at full size; **{verified} verified** "
             "(tiny instance, TP=2 equal to one process within 1e-5, float32, CPU ranks); "
             f"**{cp_verified} verified at tp=2 x ulysses=2** (the drafted TP plan composed with a drafted CP plan, "
             "or with the stock `_cp_plan` where no drafted one matches, 4 CPU ranks, equal to one process within "
             "1e-5; processors that call SDPA themselves routed through diffusers' dispatch, "
             "`compat/attention_route.py`); the stock `_cp_plan` composes with the drafted TP plan "
             f"for {sum(bool(r['cp_stock']['plan']) for r in stock)} of the {len(stock)} verified classes that ship "
             "one. A stock pipeline on one of these classes runs through `load_pipeline` / `generate` on a drafted "
             "TP plan (the shipped verified one where its checkpoint drafts to it) and, under context parallelism, "
             "only on a CP plan this table verified, attention routed as here (docs/usage.md). TP=8: per-rank "
             "parameters of the full-size default config against total / 8 (1.000 x is ideal), "
             "and all-reduces (AR) + all-gathers (AG) per forward. Where a family has a hand plan it stays the "
             "default: it hoists the modulation into one all-gather and reduces dual-stream pairs together (fewer "
             "collectives in the hand plan column).", "",
             "| class | rules | TP=2 max diff | degrees | TP=8 draft | TP=8 hand plan | tp=2 x ulysses=2 | "
             "stock `_cp_plan` | miss / undecided |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        result = r.get("verified", {})
        diff = f"{result['diff']:.1e}" + (" ok" if result.get("ok") else "") if "diff" in result else "-"
        hand = r.get("hand_plan", {}).get("weights_tp8")
        degrees = ", ".join(map(str, r.get("degrees") or [])) or "-"
        lines.append(f"| {r['class']} | {r.get('rules', '-')} | {diff} | {degrees} | "
                     f"{_cell_weights(r.get('weights_tp8'))}{' (unconfirmed)' * bool(r.get('config_unconfirmed'))} | "
                     f"{_cell_weights(hand)} | {_cp_cell(r.get('cp'))} | "
                     f"{_cell_text(_stock_cell(r))[:80]} | {_miss_cell(r)} |")
    return "\n".join(lines) + "\n"


def _draft_all(args) -> int:
    rows = coverage(args.classes or None, log=lambda line: print(line, file=sys.stderr, flush=True))
    docs = Path(args.docs)
    if args.classes:
        rows, meta = _merged(docs / "coverage.json", rows, _provenance("--all --classes " + " ".join(args.classes)))
    else:
        meta = _provenance("--all" + (" --json" if args.json else ""))
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "coverage.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str) + "\n")
    (docs / "coverage.md").write_text(coverage_markdown(rows, meta))
    # The package data the generic adapter loads: every verified plan of the whole table (a full run, or the stored
    # table with the re-run rows).
    shipped.PATH.write_text(json.dumps({**meta, "plans": verified_plans(rows)}, indent=1, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    else:
        print(coverage_markdown(rows, meta), end="")
    return 0


def _merged(stored_path: Path, fresh: list[dict], update: dict) -> tuple[list[dict], dict]:
    """The stored table with the re-run classes' rows replaced, and its provenance with this update appended (the
    table stays the full run's, naming each later re-run of some rows)."""
    if not stored_path.is_file():
        raise ValueError(f"--classes re-runs some rows of the stored table, but {stored_path} does not exist: run "
                         "`plan draft --all` first (or pass --docs where it wrote the table).")
    stored = json.loads(stored_path.read_text())
    by_class = {row["class"]: row for row in fresh}
    unknown = sorted(set(by_class) - {row["class"] for row in stored["rows"]})
    if unknown:
        raise ValueError(f"{', '.join(unknown)} not in {stored_path}: --classes re-runs rows of the stored table.")
    meta = {k: v for k, v in stored.items() if k != "rows"}
    meta["updates"] = [*meta.get("updates", []), {**update, "classes": sorted(by_class)}]
    return [by_class.get(row["class"], row) for row in stored["rows"]], meta


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="a diffusers class name (its full-size default config) or a "
                                                 "checkpoint folder")
    parser.add_argument("--all", action="store_true", help="every transformer class diffusers exports: the coverage "
                                                           "table, written to DOCS/coverage.md and .json")
    parser.add_argument("--out", default=None, help="write the drafted plan file here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a plan file / table")
    parser.add_argument("--no-verify", action="store_true", help="skip the TP=2 proof on a tiny instance")
    parser.add_argument("--docs", default="docs", help="where --all writes coverage.md/.json (default: docs)")
    parser.add_argument("--classes", nargs="+", default=None, metavar="CLASS",
                        help="with --all: re-run only these classes and replace their rows in the stored "
                             "DOCS/coverage.json (and the shipped plans), which then names this update")


def main(args) -> int:
    """The CLI: exit 1 when the draft fails `plan check` or its TP=2 proof."""
    if args.all == bool(args.model):
        raise ValueError("give a model class or folder to draft, or --all (not both)")
    return _draft_all(args) if args.all else _draft_one(args)
