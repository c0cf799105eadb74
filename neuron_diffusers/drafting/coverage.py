"""Every transformer class diffusers exports, drafted and proven: the coverage table `plan draft --all` writes.

For each class: the draft of its full-size default config (meta device: rules, degrees, per-rank weights at TP=8
against total / 8), the draft of its tiny instance verified at TP=2 against one process, and for every miss the
reason. Families with a hand-written plan show it beside the draft.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path

import diffusers
import torch

from .. import families
from ..compat.plans import cp_plan_of
from ..parallel.rules import collectives_per_forward
from ..tools.plan.cases import build_case, verifiable_models
from ..tools.plan.sharding import per_rank_params
from ..tp_plans.styles import ShardedRMSNorm
from .context import CpDraft, draft_cp_plans, plan_text
from .draft import Draft, draft_plan
from .proof import verify_cp, verify_drafts
from .shipped import plan_text as rules_text
from .tiny import UNCONFIRMED_GAPS, full_size_config, tiny_case

REPORT_TP = 8
#: Classes verified per spawn: a rank that hangs costs one chunk's results, not the table's.
CHUNK = 10
#: How long one chunk's spawn may take before its classes count as misses (a hang guard: generous, since the
#: machines this runs on are often shared and 4 CPU ranks run each CP candidate).
CHUNK_TIMEOUT_S = 2400.0


def transformer_classes() -> list[str]:
    """The model classes `diffusers.models.transformers` exports, sorted."""
    from diffusers.models import transformers

    return sorted(name for name in dir(transformers)
                  if isinstance(getattr(transformers, name), type)
                  and issubclass(getattr(transformers, name), diffusers.ModelMixin))


def _weights(model: torch.nn.Module, plan: dict | None, degrees: list[int]) -> dict | None:
    if plan is None or REPORT_TP not in degrees:
        return None
    total = sum(p.numel() for p in model.parameters())
    held = per_rank_params(model, plan, REPORT_TP)
    return {"per_rank": held, "ideal": total // REPORT_TP, "ratio": held / (total / REPORT_TP),
            "collectives": collectives_per_forward(model, plan)}


def full_size_row(name: str) -> tuple[dict, Draft | None]:
    """The class's full-size draft as a table row (a miss when its default config does not build)."""
    cls = getattr(diffusers, name)
    try:
        with torch.device("meta"):
            model = cls.from_config(full_size_config(cls))
    except Exception as error:  # a class whose default config is incomplete: a miss, with the reason
        return {"class": name, "miss": f"default config does not build: {type(error).__name__}: {error}"[:300]}, None
    draft = draft_plan(model)
    row = {"class": name, "rules": len(draft.plan), "sharded_linears": draft.sharded_linears,
           "linears": draft.total_linears, "degrees": draft.degrees, "check_errors": draft.check_errors[:3],
           "undecided": [asdict(n) for n in draft.undecided],
           "weights_tp8": _weights(model, draft.plan, draft.degrees) if not draft.check_errors else None}
    if name in UNCONFIRMED_GAPS:
        row["config_unconfirmed"] = UNCONFIRMED_GAPS[name]
    family = families.by_model_class(name)
    if family is not None:
        row["hand_plan"] = {"family": family.name, "weights_tp8": _weights(model, family.plan, [REPORT_TP])}
    return row, draft


def _case(name: str, workdir: Path, base: dict | None):
    if base is None and name in verifiable_models():
        return build_case(name, workdir)
    return tiny_case(getattr(diffusers, name), workdir, base=base)


