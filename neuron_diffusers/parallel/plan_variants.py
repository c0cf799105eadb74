"""The tensor-parallel plan a load uses, by name: "default", "lean" or "stock".

Each family's default plan issues no more collectives per forward than diffusers' own and holds the least memory
per rank that allows. Where memory and speed trade (Qwen-Image-2.1: sharding its shared modulation and text
projection saves 0.19 GiB per rank at TP=8 for two more collectives), the default takes speed and the memory-lean
plan is asked for by name. The plans are data (`tp_plans/<family>.py`: `PLAN`, `LEAN_PLAN`); this module only
names them, so `load_pipeline(plan=...)`, `generate --plan` and `plan report --plan` refuse the same names with the
same words, before any weight is read.
"""

from __future__ import annotations

from .. import families
from ..compat.plans import stock_plan

#: What `plan=` / `--plan` accept.
VARIANTS = ("default", "lean", "stock")


def variant_plan(family: families.Family, variant: str) -> dict:
    """The plan called `variant` for `family`'s transformer; a `ValueError` says why a name cannot be used."""
    if variant not in VARIANTS:
        raise ValueError(f"Unknown tensor-parallel plan '{variant}': choose one of {', '.join(VARIANTS)}.")
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
