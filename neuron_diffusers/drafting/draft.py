"""A drafted plan: the roles `structure.py` read, written as plan rules (`*` for every block of a ModuleList), with
what stays whole and why, the TP degrees it shards evenly, and what `plan check` says about it.

A `*` rule must fit every block of its ModuleList; where blocks differ (SD3's last block lacks the text output), the
blocks that have a module get one rule each, by index, so nothing is guessed for the block that lacks it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from ..compat.tp_loading import shard_specs
from ..distributed import divisors
from ..tools.plan.sharding import degrees_that_shard
from .structure import Note, Roles, read_roles

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")
#: Degrees above this are not listed (no mesh here is larger).
MAX_DEGREE = 64


@dataclass
class Draft:
    """A drafted plan and everything said about it (`plan draft --json` prints this)."""

    model_class: str
    plan: dict
    #: Modules left whole, and why (`decided=False`: the drafter could not tell, and did not guess).
    notes: list[Note] = field(default_factory=list)
    #: TP degrees that split every sharded attention's heads and every sharded block evenly.
    degrees: list[int] = field(default_factory=list)
    #: `plan check` errors ("rule: message"); a draft with errors is not a plan.
    check_errors: list[str] = field(default_factory=list)
    sharded_linears: int = 0
    total_linears: int = 0

    @property
    def undecided(self) -> list[Note]:
        return [note for note in self.notes if not note.decided]


def _style_key(style) -> tuple:
    """Styles compare by kind and arguments (diffusers' packed styles have no `__eq__`)."""
    return (type(style).__name__, repr(getattr(style, "blocks", None)), repr(style) if isinstance(style, str) else "")


def _star(path: str, modules: dict) -> tuple[str, str, int] | None:
    """(container, suffix, index) of the first ModuleList index in `path`, or None."""
    for match in _INDEX.finditer(path):
        container = path[:match.start()]
        if isinstance(modules.get(container), torch.nn.ModuleList):
            return container, path[match.end() + 1:], int(match.group(1))
    return None


def _uniform(modules: dict, container: str, suffix: str, members: dict[int, object]) -> bool:
    shapes = {tuple(getattr(modules[f"{container}.{i}.{suffix}"].weight, "shape", ())) for i in members}
    return (len(members) == len(modules[container]) and len(shapes) == 1
            and len({_style_key(s) for s in members.values()}) == 1)


def write_rules(model: torch.nn.Module, styles: dict[str, object]) -> dict:
    """Plan rules for full-path styles: `*` rules for a ModuleList whose blocks all hold the same modules with the
    same styles and shapes; where its blocks differ, one rule per module for every block of it (so `plan check`
    sees each block's rules together, and no rule claims a module a block lacks)."""
    modules = dict(model.named_modules())
    groups: dict[tuple[str, str], dict[int, object]] = {}
    for path, style in styles.items():
        star = _star(path, modules)
        if star is not None and star[1]:
            groups.setdefault(star[:2], {})[star[2]] = style
    irregular = {container for (container, suffix), members in groups.items()
                 if not _uniform(modules, container, suffix, members)}
    plan = {}
    for path, style in styles.items():
        star = _star(path, modules)
        if star is None or not star[1] or star[0] in irregular:
            plan[path] = style
        else:
            plan[f"{star[0]}.*.{star[1]}"] = style
    return plan


def tp_degrees(model: torch.nn.Module, plan: dict, heads: list[int]) -> list[int]:
    """Degrees that split every sharded attention's heads and every sharded block evenly."""
    if not plan:
        return [1]
    bound = math.gcd(*heads) if heads else max(s for spec in shard_specs(model, plan, 1).values()
                                                for s in spec.block_sizes or [1])
    return degrees_that_shard(model, plan, [d for d in divisors(bound)[1:] if d <= MAX_DEGREE])


def _left_whole(model: torch.nn.Module, styles: dict, notes: list[Note]) -> list[Note]:
    """A note for every Linear no rule shards and no earlier note covers."""
    covered = [note.module for note in notes]
    extra = []
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and path not in styles \
                and not any(path == c or path.startswith(f"{c}.") for c in covered):
            extra.append(Note(path, f"{module.in_features} -> {module.out_features}: not an attention projection, "
                                    "an MLP's pair, a packed projection or a modulation (k x a stream width)"))
    return extra


def _grouped(notes: list[Note]) -> list[Note]:
    """One note per rule-shaped path ("blocks.*.attn1") where every block says the same."""
    seen, grouped = set(), []
    for note in notes:
        path = re.sub(r"\.\d+(?=\.|$)", ".*", note.module, count=1) if _INDEX.search(note.module) else note.module
        key = (path, note.reason, note.decided)
        if key not in seen:
            seen.add(key)
            grouped.append(Note(path, note.reason, note.decided))
    return grouped


def draft_plan(model: torch.nn.Module, shard_norms: bool = True) -> Draft:
    """Draft a plan for `model` (best built on the meta device) and lint it with `plan check`; `shard_norms=False`:
    the fallback that leaves attention with a Q/K norm over all heads whole."""
    from ..tools.plan.check import check_plan  # the CLI tools' lint, imported when a draft is made

    roles: Roles = read_roles(model, shard_norms)
    plan = write_rules(model, roles.styles)
    notes = _grouped(roles.notes + _left_whole(model, roles.styles, roles.notes))
    draft = Draft(type(model).__name__, plan, notes,
                  sharded_linears=len(roles.styles),
                  total_linears=sum(isinstance(m, torch.nn.Linear) for m in model.modules()))
    if not plan:
        return draft
    report = check_plan(model, plan)
    draft.check_errors = [f"{f.rule}: {f.message}" if f.rule else f.message for f in report.errors]
    if not draft.check_errors:
        draft.degrees = tp_degrees(model, plan, list(roles.heads.values()))
    return draft