def tiny_entry(name: str, workdir: Path, base: dict | None = None) -> tuple[dict, tuple | None]:
    """(what the tiny draft says, (case, plan) to verify) or a miss; `base`: a checkpoint's config to shrink
    instead of the class's default."""
    try:
        case = _case(name, workdir, base)
    except Exception as error:  # no runnable tiny call: a miss, with the reason
        return {"miss": f"tiny case: {type(error).__name__}: {error}"[:300]}, None
    from ..tools.plan.meta import meta_transformer

    draft = draft_plan(meta_transformer(str(case.checkpoint / "transformer")).module)
    if not draft.plan:
        reasons = "; ".join(f"{n.module}: {n.reason}" for n in draft.undecided[:2]) or "no Linear has a role"
        return {"miss": f"nothing to shard: {reasons}"[:300]}, None
    if draft.check_errors:
        return {"miss": f"plan check: {draft.check_errors[0]}"[:300]}, None
    if 2 not in draft.degrees:
        return {"miss": f"the tiny instance cannot be split at TP=2 (degrees {draft.degrees})"}, None
    config = json.loads((case.checkpoint / "transformer" / "config.json").read_text())
    return {"tiny_rules": len(draft.plan), "tiny_plan": rules_text(draft.plan), "shard_norms": True,
            "tiny_config": config}, (case, draft.plan)


def coverage(names: list[str] | None = None, log=print, context: bool = True) -> list[dict]:
    """The table's rows: full-size draft, tiny draft verified at TP=2 and (`context`) its CP plan at tp=2 x
    ulysses=2, reasons for misses."""
    names = names or transformer_classes()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="plan-draft-") as workdir:
        pending = {}
        for name in names:
            row, _ = full_size_row(name)
            rows[name] = row
            if "miss" in row:
                continue
            tiny, entry = tiny_entry(name, Path(workdir) / name)
            row.update(tiny)
            if entry is not None:
                pending[name] = entry
            log(f"{name}: {row.get('miss', 'drafted')}")
        chunks = [list(pending)[i:i + CHUNK] for i in range(0, len(pending), CHUNK)]
        for chunk in chunks:
            _verify_chunk({name: pending[name] for name in chunk}, rows, log)
        _verify_fallbacks(pending, rows, log)
        if context:
            _context_parallel(pending, rows, log)
    return [rows[name] for name in names]


def verified_plans(rows: list[dict]) -> dict:
    """The package data (`shipped.py`): each TP=2-verified class's plan, its `shard_norms`, the tiny config, and how
    it runs at tp=2 x ulysses=2 (`_context_entry`)."""
    return {r["class"]: {"plan": r["tiny_plan"], "shard_norms": r["shard_norms"], "tiny_config": r["tiny_config"],
                         "tp2_diff": r["verified"]["diff"], **_context_entry(r)}
            for r in rows if r.get("verified", {}).get("ok")}


def _context_entry(row: dict) -> dict:
    """`cp_plan`: the drafted CP plan that matched one process at tp=2 x ulysses=2 (as text), or "stock" where only
    diffusers' `_cp_plan` did; else `cp_miss`, why neither did."""
    cp, stock = row.get("cp") or {}, row.get("cp_stock") or {}
    if cp.get("plan"):
        return {"cp_plan": row["cp_candidates"][cp["plan"]], "cp_diff": cp["tried"][cp["plan"]]["diff"]}
    if stock.get("plan"):
        return {"cp_plan": "stock", "cp_diff": stock["tried"]["stock"]["diff"]}
    return {"cp_miss": row.get("cp_miss") or "no context-parallel plan was verified"}


def _cp_entries(pending: dict, rows: dict) -> dict:
    """For each TP-verified class: (case, TP plan, drafted CP candidates) and, where diffusers ships one, (case, TP
    plan, {"stock": its `_cp_plan`}) under "<class> (stock)"; a class with no candidate gets its reason."""
    entries = {}
    for name, (case, tp_plan) in pending.items():
        if not rows[name].get("verified", {}).get("ok"):
            rows[name]["cp_miss"] = "TP=2 not verified, so tp=2 x ulysses=2 is not tried"
            continue
        cls = getattr(diffusers, name)
        try:
            model = cls.from_pretrained(case.checkpoint, subfolder="transformer").eval()
            drafted = draft_cp_plans(model, case.kwargs, case.args)
        except Exception as error:  # the traced call failed: a miss, with the reason
            drafted = CpDraft(reason=f"trace: {type(error).__name__}: {error}"[:200])
        if drafted.candidates:
            entries[name] = (case, tp_plan, drafted.candidates)
            rows[name]["cp_candidates"] = {label: plan_text(plan) for label, plan in drafted.candidates.items()}
        else:
            rows[name]["cp_miss"] = drafted.reason
        if cp_plan_of(cls) is not None:
            entries[f"{name} (stock)"] = (case, tp_plan, {"stock": cp_plan_of(cls)})
    return entries


