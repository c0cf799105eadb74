"""The tensor-parallel plan a load uses, by name ("default", "lean" or "stock") or as a plan file (`FILE.py`).

Each family's default plan issues no more collectives per forward than diffusers' own and holds the least memory
per rank that allows. Where memory and speed trade (Qwen-Image-2.1: sharding its shared modulation and text
projection saves 0.19 GiB per rank at TP=8 for two more collectives), the default takes speed and the memory-lean
plan is asked for by name. The plans are data (`tp_plans/<family>.py`: `PLAN`, `LEAN_PLAN`); this module only
names them, so `load_pipeline(plan=...)`, `generate --plan` and `plan report --plan` refuse the same names with the
same words, before any weight is read.

A plan file (what `plan draft --out FILE` writes, reviewed or edited by hand) assigns `PLAN` and, optionally,
`MODEL_CLASS`, like `tp_plans/flux.py`; it runs as a module of `tp_plans` (so `from .styles import ...` works) and
is refused when written for another transformer class.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import diffusers

from .. import families, tp_plans
from ..compat.plans import stock_plan

#: What `plan=` / `--plan` accept, besides a plan file.
VARIANTS = ("default", "lean", "stock")


@dataclass(frozen=True)
class PlanFile:
    """A plan file's rules, the model class it is written for (if it says) and its content's sha256."""

    path: Path
    rules: dict
    model_class: str | None
    sha256: str


def is_plan_file(plan: str) -> bool:
    return str(plan).endswith(".py")


def read_plan_file(path: str | Path) -> PlanFile:
    """The `PLAN` (and optional `MODEL_CLASS`) of a plan file, run as a module of `tp_plans` (not registered in it)."""
    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        raise FileNotFoundError(f"Plan file {path} does not exist. Write one with `neuron-diffusers plan draft MODEL "
                                "--out FILE.py`, or pass a .py file that assigns `PLAN = {...}` like "
                                "neuron_diffusers/tp_plans/flux.py.")
    module_spec = importlib.util.spec_from_file_location(f"{tp_plans.__name__}.{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    rules = getattr(module, "PLAN", None)
    if not isinstance(rules, dict) or not rules:
        raise ValueError(f"{path} assigns no non-empty `PLAN` dict: a plan file maps module-path globs to styles, "
                         "e.g. `PLAN = {\"transformer_blocks.*.attn.to_q\": \"colwise\", ...}`.")
    return PlanFile(path, rules, getattr(module, "MODEL_CLASS", None), hashlib.sha256(path.read_bytes()).hexdigest())


def file_plan(family: families.Family, path: str) -> PlanFile:
    """A plan file for `family`'s transformer: refused when its `MODEL_CLASS` names another class."""
    plan = read_plan_file(path)
    if plan.model_class is not None:
        written_for = getattr(diffusers, plan.model_class, None)
        if not isinstance(written_for, type) or not issubclass(family.model_class(), written_for):
            raise ValueError(f"Plan file {path} is written for {plan.model_class} (its MODEL_CLASS), but this "
                             f"checkpoint's transformer is a {family.model_class_name}: draft one for it with "
                             "`neuron-diffusers plan draft CHECKPOINT --out FILE.py`.")
    return plan


def resolved_plan(family: families.Family, plan: str) -> tuple[dict, str]:
    """The plan's table and how outputs record it: its name, or a plan file's path with its content's sha256 (an
    edited file then shows in the metadata; the plan is not in the settings key, as the layout only reorders sums).
    A plan file is read once, so the table and the recorded digest are of the same content."""
    if not is_plan_file(plan):
        return variant_plan(family, plan), plan
    read = file_plan(family, plan)
    return read.rules, f"{plan} (sha256 {read.sha256[:16]})"


def variant_plan(family: families.Family, variant: str) -> dict:
    """The plan called `variant` (or in the plan file `variant`) for `family`'s transformer; a `ValueError` says why
    a name cannot be used."""
    if is_plan_file(variant):
        return file_plan(family, variant).rules
    if variant not in VARIANTS:
        raise ValueError(f"Unknown tensor-parallel plan '{variant}': choose one of {', '.join(VARIANTS)}, or a plan "
                         "file (FILE.py, e.g. from `neuron-diffusers plan draft MODEL --out FILE.py`).")
    if variant == "stock":
        stock = stock_plan(family.model_class())
        if stock is None:
            raise ValueError(f"diffusers ships no tensor-parallel plan for {family.model_class_name} "
                             f"({family.display_name}): stock would load the full model on every rank. Use the "
                             "'default' plan.")
        return stock
    variants = family.plan_variants
    if variant not in variants:
        leaner = [f.display_name for f in families.FAMILIES if variant in f.plan_variants]
        raise ValueError(f"{family.display_name} has no '{variant}' plan: its default plan already holds the least per "
                         "rank without more collectives than stock, so there is nothing to trade. Use the 'default' "
                         f"plan ('{variant}' exists for: {', '.join(leaner) or 'no family'}).")
    return variants[variant]
