"""Fewer collectives (issue 8): paired partial sums and hoisted modulation, equal to stock TP."""

import coalesce_jobs
import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

from neuron_diffusers import families, tiny
from neuron_diffusers.parallel import coalesce
from neuron_diffusers.tools.bench import collectives as bench_collectives
from neuron_diffusers.tools.plan.cases import reference_call
from neuron_diffusers.tp_plans import GatheredColwiseParallel, PartialRowwiseParallel

#: Issue 8's ceilings at TP=2 and real depth: (all-reduces, all-gathers) per forward.
DUAL_STREAM = ("flux", "flux2", "qwenimage")
CEILINGS = {"flux": (76, 1), "qwenimage": (120, 1), "flux2": (64, 1), "h3": (2 * (50 + 2), 1)}


def _run(rank_pool, tiny_checkpoint, job, family):
    """`job(checkpoint, reference call)` for `family` on the session's 2 ranks; both ranks' results."""
    checkpoint = tiny_checkpoint(family)
    return rank_pool.run(job, 2, checkpoint, reference_call(checkpoint, family))


#: All-gathers per forward of the default plan: one, of the gathered modulation; Qwen-Image-2.1's default is stock's
#: plan, none (its lean plan gathers, checked against one process in tests/test_plans.py).
GATHERS = {"qwenimage21": 0}


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_equals_stock_tp_and_one_process(rank_pool, tiny_checkpoint, family):
    for entry in _run(rank_pool, tiny_checkpoint, coalesce_jobs.family_check, family):
        assert entry["vs_single"] < 1e-5
        # Stock TP; for MiniMax-H3 (no stock plan) ours with one collective per Linear, as stock would issue them.
        assert entry["vs_stock"] <= 1e-6, entry["vs_stock"]
        assert entry["calls"].get("all_gather", 0) == GATHERS.get(family, 1), entry["calls"]
        if family in DUAL_STREAM:  # paired reductions: fewer calls than the reference on the same inputs
            assert entry["calls"]["all_reduce"] < entry["reference_calls"]["all_reduce"], entry
        assert entry["stale"] == [], "hoisted outputs outlived the forward"


def test_hoisted_linear_refuses_to_run_outside_the_forward(rank_pool, tiny_checkpoint):
    assert "cannot be called on its own" in _run(rank_pool, tiny_checkpoint, coalesce_jobs.called_alone_check,
                                                 "flux")[0]


def test_a_third_attention_output_is_refused_not_dropped(rank_pool, tiny_checkpoint):
    for report in _run(rank_pool, tiny_checkpoint, coalesce_jobs.third_output_check, "flux"):
        assert "IP-Adapter" in report["ip_adapter"] and "returned 3 outputs" in report["ip_adapter"]
        assert report["after_error_stale"] == [] and report["after_error_diff"] < 1e-5


def test_zero_cond_t_reads_half_the_batch(rank_pool, tiny_checkpoint):
    for report in _run(rank_pool, tiny_checkpoint, coalesce_jobs.zero_cond_check, "qwenimage"):
        assert report["diff"] < 1e-5
        assert report["calls"]["all_gather"] == 1


def test_a_misdeclared_hoist_falls_back_to_its_own_gather_and_says_so(rank_pool, tiny_checkpoint):
    misdeclared = _run(rank_pool, tiny_checkpoint, coalesce_jobs.misdeclared_check, "qwenimage")[0]
    assert misdeclared["diff"] < 1e-5
    blocks = 2  # tiny Qwen-Image: one extra gather per txt_mod call
    assert misdeclared["calls"]["all_gather"] == 1 + blocks
    assert any("txt_mod.1's input is not silu(time_text_embed output)" in w for w in misdeclared["warnings"])


def test_failed_setup_restores_classes_and_hooks(rank_pool, tiny_checkpoint):
    for report in _run(rank_pool, tiny_checkpoint, coalesce_jobs.restore_check, "flux"):
        assert report["restored"] and report["restored_diff"] < 1e-5


