"""`plan verify`: the worked example (HunyuanVideo) matches one process at TP=2 and 4; wrong plans do not."""

import pytest
from diffusers.hooks.tensor_parallel import PackedRowwiseParallel

from neuron_diffusers.cli import main
from neuron_diffusers.tools.plan import verify
from neuron_diffusers.tools.plan.check import check_plan
from neuron_diffusers.tools.plan.meta import meta_transformer
from neuron_diffusers.tools.plan.verify import DEFAULT_TOLERANCE, verify_plans
from neuron_diffusers.tp_plans.hunyuanvideo import PLAN

WRONG_PROPORTIONS = {**PLAN, "single_transformer_blocks.*.proj_out": PackedRowwiseParallel([1, 3])}
NO_ROWWISE_PARTNER = {rule: style for rule, style in PLAN.items() if rule != "transformer_blocks.*.ff.net.2"}


@pytest.fixture(scope="module")
def results(pooled):
    """Every plan at TP=2 and TP=4 in one job of the session's 4 ranks (a spawn of its own costs seconds of
    imports)."""
    plans = {"ours": PLAN, "wrong proportions": WRONG_PROPORTIONS, "no rowwise partner": NO_ROWWISE_PARTNER}
    with pooled(verify):
        return verify_plans("hunyuanvideo", plans, degrees=(2, 4))


@pytest.mark.parametrize("tp", [2, 4])
def test_worked_example_matches_one_process(results, tp):
    result = results["ours"][tp]
    assert result["diff"] < DEFAULT_TOLERANCE, result
    assert result["sharded"] > 0.8  # the tiny model's embedders are a larger share than at full size


@pytest.mark.parametrize("tp", [2, 4])
def test_wrong_packed_proportions_pass_the_check_but_not_verify(results, tp):
    assert check_plan(meta_transformer("hunyuanvideo").module, WRONG_PROPORTIONS).errors == []
    assert results["wrong proportions"][tp]["diff"] > 1000 * DEFAULT_TOLERANCE  # runs fine, numbers wrong


@pytest.mark.parametrize("tp", [2, 4])
def test_a_colwise_without_its_rowwise_partner_is_caught_by_both(results, tp):
    assert [f.rule for f in check_plan(meta_transformer("hunyuanvideo").module, NO_ROWWISE_PARTNER).errors] == [
        "transformer_blocks.*.ff.net.0.proj"]
    assert "shapes cannot be multiplied" in results["no rowwise partner"][tp]["error"]


def test_cli_verifies_a_shipped_family_on_its_tiny_pipeline(capsys, pooled):
    with pooled(verify):
        assert main(["plan", "verify", "flux", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("flux plan on a tiny random FluxTransformer2DModel")
    assert out.rstrip().endswith(f"OK: within {DEFAULT_TOLERANCE:g} at every degree")


@pytest.mark.parametrize(
    "args, message",
    [
        (["hunyuanvideo", "--tp", "3"], "Degrees it can verify: [2, 4]"),
        (["hunyuanvideo", "--tp", "1"], "give degrees of 2 or more"),
        (["hunyuanvideo", "--model", "SD3Transformer2DModel"], "no tiny model of 'SD3Transformer2DModel'"),
    ],
)
def test_what_cannot_be_verified_is_refused_before_spawning(capsys, args, message):
    assert main(["plan", "verify", *args]) == 2
    assert message in capsys.readouterr().err
