"""`neuron-diffusers plan verify`: prove a plan numerically, TP=N against one process, on CPU ranks.

A misplaced style often still runs and returns a plausible but wrong image: packed proportions that divide
but do not match the fused parts, a processor that splits the wrong number of heads. Only the numbers tell.
This runs one forward call of a tiny random model (`cases.py`) in one process, then streams the same
checkpoint sharded with the plan onto N spawned gloo ranks (the stock `from_pretrained(...,
parallel_config=TensorParallelConfig(mesh))` path) and reports the largest absolute difference of any rank's
predictions. In float32 a correct plan differs only by the summation order of its all-reduces.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import diffusers
import torch
import torch.distributed.tensor as dtensor
from diffusers import TensorParallelConfig

from ... import families
from ...compat.plans import using_plan
from ...distributed import init_distributed
from ..spawn import run_on_cpu_ranks
from .cases import Case, build_case, predictions
from .check import add_plan_argument, load_plan, model_for
from .meta import meta_transformer
from .sharding import valid_tp_degrees

DEFAULT_DEGREES = (2, 4)
DEFAULT_TOLERANCE = 1e-5


def _sharded_share(model: torch.nn.Module) -> float:
    """The share of the model's parameters that are split across the ranks (not merely wrapped as DTensors)."""
    total = sharded = 0
    for param in model.parameters():
        total += param.numel()
        if isinstance(param, dtensor.DTensor) and any(isinstance(p, dtensor.Shard) for p in param.placements):
            sharded += param.numel()
    return sharded / total


def _max_abs_diff(outputs: tuple, expected: tuple) -> float:
    if len(outputs) != len(expected) or not expected:
        raise ValueError(f"the sharded model returned {len(outputs)} tensors, one process {len(expected)}")
    return max((out - ref).abs().max().item() for out, ref in zip(outputs, expected, strict=True))


def _rank_job(case: Case, plans: dict[str, dict], degrees: tuple[int, ...]) -> dict:
    """On one spawned rank: load `case`'s checkpoint sharded with each plan at each degree and run its call.

    Failures are returned, not raised, so one broken plan does not hide the others' results. (A wrong plan
    fails alike on every rank, so the ranks stay in step.)
    """
    torch.set_num_threads(1)  # several ranks share the host's cores
    cls = getattr(diffusers, case.model_class)
    results = {}
    for label, plan in plans.items():
        for tp in degrees:
            mesh = init_distributed(tp=tp)["tp"]
            try:
                with using_plan(cls, plan):
                    model = cls.from_pretrained(case.checkpoint, subfolder="transformer",
                                                parallel_config=TensorParallelConfig(mesh=mesh))
                sharded = _sharded_share(model)
                if sharded == 0:
                    raise ValueError("the plan shards no parameter, so matching one process would prove nothing")
                with torch.no_grad():
                    outputs = predictions(model(*case.args, **case.kwargs))
                results[label, tp] = {"diff": _max_abs_diff(outputs, case.expected), "sharded": sharded}
            except Exception as error:  # reported per plan and degree, with its type
                results[label, tp] = {"error": f"{type(error).__name__}: {error}"}
    return results


def _check_degrees(case: Case, plans: dict[str, dict], degrees: tuple[int, ...]) -> None:
    """Every degree must split the tiny model with every plan, or the ranks would fail before comparing."""
    model = meta_transformer(str(case.checkpoint / "transformer")).module
    for label, plan in plans.items():
        valid = valid_tp_degrees(model, plan)
        bad = [tp for tp in degrees if tp not in valid]
        if bad:
            raise ValueError(
                f"TP={bad} cannot split the tiny {case.model_class} ({model.config.num_attention_heads} heads) with "
                f"the {label} plan. Degrees it can verify: {[d for d in valid if d > 1]}."
            )


def verify_plans(model: str, plans: dict[str, dict], degrees=DEFAULT_DEGREES, *, seed: int = 0,
                 timeout_s: float = 300.0) -> dict[str, dict[int, dict]]:
    """`{plan label: {tp: {"diff", "sharded"} or {"error"}}}`: each plan on `model`'s tiny case, TP=tp vs one process.

    `model` is what `cases.build_case` takes. All plans and degrees run in one spawn of `lcm(degrees)`
    CPU ranks (the TP groups of a smaller degree run side by side); `diff` is the largest over the ranks.
    """
    degrees = tuple(sorted(set(degrees)))
    if not degrees or degrees[0] < 2:
        raise ValueError(f"--tp {list(degrees)}: give degrees of 2 or more (one process is the reference).")
    with tempfile.TemporaryDirectory(prefix="plan-verify-") as workdir:
        case = build_case(model, Path(workdir), seed)
        if all(tensor.std() == 0 for tensor in case.expected):
            raise ValueError(f"The tiny {case.model_class}'s predictions are constant, so any plan would match them. "
                             "Give the tiny case inputs and weights that make its output vary.")
        _check_degrees(case, plans, degrees)
        per_rank = run_on_cpu_ranks(_rank_job, math.lcm(*degrees), case, plans, degrees, timeout_s=timeout_s)
    merged = {}
    for label in plans:
        merged[label] = {}
        for tp in degrees:
            results = [rank_results[label, tp] for rank_results in per_rank]
            errors = [r["error"] for r in results if "error" in r]
            merged[label][tp] = {"error": errors[0]} if errors else {
                "diff": max(r["diff"] for r in results), "sharded": results[0]["sharded"]}
    return merged


def passed(results: dict[int, dict], tolerance: float) -> bool:
    return all("diff" in r and r["diff"] <= tolerance for r in results.values())


def format_verify(results: dict[int, dict], plan_name: str, case_model: str, tolerance: float) -> str:
    lines = [f"{plan_name} plan on a tiny random {case_model}, float32, TP=N vs one process on CPU ranks",
             f"  {'TP':>3} {'sharded':>8}  max |TP - one process|"]
    for tp, result in results.items():
        if "error" in result:
            lines.append(f"  {tp:>3} {'':>8}  FAILED: {result['error']}")
        else:
            verdict = "ok" if result["diff"] <= tolerance else f"OVER the tolerance {tolerance:g}"
            lines.append(f"  {tp:>3} {result['sharded']:>8.1%}  {result['diff']:.2e}  {verdict}")
    lines.append(f"OK: within {tolerance:g} at every degree" if passed(results, tolerance)
                 else "FAILED: the plan does not reproduce one process")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_argument(parser)
    parser.add_argument("--model", default=None,
                        help="a tiny pipeline family or a class with a tiny case (TRANSFORMER_CASES in "
                             "tools/plan/cases.py); "
                             "default: the plan's family, or its MODEL_CLASS")
    parser.add_argument("--tp", type=int, nargs="+", default=list(DEFAULT_DEGREES),
                        help="degrees to compare with one process (default: 2 4, on 4 spawned ranks)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="largest max abs difference that passes (default: %(default)g, float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights and inputs")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds the ranks may take")


def main(args) -> int:
    """The CLI: print the comparison; exit status 1 when a degree fails or exceeds the tolerance."""
    plan = load_plan(args.plan)
    model = args.model or (args.plan if families.is_family(args.plan) else model_for(plan, None, "plan verify"))
    results = verify_plans(model, {plan.name: plan.rules}, args.tp, seed=args.seed, timeout_s=args.timeout)[plan.name]
    case_model = families.get(model).model_class_name if families.is_family(model) else model
    print(format_verify(results, plan.name, case_model, args.tolerance))
    return 0 if passed(results, args.tolerance) else 1
