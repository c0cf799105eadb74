"""Collectives counted at run time equal what `plan report` counts from the plan, for every family and plan."""

import pytest

from neuron_diffusers import tiny
from neuron_diffusers.tools.bench import collectives as bench_collectives
from neuron_diffusers.tools.plan import report as plan_report


@pytest.fixture(scope="module")
def measured(pooled):
    with pooled(bench_collectives):  # its rank job counts and returns only: the session's 2 ranks, not a spawn
        return bench_collectives.measure(tp=2, repeats=1)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_runtime_counts_match_the_static_plan_report(measured, family):
    checkpoint = str(tiny.cached_tiny(family))
    plans = [plan for plan in ("default", "lean", "stock") if plan in measured["families"][family]]
    assert ("lean" in plans) == (family == "qwenimage21")
    for plan in plans:
        figures = measured["families"][family][plan]
        if figures is None:  # no stock plan (MiniMax-H3, Wan: diffusers ships none)
            assert plan == "stock" and family in ("h3", "wan")
            continue
        static = plan_report.plan_report(checkpoint, 2, plan)
        assert figures["calls"].get("all_reduce", 0) == static["all_reduces_per_forward"], plan
        assert figures["calls"].get("all_gather", 0) == static["all_gathers_per_forward"], plan
        assert figures["seconds_per_forward"] > 0 and sum(figures["bytes"].values()) > 0


def test_counter_sees_a_plain_torch_distributed_all_reduce():
    import torch

    assert bench_collectives._kind("c10d::allreduce_") == "all_reduce"
    assert bench_collectives._kind("_c10d_functional::all_gather_into_tensor") == "all_gather"
    assert bench_collectives._kind("_c10d_functional::wait_tensor") is None
    assert bench_collectives._kind("aten::add.Tensor") is None
    counter = bench_collectives.CollectiveCounter()
    with counter:
        torch.ones(2) + 1
    assert not counter.calls


def test_table_renders(measured):
    table = bench_collectives.format_table(measured)
    assert "| flux | default |" in table and "no stock plan" in table
