"""`neuron-diffusers plan check`: lint a tensor-parallel plan against a model's module tree, without weights.

Most plan mistakes show in the shapes alone: a rule that names nothing (a typo, or one block type that lacks
the module), a colwise Linear whose split output nothing puts back together, packed proportions that do not
divide the fused Linear, a degree that splits a head. The check builds the model on the `meta` device (shapes
only: a 13 B model in a second) and reads the plan through diffusers' own `resolve_tp_shard_specs`
(`compat.tp_loading.shard_specs`), the function the loader streams each rank's slice with. What shapes cannot show
(packed proportions that divide but are wrong, a partner that is the wrong Linear) takes numbers:
`plan verify`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import families
from ...compat.tp_loading import shard_specs
from ...parallel import coalesce
from ...parallel.plan_variants import is_plan_file, read_plan_file
from ...parallel.rules import expand, expand_rule, style_kind
from .meta import meta_transformer
from .report import human_params, param_group
from .sharding import valid_tp_degrees


@dataclass(frozen=True)
class NamedPlan:
    """A plan's rules, where they came from, and the model class it is written for (if it says)."""

    name: str
    source: str
    rules: dict
    model_class: str | None


@dataclass(frozen=True)
class Finding:
    rule: str
    message: str


@dataclass
class CheckReport:
    rules: int
    sharded_linears: int
    errors: list[Finding]
    valid_degrees: list[int] | None  # None: no rule resolves, or the model's config names no attention heads
    total_params: int
    whole_params: int  # held whole by every rank: unsharded modules, norms, rowwise biases
    unsharded_linears: list[dict]  # {"module", "params", "share"}, largest first


def load_plan(spec: str) -> NamedPlan:
    """Our plan for a family name, or the `PLAN` (and optional `MODEL_CLASS`) of a plan file.

    A plan file is written like ours in `tp_plans/` and may import `.styles` relatively: it is run as a
    module of that package (but not registered in it).
    """
    if families.is_family(spec):
        module = families.get(spec).plan_module
        return NamedPlan(spec, module.__name__, module.PLAN, module.MODEL_CLASS)
    if not is_plan_file(spec) or not Path(spec).is_file():
        names = ", ".join(f.name for f in families.FAMILIES)
        raise FileNotFoundError(
            f"Plan '{spec}' is neither a registered family ({names}) nor a plan file. Name a "
            "family, or pass a .py file that assigns `PLAN = {...}` like neuron_diffusers/tp_plans/flux.py."
        )
    plan = read_plan_file(spec)
    return NamedPlan(plan.path.stem, str(plan.path), plan.rules, plan.model_class)


_PACKED_HINT = (" Packed blocks are the proportions of the fused parts along the split dimension, in order: [1, 1] "
                "for a SwiGLU value+gate projection, [1, 4] for cat([attention output, MLP hidden of 4 x width]).")


def _rule_errors(model: torch.nn.Module, plan: dict) -> tuple[list[Finding], set[str], set[str]]:
    """Each rule alone must match Linears, use a known style, and its packed blocks must divide the Linear.

    Returns the errors, the rules that match no Linear, and the rules that match but cannot be laid out.
    """
    errors, unmatched, unresolved = [], set(), set()
    for rule, style in plan.items():
        try:
            expand(model, {rule: style})
        except ValueError as error:
            errors.append(Finding(rule, str(error)))
            unmatched.add(rule)
            continue
        try:
            shard_specs(model, {rule: style}, 1, whole_plan=False)
        except ValueError as error:
            errors.append(Finding(rule, str(error) + (_PACKED_HINT if hasattr(style, "blocks") else "")))
            unresolved.add(rule)
    return errors, unmatched, unresolved


