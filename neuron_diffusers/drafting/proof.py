"""Drafts proven by numbers: TP=2 against one process, many classes in one spawn of CPU ranks.

Each class's tiny case (`tiny.py`, or `tools/plan/cases.py` where the package already has one) is run once in this
process; then the ranks stream each tiny checkpoint sharded with its draft through stock `from_pretrained(...,
parallel_config=TensorParallelConfig(mesh))` and run the same call (`tools/plan/verify.py`'s rank job, reused as is).
Spawning costs seconds of imports per spawn, so all classes share one; a class that fails is reported with its error
and does not stop the others.
"""

from __future__ import annotations

from ..tools.plan.cases import Case
from ..tools.plan.verify import DEFAULT_TOLERANCE, _rank_job
from ..tools.spawn import run_on_cpu_ranks

DEGREE = 2


def _rank_jobs(entries: list[tuple[str, Case, dict]], degree: int) -> dict[str, dict]:
    """On one spawned rank: every (label, case, plan) in turn, each failure kept as its result."""
    return {label: _rank_job(case, {label: plan}, (degree,))[label, degree] for label, case, plan in entries}


def _merge(label: str, per_rank: list[dict]) -> dict:
    results = [rank[label] for rank in per_rank]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    return {"diff": max(r["diff"] for r in results), "sharded": results[0]["sharded"]}


def verify_drafts(entries: dict[str, tuple[Case, dict]], degree: int = DEGREE, *,
                  timeout_s: float = 600.0) -> dict[str, dict]:
    """`{label: {"diff", "sharded", "ok"} or {"error", "ok": False}}` for each (case, plan), TP=`degree` vs one
    process, all in one spawn of `degree` CPU ranks. A case whose one-process output is constant is refused (any
    plan would match it)."""
    results, runnable = {}, []
    for label, (case, plan) in entries.items():
        if all(tensor.std() == 0 for tensor in case.expected):
            results[label] = {"error": "the tiny model's output is constant, so matching it would prove nothing"}
        else:
            runnable.append((label, case, plan))
    if runnable:
        per_rank = run_on_cpu_ranks(_rank_jobs, degree, runnable, degree, timeout_s=timeout_s)
        results.update({label: _merge(label, per_rank) for label, _, _ in runnable})
    for result in results.values():
        result["ok"] = "diff" in result and result["diff"] <= DEFAULT_TOLERANCE
    return results
