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
    merged = {"diff": max(r["diff"] for r in results)}
    return {**merged, "sharded": results[0]["sharded"]} if "sharded" in results[0] else merged


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


#: The composed layout CP plans are proven at: TP=2 inside, Ulysses=2 across, on 4 CPU ranks.
CP_LAYOUT = {"tp": 2, "ulysses": 2}


def _cp_run(case: Case, tp_plan: dict, cp_plan: dict, mesh, ulysses: int, route: bool) -> dict:
    """One (TP plan, CP plan) on this rank: loaded whole, its processors that call SDPA themselves routed through
    diffusers' dispatch (`route`; `compat/attention_route.py`), split by diffusers' own `enable_parallelism(config=
    ParallelConfig(CP + TP), cp_plan=...)`, run, compared with one process; a failure is its result."""
    import diffusers
    import torch
    from diffusers import ContextParallelConfig, ParallelConfig, TensorParallelConfig

    from ..compat.attention_route import route_attention
    from ..compat.plans import using_plan
    from ..tools.plan.cases import predictions
    from ..tools.plan.verify import _max_abs_diff

    cls = getattr(diffusers, case.model_class)
    try:
        model = cls.from_pretrained(case.checkpoint, subfolder="transformer").eval()
        if route:
            route_attention(model, cp_plan)
        config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=ulysses, mesh=mesh),
                                tensor_parallel_config=TensorParallelConfig(mesh=mesh["tp"]))
        with using_plan(cls, tp_plan):
            model.enable_parallelism(config=config, cp_plan=cp_plan)
        with torch.no_grad():
            return {"diff": _max_abs_diff(predictions(model(*case.args, **case.kwargs)), case.expected)}
    except Exception as error:  # reported per plan, with its type
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}


def _cp_rank_jobs(entries: list[tuple[str, Case, dict, dict]], tp: int, ulysses: int,
                  route: bool = True) -> dict[str, dict]:
    """On one spawned rank: each class's CP candidates in order until one matches one process on every rank (the
    ranks agree through an all-reduce, so they stop together)."""
    import torch

    from ..distributed import init_distributed

    torch.set_num_threads(1)
    mesh = init_distributed(tp=tp, ulysses=ulysses)
    results = {}
    for name, case, tp_plan, candidates in entries:
        results[name] = {}
        for label, cp_plan in candidates.items():
            result = results[name][label] = _cp_run(case, tp_plan, cp_plan, mesh, ulysses, route)
            worst = torch.tensor([result.get("diff", float("inf"))])
            torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
            if worst.item() <= DEFAULT_TOLERANCE:
                break
    return results


def verify_cp(entries: dict[str, tuple[Case, dict, dict]], *, timeout_s: float = 600.0,
              route: bool = True) -> dict[str, dict]:
    """For each class (case, TP plan, {label: CP plan}, best first): `{"plan": the first label equal to one process
    at tp=2 x ulysses=2 within the tolerance, or None, "tried": {label: {"diff"} or {"error"}}}`, all in one spawn
    of 4 CPU ranks. `route=False` leaves processors that bypass dispatch as they are (a test's control)."""
    runnable = [(name, case, tp_plan, candidates) for name, (case, tp_plan, candidates) in entries.items()]
    per_rank = run_on_cpu_ranks(_cp_rank_jobs, CP_LAYOUT["tp"] * CP_LAYOUT["ulysses"], runnable, CP_LAYOUT["tp"],
                                CP_LAYOUT["ulysses"], route, timeout_s=timeout_s)
    results = {}
    for name in entries:
        tried = {label: _merge(label, [rank[name] for rank in per_rank]) for label in per_rank[0][name]}
        passing = [label for label, r in tried.items() if "diff" in r and r["diff"] <= DEFAULT_TOLERANCE]
        results[name] = {"plan": passing[0] if passing else None, "tried": tried}
    return results