def _blocks(model: torch.nn.Module, plan: dict) -> dict[str, tuple[torch.nn.Module, dict[str, str]]]:
    """Rules grouped by where they act, with each Linear's style kind: `prefix.*` rules on the first block of
    that ModuleList (matching already required every block to have the module), the rest on the model."""
    blocks: dict[str, tuple[torch.nn.Module, dict[str, str]]] = {}
    for rule, style in plan.items():
        first = expand_rule(model, rule, style)[0]
        key = f"{first.container}.*." if first.block_name else ""
        blocks.setdefault(key, (first.block, {}))[1][first.path] = style_kind(style)
    return blocks


def _closing_scope(path: str, kind: str, linears: list[str], kinds: dict[str, str]) -> tuple[str, list[str]]:
    """The smallest module around `path` that holds a Linear not of `kind` (else the block), and its other Linears.

    Where a colwise Linear's split output gets put back together: Q, K and V are all colwise and close in their
    attention module's `to_out`; a single-stream block's attention has no `to_out`, so it closes one level up,
    in the block's packed `proj_out`.
    """
    scope = path
    while True:
        scope = scope.rpartition(".")[0]
        members = [name for name in linears if name != path and (not scope or name.startswith(f"{scope}."))]
        if not scope or any(kinds.get(name) != kind for name in members):
            return scope, members


def _unpaired_message(kind: str, where: str, members: list[str], kinds: dict[str, str]) -> str:
    around = ", ".join(f"{name} ({kinds.get(name) or 'unsharded'})" for name in members[:6]) or "none"
    if kind == "colwise":
        return (f"colwise, but no rowwise Linear in {where} closes it: a colwise Linear leaves each rank "
                f"a slice of its output, and only a rowwise Linear (whose all-reduce sums the slices) makes it whole "
                f"again. Linears there: {around}. Make the Linear that consumes this output rowwise, or use "
                f"GatheredColwiseParallel() if the output is needed whole right away.")
    return (f"rowwise, but no colwise Linear in {where} splits its input: a rowwise Linear multiplies its "
            f"rank's slice of the input features, so the input must arrive split by a colwise Linear in front of it. "
            f"Linears there: {around}. Make the Linear that produces its input colwise, or remove this rule.")


def _partner_errors(model: torch.nn.Module, plan: dict) -> list[Finding]:
    """Every colwise Linear needs a rowwise partner in the same block, and every rowwise one a colwise partner."""
    errors = []
    for key, (block, kinds) in _blocks(model, plan).items():
        linears = [name for name, module in block.named_modules() if isinstance(module, torch.nn.Linear)]
        for path, kind in kinds.items():
            if kind not in ("colwise", "rowwise"):
                continue
            scope, members = _closing_scope(path, kind, linears, kinds)
            partner = "rowwise" if kind == "colwise" else "colwise"
            if not any(kinds.get(name) == partner for name in members):
                where = f"'{key}{scope}'" if scope else (f"block '{key.rstrip('.')}'" if key else "the model")
                errors.append(Finding(key + path, _unpaired_message(kind, where, members, kinds)))
    return errors


def _unsharded_linears(model: torch.nn.Module, planned: set[str], total: int) -> list[dict]:
    groups: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name not in planned:
            for param_name, param in module.named_parameters():
                group = param_group(f"{name}.{param_name}")
                groups[group] = groups.get(group, 0) + param.numel()
    rows = [{"module": module, "params": n, "share": n / total} for module, n in groups.items()]
    return sorted(rows, key=lambda row: (-row["params"], row["module"]))


