"""The drafted plans `plan draft --all` verified, shipped as package data (`verified_plans.json`).

A drafted plan counts only once a TP=2 run on a tiny instance matched one process; the generic adapter should load
that plan, not a fresh draft nobody ran. The command writes, per verified class, the plan as text, whether its Q/K
norms were split (`shard_norms`), and the tiny checkpoint's config it was drafted from, so a test can redraft the same
module tree and fail when the drafter's output drifts from what was verified.
"""

from __future__ import annotations

import ast
import json
import re
from functools import lru_cache
from pathlib import Path

from diffusers.hooks.tensor_parallel import PackedColwiseParallel, PackedRowwiseParallel

from ..tp_plans.styles import GatheredColwiseParallel, ShardedRMSNorm

PATH = Path(__file__).with_name("verified_plans.json")
#: The style classes a drafted plan uses, by the name its text writes.
STYLES = {cls.__name__: cls for cls in (PackedColwiseParallel, PackedRowwiseParallel, GatheredColwiseParallel,
                                        ShardedRMSNorm)}
_CALL = re.compile(r"^(\w+)\((.*)\)$")


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
