"""Rank jobs for tests/test_plans.py, run on the session's pool of 4 ranks (`rank_pool`): one job a family, each
(plan, degree) its own case (`rank_cases.record`), so a plan that fails fails only the tests that read it."""

from __future__ import annotations

from rank_cases import one_thread, record
from rank_jobs import _load_tp, _max_diff, _shard_report


def _plan_case(checkpoint, mesh, call, plan_of_class) -> dict:
    """Load with the class's plan now (`plan_of_class(cls)`: is it ours?) and compare to one process."""
    cls, model = _load_tp(checkpoint, mesh["tp"])
    tp = mesh["tp"].size()
    return {"diff": _max_diff(model, call), "ours": plan_of_class(cls), **_shard_report(model, cls._tp_plan, tp)}


def _variant_case(checkpoint, mesh, call, plan) -> dict:
    from neuron_diffusers import using_plan
    from neuron_diffusers.checkpoint import resolve

    cls = resolve(checkpoint).transformer_class()
    with using_plan(cls, plan):
        _, model = _load_tp(checkpoint, mesh["tp"])
    return {"diff": _max_diff(model, call), "ours": True, **_shard_report(model, plan, mesh["tp"].size())}


def _local_heads(checkpoint, mesh) -> set:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Attention

    _, model = _load_tp(checkpoint, mesh["tp"])
    return {m.heads for m in model.modules() if isinstance(m, MiniMaxH3Attention)}


def plan_checks(family: str, checkpoint, call) -> dict:
    """Our plans for one family at TP=2 and TP=4 (on 4 ranks): the default one (the class default once imported)
    under `report[family, tp]`, each other variant (`lean`) under `report[(family, variant), tp]`; MiniMax-H3's
    local attention heads under `report["h3_heads", tp]`."""
    import neuron_diffusers as nd
    from neuron_diffusers import families

    record_of = families.get(family)
    report = {}
    with one_thread():
        for tp in (2, 4):
            mesh = nd.init_distributed(tp=tp)
            record(report, (family, tp), _plan_case, checkpoint, mesh, call, lambda cls: cls._tp_plan is record_of.plan)
            for variant, plan in record_of.plan_variants.items():
                if variant != "default":
                    record(report, ((family, variant), tp), _variant_case, checkpoint, mesh, call, plan)
            if family == "h3":
                record(report, ("h3_heads", tp), _local_heads, checkpoint, mesh)
    return report


class _ThreeRankMesh:
    device_type, ndim = "cpu", 1

    def size(self):
        return 3


def _refusal(cls, checkpoint, plan, mesh) -> str:
    """What `from_pretrained` says to `plan` on `mesh`, reading no weight (any read raises)."""
    import safetensors
    from diffusers import TensorParallelConfig

    from neuron_diffusers import using_plan

    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before the plan was checked")

    stock_open = safetensors.safe_open
    safetensors.safe_open = no_reads
    try:
        with using_plan(cls, plan):
            cls.from_pretrained(checkpoint, subfolder="transformer", parallel_config=TensorParallelConfig(mesh=mesh))
        return "accepted"
    except (ValueError, AssertionError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        safetensors.safe_open = stock_open


def _missing_key(cls, checkpoint_missing_a_key, mesh) -> str:
    from diffusers import TensorParallelConfig

    try:
        cls.from_pretrained(checkpoint_missing_a_key, subfolder="transformer",
                            parallel_config=TensorParallelConfig(mesh=mesh["tp"]))
        return "accepted"
    except ValueError as error:
        return str(error)


def plan_refusals(flux, checkpoint_missing_a_key) -> dict:
    """The checks made before any weight is read (a typo in a plan, a rule on a non-Linear, a degree the heads do not
    allow), and a checkpoint missing a planned weight: one case each."""
    import neuron_diffusers as nd
    from neuron_diffusers.checkpoint import resolve

    report = {}
    with one_thread():
        cls = resolve(flux).transformer_class()
        mesh = nd.init_distributed(tp=2)
        for label, plan, on in (("typo", {**cls._tp_plan, "transformer_blocks.*.attn.to_qq": "colwise"}, mesh["tp"]),
                                ("not_linear", {**cls._tp_plan, "transformer_blocks.*.attn": "colwise"}, mesh["tp"]),
                                ("heads", cls._tp_plan, _ThreeRankMesh())):
            record(report, label, _refusal, cls, flux, plan, on)
        record(report, "missing_key", _missing_key, cls, checkpoint_missing_a_key, mesh)
    return report

