"""The drafted plans `plan draft --all` verified, shipped as package data (`verified_plans.json`).

A drafted plan counts only once a TP=2 run on a tiny instance matched one process; the generic adapter should load
that plan, not a fresh draft nobody ran. The command writes, per verified class, the plan as text, whether its Q/K
norms were split (`shard_norms`), and the tiny checkpoint's config it was drafted from, so a test can redraft the same
module tree and fail when the drafter's output drifts from what was verified; and the context-parallel plan that
matched one process at tp=2 x ulysses=2 (`cp_plan`: drafted, as text, or "stock"), else why none did (`cp_miss`).
"""

from __future__ import annotations

import ast
import json
import re
from functools import lru_cache
from pathlib import Path

import torch
from diffusers.hooks.tensor_parallel import PackedColwiseParallel, PackedRowwiseParallel

from ..compat.privates import ContextParallelInput, ContextParallelOutput
from ..tp_plans.styles import GatheredColwiseParallel, ShardedRMSNorm

PATH = Path(__file__).with_name("verified_plans.json")
#: The style classes a drafted plan uses, by the name its text writes.
STYLES = {cls.__name__: cls for cls in (PackedColwiseParallel, PackedRowwiseParallel, GatheredColwiseParallel,
                                        ShardedRMSNorm)}
_CALL = re.compile(r"^(\w+)\((.*)\)$")
#: The entries a context-parallel plan holds, by the name their `repr` writes.
CP_ENTRIES = {cls.__name__: cls for cls in (ContextParallelInput, ContextParallelOutput)}


def style_text(style) -> str:
    """A style as plan-file source: `"colwise"`, `PackedRowwiseParallel([1, 4])`, `GatheredColwiseParallel()`."""
    if isinstance(style, str):
        return f'"{style}"'
    blocks = getattr(style, "blocks", None)
    if type(style).__name__.startswith("Packed"):
        return f"{type(style).__name__}({blocks!r})" if blocks is not None else f"{type(style).__name__}()"
    return repr(style)


def style_from_text(text: str):
    """The style `style_text` wrote (only the drafter's styles, arguments as literals: no code is run)."""
    if text.startswith('"'):
        return ast.literal_eval(text)
    match = _CALL.match(text)
    if match is None or match.group(1) not in STYLES:
        raise ValueError(f"'{text}' is not a style a drafted plan uses ({', '.join(STYLES)})")
    args = ast.literal_eval(f"[{match.group(2)}]")
    return STYLES[match.group(1)](*args)


def plan_text(plan: dict) -> dict[str, str]:
    return {rule: style_text(style) for rule, style in plan.items()}


@lru_cache(maxsize=1)
def shipped() -> dict:
    """The shipped file's contents (`{}` when none was generated)."""
    return json.loads(PATH.read_text()) if PATH.is_file() else {}


def verified_plan(model_class: str) -> tuple[dict, bool] | None:
    """(the verified plan of `model_class`, whether its Q/K norms are split), or None when none was verified."""
    entry = shipped().get("plans", {}).get(model_class)
    if entry is None:
        return None
    return {rule: style_from_text(text) for rule, text in entry["plan"].items()}, entry["shard_norms"]


def _cp_entry(node: ast.AST):
    """A `ContextParallelInput(...)` / `ContextParallelOutput(...)` (or a list of them) from its `repr`: keyword
    literals only, no code is run."""
    if isinstance(node, ast.List):
        return [_cp_entry(element) for element in node.elts]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CP_ENTRIES and not node.args:
        return CP_ENTRIES[node.func.id](**{k.arg: ast.literal_eval(k.value) for k in node.keywords})
    raise ValueError(f"'{ast.unparse(node)}' is not an entry a context-parallel plan holds ({', '.join(CP_ENTRIES)})")


def cp_plan_from_text(plan: dict) -> dict:
    """The CP plan `drafting.context.plan_text` wrote."""
    read = lambda text: _cp_entry(ast.parse(text, mode="eval").body)  # noqa: E731
    return {module: {param: read(text) for param, text in entry.items()} if isinstance(entry, dict) else read(entry)
            for module, entry in plan.items()}


def fitted(cp_plan: dict, model: torch.nn.Module) -> dict:
    """A CP plan drafted on a tiny instance, for `model`: a gather at a block list's last block (`blocks.1` in a
    tiny list of 2) moved to `model`'s last block of that list. Every other key names a list's first block, all its
    blocks or a module by name, the same at any depth."""
    fit = {}
    for key, entry in cp_plan.items():
        name, _, index = key.rpartition(".")
        blocks = getattr(model, name, None) if index.isdigit() and not isinstance(entry, dict) else None
        fit[f"{name}.{len(blocks) - 1}" if isinstance(blocks, torch.nn.ModuleList) else key] = entry
    return fit


def verified_cp_plan(model_class: str) -> tuple[dict | str | None, str | None]:
    """(the CP plan of `model_class` verified at tp=2 x ulysses=2 composed with its drafted TP plan: a drafted one,
    or "stock" for diffusers' `_cp_plan`; None if none was, with why)."""
    entry = shipped().get("plans", {}).get(model_class)
    if entry is None:
        return None, "its drafted tensor-parallel plan was not verified, so no context-parallel plan was tried"
    if "cp_plan" not in entry:
        return None, entry.get("cp_miss", "no context-parallel plan was verified")
    return entry["cp_plan"] if entry["cp_plan"] == "stock" else cp_plan_from_text(entry["cp_plan"]), None
