"""`plan draft`: plans drafted from the module tree verify at TP=2; a wrong draft does not; what the drafter cannot
decide is named, not guessed."""

import diffusers
import pytest
import torch
from diffusers.hooks.tensor_parallel import PackedRowwiseParallel
from diffusers.models.attention_processor import Attention

from neuron_diffusers.cli import main
from neuron_diffusers.drafting import draft_plan, proof, tiny
from neuron_diffusers.drafting.context import draft_cp_plans, plan_text
from neuron_diffusers.drafting.proof import verify_cp, verify_drafts
from neuron_diffusers.drafting.tiny import tiny_case, tiny_config
from neuron_diffusers.tools.plan import draft as draft_cli
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
def results(tmp_path_factory, pooled):
    """Every class's draft, and two wrong drafts, at TP=2 in ONE job of the session's 2 ranks (a spawn costs
    seconds)."""
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
    with pooled(proof):
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


def test_norms_across_all_heads_are_split_with_sharded_rms_norm():
    draft = draft_plan(_meta("WanTransformer3DModel"))
    assert type(draft.plan["blocks.*.attn1.norm_q"]).__name__ == "ShardedRMSNorm"
    assert draft.plan["blocks.*.attn1.to_q"] == "colwise" and draft.check_errors == []
    # control: the fallback leaves those attentions whole and names why, not guessing
    whole = draft_plan(_meta("WanTransformer3DModel"), shard_norms=False)
    undecided = {note.module: note.reason for note in whole.undecided}
    assert "normalizes over 5120 features, not one head (128)" in undecided["blocks.*.attn1"]
    assert not any(".attn1." in rule or ".attn2." in rule for rule in whole.plan)
    assert whole.plan["blocks.*.ffn.net.2"] == "rowwise"  # the rest is still drafted


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


@pytest.fixture(scope="module")
def wan_cp(tmp_path_factory, pooled):
    """Wan's tiny instance: its CP candidates, and the drafted CP plan and a wrong one at tp=2 x ulysses=2 in ONE
    job of the session's 4 ranks."""
    case = tiny_case(diffusers.WanTransformer3DModel, tmp_path_factory.mktemp("wan"))
    model = diffusers.WanTransformer3DModel.from_pretrained(case.checkpoint, subfolder="transformer").eval()
    drafted = draft_cp_plans(model, case.kwargs, case.args)
    tp_plan = _tiny_draft(case).plan
    # Wrong: the cross-attention text split too, where Wan's processor attends each query to the whole text.
    entries = {"drafted": (case, tp_plan, drafted.candidates),
               "text split": (case, tp_plan, {"text split": drafted.candidates["blocks, text split"]})}
    with pooled(proof):
        return drafted, verify_cp(entries)


def test_cp_draft_splits_flowing_inputs_once_and_shared_inputs_at_every_block(wan_cp):
    drafted, _ = wan_cp
    plan = plan_text(drafted.candidates["blocks, text whole"])
    assert set(plan["blocks.0"]) == {"hidden_states"}  # flows from block to block: split once
    assert set(plan["blocks.*"]) == {"rotary_emb"}  # the same tensor for every block: split at each
    assert plan["proj_out"] == "ContextParallelOutput(gather_dim=1, expected_dims=3)"


def test_the_drafted_cp_plan_matches_one_process_at_tp2_ulysses2(wan_cp):
    result = wan_cp[1]["drafted"]
    assert result["plan"] == "blocks, text whole", result
    assert result["tried"][result["plan"]]["diff"] < DEFAULT_TOLERANCE


def test_a_wrong_cp_plan_fails_verification(wan_cp):
    result = wan_cp[1]["text split"]
    assert result["plan"] is None and result["tried"]["text split"]["diff"] > 1000 * DEFAULT_TOLERANCE, result


@pytest.fixture(scope="module")
def pixart_cp(tmp_path_factory, pooled):
    """PixArt's tiny instance, whose processor calls SDPA itself: its drafted CP plans at tp=2 x ulysses=2 with the
    processors routed through diffusers' dispatch, and (control) the same plans with them left as they are."""
    case = tiny_case(diffusers.PixArtTransformer2DModel, tmp_path_factory.mktemp("pixart"))
    model = diffusers.PixArtTransformer2DModel.from_pretrained(case.checkpoint, subfolder="transformer").eval()
    drafted = draft_cp_plans(model, case.kwargs, case.args)
    entries = {"pixart": (case, _tiny_draft(case).plan, drafted.candidates)}
    with pooled(proof):
        return drafted, verify_cp(entries)["pixart"], verify_cp(entries, route=False)["pixart"]