@pytest.fixture(scope="module")
def full_depth(pooled):
    with pooled(bench_collectives):  # its rank job on the session's 2 ranks, not a spawn of its own
        return bench_collectives.measure(tp=2, repeats=1, depth="full")


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_collectives_per_forward_at_real_depth(full_depth, family):
    figures = full_depth["families"][family]
    ours = figures["default"]["calls"]
    assert ours.get("all_gather", 0) == (0 if family == "qwenimage21" else 1)  # 2.1's default is stock's plan
    if family in CEILINGS:
        reduces, gathers = CEILINGS[family]
        assert ours.get("all_reduce", 0) <= reduces and ours["all_gather"] <= gathers, ours
    if figures["stock"] is not None:
        stock = figures["stock"]["calls"]
        assert ours.get("all_reduce", 0) + ours.get("all_gather", 0) <= stock["all_reduce"]
    if family == "qwenimage21":  # the lean plan: its text MLP's all-reduce and the modulation's all-gather more
        lean = figures["lean"]["calls"]
        assert (lean["all_reduce"], lean["all_gather"]) == (figures["stock"]["calls"]["all_reduce"] + 1, 1)
    assert "vs stock" in bench_collectives.format_table(full_depth)


def _meta(family):
    cls = families.get(family).model_class()
    config = cls.load_config(tiny.cached_tiny(family), subfolder="transformer")
    with torch.device("meta"):
        return cls.from_config(config)


@pytest.mark.parametrize("rule, style, message", [
    ("transformer_blocks.*.attn.to_out.0", PartialRowwiseParallel(reduced_at="ff"), "must name a Linear inside 'ff'"),
    ("proj_out", PartialRowwiseParallel(reduced_at="block"), "inside a ModuleList of blocks"),
    ("norm_out.linear", GatheredColwiseParallel(hoist_from="time_embed"), "is not a module"),
    ("norm_out.linear", GatheredColwiseParallel(hoist_from="time_text_embed", first_half_if="zero_t"),
     "not a config field"),
])
def test_bad_coalescing_rules_are_named(rule, style, message):
    with pytest.raises(ValueError, match=message):
        coalesce.check_plan(_meta("flux"), {rule: style})


def test_block_reduction_needs_a_known_block_and_its_exact_pair():
    flux = _meta("flux")
    with pytest.raises(ValueError, match="no coalesced forward"):
        coalesce.check_plan(flux, {"transformer_blocks.*.ff.net.2": PartialRowwiseParallel(reduced_at="block")})
    with pytest.raises(ValueError, match="MiniMaxH3TransformerBlock"):
        coalesce.check_plan(_meta("h3"), {"transformer_blocks.*.ff.net.2": PartialRowwiseParallel(reduced_at="block")})
    coalesce.check_plan(flux, families.get("flux").plan)


def test_a_changed_stock_block_forward_is_refused(monkeypatch):
    entry = coalesce.COALESCED_FORWARDS[FluxTransformerBlock]
    monkeypatch.setitem(coalesce.COALESCED_FORWARDS, FluxTransformerBlock, entry._replace(digest="0" * 16))
    with pytest.raises(ValueError, match="differs from the diffusers 0.42.1 one"):
        coalesce.check_plan(_meta("flux"), families.get("flux").plan)


def test_styles_compare_as_data():
    assert GatheredColwiseParallel(hoist_from="a") == GatheredColwiseParallel(hoist_from="a")
    assert GatheredColwiseParallel(hoist_from="a") != GatheredColwiseParallel()
    assert len({PartialRowwiseParallel("attn"), PartialRowwiseParallel("attn")}) == 1
    assert repr(PartialRowwiseParallel("attn")) == "PartialRowwiseParallel(reduced_at='attn')"
    with pytest.raises(ValueError, match="give hoist_from"):
        GatheredColwiseParallel(first_half_if="zero_cond_t")
