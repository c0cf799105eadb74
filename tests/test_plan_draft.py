"""`plan draft`: plans drafted from the module tree verify at TP=2; a wrong draft does not; what the drafter cannot
decide is named, not guessed."""

import diffusers
import pytest
import torch
from diffusers.hooks.tensor_parallel import PackedRowwiseParallel

from neuron_diffusers.cli import main
from neuron_diffusers.drafting import draft_plan
from neuron_diffusers.drafting.proof import verify_drafts
from neuron_diffusers.drafting.tiny import tiny_config
from neuron_diffusers.tools.plan.cases import build_case
from neuron_diffusers.tools.plan.check import check_plan, load_plan
from neuron_diffusers.tools.plan.meta import meta_transformer
from neuron_diffusers.tools.plan.verify import DEFAULT_TOLERANCE

#: The five hand-planned families' classes and the authoring guide's worked example.
HAND_PLANNED = ["FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel",
                "QwenImage21Transformer2DModel", "MiniMaxH3Transformer3DModel", "HunyuanVideoTransformer3DModel"]


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return getattr(diffusers, name)()


def _tiny_draft(case):
    return draft_plan(meta_transformer(str(case.checkpoint / "transformer")).module)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every class's draft, and two wrong drafts, at TP=2 in ONE spawn of 2 CPU ranks (a spawn costs seconds)."""
    entries = {}
    for name in HAND_PLANNED:
        case = build_case(name, tmp_path_factory.mktemp(name))
        entries[name] = (case, _tiny_draft(case).plan)
    flux_case, flux_plan = entries["FluxTransformer2DModel"]
    # A rowwise output turned colwise: its all-reduce is gone, each rank keeps a slice.
    entries["rowwise turned colwise"] = (flux_case, {**flux_plan, "transformer_blocks.*.ff.net.2": "colwise"})
    # Packed parts swapped: cat([attention, MLP hidden]) cut as if the MLP came first. Divides, so `plan check`
    # passes; only the numbers tell.
    swapped = {"single_transformer_blocks.*.proj_out": PackedRowwiseParallel([4, 1])}
    entries["packed parts swapped"] = (flux_case, {**flux_plan, **swapped})
    return verify_drafts(entries)


@pytest.mark.parametrize("name", HAND_PLANNED)
def test_the_draft_of_a_hand_planned_class_matches_one_process_at_tp2(results, name):
    result = results[name]
    assert result["ok"], result
    assert result["diff"] < DEFAULT_TOLERANCE
    assert result["sharded"] > 0.7


def test_a_wrong_draft_fails_verification(results):
    assert not results["rowwise turned colwise"]["ok"]
    swapped = results["packed parts swapped"]
    assert not swapped["ok"] and swapped["diff"] > 1000 * DEFAULT_TOLERANCE, swapped


@pytest.mark.parametrize("name", HAND_PLANNED)
def test_the_full_size_draft_passes_plan_check_and_shards_evenly_at_tp8(name):
    model = _meta(name)
    draft = draft_plan(model)
    assert draft.check_errors == [] and check_plan(model, draft.plan).errors == []
    assert 8 in draft.degrees, draft.degrees


def test_flux_draft_reads_the_roles_the_hand_plan_names():
    model = _meta("FluxTransformer2DModel")
    plan = draft_plan(model).plan
    assert plan["transformer_blocks.*.attn.to_q"] == "colwise"
    assert plan["transformer_blocks.*.attn.to_add_out"] == "rowwise"
    assert plan["transformer_blocks.*.ff.net.2"] == "rowwise"
    assert type(plan["transformer_blocks.*.norm1.linear"]).__name__ == "GatheredColwiseParallel"
    packed = plan["single_transformer_blocks.*.proj_out"]
    # cat(attention, 4 x MLP hidden): blocks the model declares on the Linear (`_tp_packed_row_blocks`), else by shape
    blocks = packed.blocks or model.single_transformer_blocks[0].proj_out._tp_packed_row_blocks
    assert isinstance(packed, PackedRowwiseParallel) and [b // min(blocks) for b in blocks] == [1, 4]


def test_norms_across_all_heads_are_named_not_guessed():
    draft = draft_plan(_meta("WanTransformer3DModel"))
    undecided = {note.module: note.reason for note in draft.undecided}
    assert "normalizes over 5120 features, not one head (128)" in undecided["blocks.*.attn1"]
    assert not any(".attn1." in rule or ".attn2." in rule for rule in draft.plan)  # left whole, not guessed
    assert draft.plan["blocks.*.ffn.net.2"] == "rowwise"  # the rest is still drafted


def test_blocks_that_differ_get_rules_per_block():
    """SD3's last block has no text output: a '*' rule would not fit it, so each block gets its own rules."""
    draft = draft_plan(_meta("SD3Transformer2DModel"))
    assert "transformer_blocks.16.attn.to_add_out" in draft.plan
    assert "transformer_blocks.17.attn.to_add_out" not in draft.plan
    assert draft.check_errors == []


def test_tiny_config_shrinks_blocks_heads_and_widths():
    config = tiny_config(diffusers.FluxTransformer2DModel)
    assert (config["num_layers"], config["num_single_layers"]) == (2, 2)
    assert (config["num_attention_heads"], config["attention_head_dim"]) == (4, 16)
    assert sum(config["axes_dims_rope"]) == 16 and all(axis % 2 == 0 for axis in config["axes_dims_rope"])


def test_cli_writes_a_plan_file_that_plan_check_accepts(tmp_path, capsys):
    out = tmp_path / "drafted_flux.py"
    assert main(["plan", "draft", "FluxTransformer2DModel", "--no-verify", "--out", str(out)]) == 0
    assert "PLAN = {" in capsys.readouterr().out
    plan = load_plan(str(out))
    assert plan.model_class == "FluxTransformer2DModel"
    assert check_plan(_meta("FluxTransformer2DModel"), plan.rules).errors == []
    assert main(["plan", "check", str(out)]) == 0


def test_cli_refuses_a_model_and_all_together(capsys):
    assert main(["plan", "draft", "FluxTransformer2DModel", "--all"]) == 2
    assert "not both" in capsys.readouterr().err