def test_attention_that_bypasses_dispatch_is_routed_and_matches_one_process_at_tp2_ulysses2(pixart_cp):
    drafted, routed, _ = pixart_cp
    assert drafted.candidates and routed["plan"] is not None, routed
    assert routed["tried"][routed["plan"]]["diff"] < DEFAULT_TOLERANCE


def test_without_the_route_each_rank_attends_to_its_own_slice_and_differs(pixart_cp):
    _, _, unrouted = pixart_cp
    assert unrouted["plan"] is None, unrouted
    assert all(r.get("diff", 0.0) > 1000 * DEFAULT_TOLERANCE for r in unrouted["tried"].values()), unrouted


def test_plan_draft_of_a_folder_verifies_the_folders_config(tmp_path, monkeypatch, capsys):
    config = {**tiny_config(diffusers.FluxTransformer2DModel), "num_layers": 1, "guidance_embeds": True}
    diffusers.FluxTransformer2DModel.from_config(config).save_pretrained(tmp_path / "transformer")
    seen = []
    monkeypatch.setattr(draft_cli, "_verify_one", lambda name, base: seen.append(base) or {"ok": True, "diff": 0.0})
    assert main(["plan", "draft", str(tmp_path)]) == 0
    shrunk = tiny_config(diffusers.FluxTransformer2DModel, seen[0])
    assert (shrunk["num_layers"], shrunk["guidance_embeds"]) == (1, True)
    # control: a class name verifies its default config (2 tiny blocks, no guidance embedding)
    assert main(["plan", "draft", "FluxTransformer2DModel"]) == 0 and seen[1] is None
    default = tiny_config(diffusers.FluxTransformer2DModel)
    assert (default["num_layers"], default["guidance_embeds"]) == (2, False)


def test_zero_initialized_weights_are_redrawn_so_the_tiny_output_varies(tmp_path, monkeypatch):
    varied = tiny_case(diffusers.ErnieImageTransformer2DModel, tmp_path / "a")
    assert varied.expected[0].std() > 0.01
    monkeypatch.setattr(tiny, "_redraw_zeros", lambda model: None)  # control: as initialized, it is constant
    constant = tiny_case(diffusers.ErnieImageTransformer2DModel, tmp_path / "b")
    assert constant.expected[0].std() == 0


class _Joint(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention(query_dim=8, heads=2, dim_head=4)

    def forward(self, hidden_states, encoder_hidden_states):
        joint = self.attn(torch.cat([encoder_hidden_states, hidden_states], dim=1))
        return joint[:, :encoder_hidden_states.shape[1]], joint[:, encoder_hidden_states.shape[1]:]


class _Single(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention(query_dim=8, heads=2, dim_head=4)

    def forward(self, hidden_states):
        return hidden_states + self.attn(hidden_states)


class _JointThenSingle(torch.nn.Module):
    """AuraFlow's shape (joint blocks, then single blocks on their concatenated output), then Latte's (temporal
    blocks attending over another axis of the tokens, per position)."""

    def __init__(self):
        super().__init__()
        self.joint_blocks = torch.nn.ModuleList([_Joint(), _Joint()])
        self.single_blocks = torch.nn.ModuleList([_Single(), _Single()])
        self.temporal_blocks = torch.nn.ModuleList([_Single(), _Single()])
        self.proj_out = torch.nn.Linear(8, 8)

    def forward(self, hidden_states, encoder_hidden_states):
        for block in self.joint_blocks:
            encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states)
        tokens = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        for block in self.single_blocks:
            tokens = block(tokens)
        frames = tokens[:, encoder_hidden_states.shape[1]:].reshape(3, 2, 8)
        for block in self.temporal_blocks:
            frames = block(frames)
        return self.proj_out(frames.reshape(1, 6, 8))


def test_a_later_list_fed_the_split_sequence_is_named_so_its_attention_is_routed():
    from neuron_diffusers.compat.attention_route import bypassing

    model = _JointThenSingle().eval()
    drafted = draft_cp_plans(model, {"hidden_states": torch.randn(1, 6, 8),
                                     "encoder_hidden_states": torch.randn(1, 4, 8)})
    plan = drafted.candidates["blocks, text split"]
    assert set(plan_text(plan)["joint_blocks.0"]) == {"hidden_states", "encoder_hidden_states"}
    assert plan["single_blocks.0"] == {}  # nothing more to split, but it sees the split sequence
    assert not any(key.startswith("temporal_blocks") for key in plan)  # 2 frames a position: stays local
    routed = bypassing(model, plan)
    assert routed == [*(b.attn for b in model.joint_blocks), *(b.attn for b in model.single_blocks)]
