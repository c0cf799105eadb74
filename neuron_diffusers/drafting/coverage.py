"""Every transformer class diffusers exports, drafted and proven: the coverage table `plan draft --all` writes.

For each class: the draft of its full-size default config (meta device: rules, degrees, per-rank weights at TP=8
against total / 8), the draft of its tiny instance verified at TP=2 against one process, and for every miss the
reason. Families with a hand-written plan show it beside the draft.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict
from pathlib import Path

import diffusers
import torch

from .. import families
from ..parallel.rules import collectives_per_forward
from ..tools.plan.cases import build_case, verifiable_models
from ..tools.plan.sharding import per_rank_params
from .draft import Draft, draft_plan
from .proof import verify_drafts
from .tiny import full_size_config, tiny_case

REPORT_TP = 8
#: Classes verified per spawn: a rank that hangs costs one chunk's results, not the table's.
CHUNK = 10


def transformer_classes() -> list[str]:
    """The model classes `diffusers.models.transformers` exports, sorted."""
    from diffusers.models import transformers

    return sorted(name for name in dir(transformers)
                  if isinstance(getattr(transformers, name), type)
                  and issubclass(getattr(transformers, name), diffusers.ModelMixin))


def style_text(style) -> str:
    """A style as plan-file source: `"colwise"`, `PackedRowwiseParallel([1, 4])`, `GatheredColwiseParallel()`."""
    if isinstance(style, str):
        return f'"{style}"'
    blocks = getattr(style, "blocks", None)
    if type(style).__name__.startswith("Packed"):
        return f"{type(style).__name__}({blocks!r})" if blocks is not None else f"{type(style).__name__}()"
    return repr(style)


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
    family = families.by_model_class(name)
    if family is not None:
        row["hand_plan"] = {"family": family.name, "weights_tp8": _weights(model, family.plan, [REPORT_TP])}
    return row, draft


def _case(name: str, workdir: Path):
    if name in verifiable_models():
        return build_case(name, workdir)
    return tiny_case(getattr(diffusers, name), workdir)


def tiny_entry(name: str, workdir: Path) -> tuple[dict, tuple | None]:
    """(what the tiny draft says, (case, plan) to verify) or a miss."""
    try:
        case = _case(name, workdir)
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
    return {"tiny_rules": len(draft.plan)}, (case, draft.plan)


def coverage(names: list[str] | None = None, log=print) -> list[dict]:
    """The table's rows: full-size draft, tiny draft verified at TP=2, reasons for misses."""
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
    return [rows[name] for name in names]


def _verify_chunk(entries: dict, rows: dict, log) -> None:
    try:
        results = verify_drafts(entries)
    except RuntimeError as error:  # a rank died or hung: the whole chunk is a miss, with the reason
        results = {name: {"error": f"ranks failed: {str(error)[:200]}", "ok": False} for name in entries}
    for name, result in results.items():
        rows[name]["verified"] = result
        if not result["ok"]:
            rows[name]["miss"] = (f"TP=2 differs from one process by {result['diff']:.2e}" if "diff" in result
                                  else f"TP=2 run failed: {result['error']}")[:300]
        log(f"{name}: {'verified' if result['ok'] else rows[name]['miss']}")