def check_plan(model: torch.nn.Module, plan: dict, tp: int | None = None) -> CheckReport:
    """Lint `plan` against `model` (best on the meta device); errors are in `report.errors`.

    Rules that fail on their own are reported and left out of the checks that need their layout.
    With `tp`, a degree the plan cannot split the model at is an error too.
    """
    errors, unmatched, unresolved = _rule_errors(model, plan)
    # A rule with bad packed blocks still says which way its Linear is split, so it still counts as a partner.
    errors += _partner_errors(model, {rule: style for rule, style in plan.items() if rule not in unmatched})
    rules = {rule: style for rule, style in plan.items() if rule not in unmatched | unresolved}
    try:
        coalesce.check_plan(model, rules)
    except ValueError as error:
        errors.append(Finding("", str(error)))
        rules = {rule: style for rule, style in rules.items() if getattr(style, "reduced_at", None) != "block"}
    specs = shard_specs(model, rules, 1) if rules else {}
    planned = {name.rpartition(".")[0] for name in specs}
    sharded = {name for name, spec in specs.items() if spec.dim is not None}  # a rowwise bias stays whole
    total = sum(p.numel() for p in model.parameters())
    heads = getattr(model.config, "num_attention_heads", None)
    degrees = valid_tp_degrees(model, rules) if rules and isinstance(heads, int) else None
    if tp is not None and degrees is not None and tp not in degrees:
        errors.append(Finding("", (
            f"A tensor-parallel degree of {tp} cannot split {type(model).__name__} with this plan: each rank needs "
            f"whole attention heads ({heads}) and an even slice of every sharded block. Valid degrees: {degrees}.")))
    return CheckReport(
        rules=len(plan),
        sharded_linears=len(planned),
        errors=errors,
        valid_degrees=degrees,
        total_params=total,
        whole_params=sum(p.numel() for name, p in model.named_parameters() if name not in sharded),
        unsharded_linears=_unsharded_linears(model, planned, total),
    )


def format_check(report: CheckReport, plan: NamedPlan, model: str, top: int = 10) -> str:
    degrees = ", ".join(map(str, report.valid_degrees)) if report.valid_degrees else "not checked"
    lines = [
        f"{plan.name} plan ({plan.source}) on {model}, meta device",
        f"  {report.rules} rules -> {report.sharded_linears} Linears sharded",
        f"  valid TP degrees: {degrees}",
        f"  left whole on every rank: {human_params(report.whole_params)} params "
        f"({report.whole_params / report.total_params:.2%} of the model)",
    ]
    if report.unsharded_linears:
        lines.append("  unsharded Linears (largest first):")
        lines += [f"    {row['module']:<60} {human_params(row['params']):>10} {row['share']:>7.2%}"
                  for row in report.unsharded_linears[:top]]
        rest = report.unsharded_linears[top:]
        if rest:
            lines.append(f"    {f'... {len(rest)} more':<60} {human_params(sum(r['params'] for r in rest)):>10}")
    lines += [f"  error in '{f.rule}': {f.message}" if f.rule else f"  error: {f.message}" for f in report.errors]
    count = len(report.errors)
    lines.append(f"{count} error{'s' if count != 1 else ''}" if count else "OK: no errors")
    return "\n".join(lines)


def add_plan_argument(parser: argparse.ArgumentParser) -> None:
    """The PLAN positional that `plan check` and `plan verify` share (resolved by `load_plan`)."""
    parser.add_argument("plan", help="a family name (our registered plan) or a plan file (.py assigning PLAN)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_argument(parser)
    parser.add_argument("--model", default=None,
                        help="a diffusers class or family name (its full-size default config) or a checkpoint folder; "
                             "default: the plan's MODEL_CLASS")
    parser.add_argument("--tp", type=int, default=None, help="also fail unless this degree is valid")


def model_for(plan: NamedPlan, model: str | None, command: str) -> str:
    """`--model`, else the class the plan says it is written for."""
    if model is None and plan.model_class is None:
        raise ValueError(f"{plan.source} sets no MODEL_CLASS, so `{command}` needs --model: the class, family or "
                         "checkpoint folder the plan is for.")
    return model or plan.model_class


def main(args) -> int:
    """The CLI: print the report; exit status 1 when it found errors."""
    plan = load_plan(args.plan)
    meta = meta_transformer(model_for(plan, args.model, "plan check"))
    description, model = meta.description, meta.module
    report = check_plan(model, plan.rules, args.tp)
    print(format_check(report, plan, description))
    return 1 if report.errors else 0