def _context_parallel(pending: dict, rows: dict, log) -> None:
    """Each TP-verified class's drafted CP plan (first candidate equal to one process) and the stock `_cp_plan`,
    both composed with the drafted TP plan at tp=2 x ulysses=2."""
    entries = _cp_entries(pending, rows)
    for i in range(0, len(entries), CHUNK):
        chunk = {label: entries[label] for label in list(entries)[i:i + CHUNK]}
        try:
            results = verify_cp(chunk, timeout_s=CHUNK_TIMEOUT_S)
        except RuntimeError as error:  # a rank died or hung: the chunk's classes are misses, with the reason
            results = {label: {"plan": None, "tried": {}, "error": f"ranks failed: {str(error)[:200]}"}
                       for label in chunk}
        for label, result in results.items():
            name, stock = label.removesuffix(" (stock)"), label.endswith(" (stock)")
            rows[name]["cp_stock" if stock else "cp"] = result
            if not stock and result["plan"] is None:
                rows[name]["cp_miss"] = result.get("error") or _cp_reason(result["tried"])
            log(f"{label}: tp=2 x ulysses=2 {result['plan'] or 'no plan matches'}")


def _cp_reason(tried: dict) -> str:
    """Why no CP candidate matched: each candidate's difference or error."""
    return "; ".join(f"{label}: " + (f"differs by {r['diff']:.1e}" if "diff" in r else r["error"])
                     for label, r in tried.items())[:300]


def _verify_chunk(entries: dict, rows: dict, log) -> None:
    try:
        results = verify_drafts(entries, timeout_s=CHUNK_TIMEOUT_S)
    except RuntimeError as error:  # a rank died or hung: the whole chunk is a miss, with the reason
        results = {name: {"error": f"ranks failed: {str(error)[:200]}", "ok": False} for name in entries}
    for name, result in results.items():
        rows[name]["verified"] = result
        if result["ok"]:
            rows[name].pop("miss", None)
        else:
            rows[name]["miss"] = (f"TP=2 differs from one process by {result['diff']:.2e}" if "diff" in result
                                  else f"TP=2 run failed: {result['error']}")[:300]
        log(f"{name}: {'verified' if result['ok'] else rows[name]['miss']}")


def _verify_fallbacks(pending: dict, rows: dict, log) -> None:
    """Where a draft with `ShardedRMSNorm` Q/K norms fails at TP=2 (a processor that also reads all heads at once,
    e.g. rotary embeddings over the whole width), its fallback, those attentions left whole, is verified instead;
    the first failure stays in the row (`sharded_norms_failed`)."""
    from ..tools.plan.meta import meta_transformer

    fallbacks = {}
    for name, (case, plan) in pending.items():
        if rows[name].get("verified", {}).get("ok") or not any(isinstance(s, ShardedRMSNorm) for s in plan.values()):
            continue
        draft = draft_plan(meta_transformer(str(case.checkpoint / "transformer")).module, shard_norms=False)
        if draft.plan and not draft.check_errors and 2 in draft.degrees:
            fallbacks[name] = (case, draft.plan)
            rows[name]["sharded_norms_failed"] = rows[name].get("miss")
    for i in range(0, len(fallbacks), CHUNK):
        chunk = {name: fallbacks[name] for name in list(fallbacks)[i:i + CHUNK]}
        _verify_chunk(chunk, rows, log)
        for name in chunk:
            if rows[name]["verified"]["ok"]:
                pending[name] = fallbacks[name]
                rows[name].update(tiny_rules=len(fallbacks[name][1]), tiny_plan=rules_text(fallbacks[name][1]),
                                  shard_norms=False)
