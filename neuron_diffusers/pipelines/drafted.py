"""The family of a stock pipeline no family runs: its transformer's plan verified by `plan draft --all` (shipped in
the package, `drafting/shipped.py`) where the checkpoint's module tree drafts to it, else drafted at load (meta device).

`checkpoint` cannot import the drafter (the plan tools it uses read checkpoints themselves), so the runner hands
`drafted_family` to it at import (`checkpoint.set_drafter`), as `families` hands block metadata to the step cache.
"""

from __future__ import annotations

import inspect

from ..families import PipelineClass
from .generic import DraftedFamily


def drafted_family(pipeline_class: type, transformer_folder) -> DraftedFamily:
    """The drafted family of `pipeline_class` on the transformer saved in `transformer_folder` (its config only,
    on the meta device); a `ValueError` says why a class cannot run on a drafted plan."""
    from ..tools.plan.meta import meta_transformer  # the plan tools: imported when a folder needs them

    name = pipeline_class.__name__
    if "callback_on_step_end" not in inspect.signature(pipeline_class.__call__).parameters:
        raise ValueError(f"{name} takes no `callback_on_step_end`, which the check that every rank holds the same "
                         "latents runs in: it cannot run on several ranks here.")
    meta = meta_transformer(str(transformer_folder)).module
    draft, verified = _draft(meta)
    if not draft.plan or draft.check_errors:
        why = draft.check_errors[:2] or [f"{n.module}: {n.reason}" for n in draft.undecided[:2]] or [
            "no Linear has a role the drafter knows"]
        raise ValueError(
            f"{name} runs a {type(meta).__name__}, for which no tensor-parallel plan can be drafted: "
            f"{'; '.join(why)}. Write one by hand (docs/authoring.md) and register a family, or run it in one "
            "process with stock diffusers.")
    context_plan, routes, refusal = _context(meta)
    return DraftedFamily("generic", f"{name} (drafted plan)", "GenericAdapter", pipelines=(PipelineClass(name),),
                         transformer=type(meta).__name__, drafted=draft.plan, degrees=tuple(draft.degrees),
                         verified=verified, context_plan=context_plan, routes_attention=routes, cp_refusal=refusal)


def _context(meta) -> tuple[dict | None, bool, str | None]:
    """(the drafted CP plan to load with, None for diffusers' own; whether attention is routed; why the class cannot
    run context-parallel, or None): what `plan draft --all` verified at tp=2 x ulysses=2 for the class, with the
    processors that call SDPA themselves routed through diffusers' dispatch (as the proof ran it) where the plan's
    region holds any. Read from the class and its meta-device module tree: no weight."""
    from ..compat.attention_route import bypassing
    from ..compat.plans import cp_plan_of
    from ..drafting.shipped import fitted, verified_cp_plan

    plan, miss = verified_cp_plan(type(meta).__name__)
    if plan is None:
        return None, False, miss
    plan = cp_plan_of(type(meta)) if plan == "stock" else fitted(plan, meta)
    return (None if plan is cp_plan_of(type(meta)) else plan), bool(bypassing(meta, plan)), None


def _draft(meta):
    """(the plan, whether it is the one verified at TP=2): the shipped verified plan where this checkpoint's module
    tree drafts to exactly it (same rules, same Q/K norm choice), else a fresh draft with Q/K norms over all heads
    left whole: splitting them (`ShardedRMSNorm`) is exact only where the processor does not also read the whole
    width (rotary embeddings over all heads: LTX-Video), which only a TP=2 run tells (`plan draft --all` runs it)."""
    from ..drafting import draft_plan
    from ..drafting.shipped import plan_text, verified_plan

    shipped = verified_plan(type(meta).__name__)
    if shipped is not None:
        plan, shard_norms = shipped
        draft = draft_plan(meta, shard_norms=shard_norms)
        if not draft.check_errors and plan_text(draft.plan) == plan_text(plan):
            return draft, True
    return draft_plan(meta, shard_norms=False), False
