"""The coverage table and the verified plans shipped with the package: written by `plan draft --all`, equal to what
the drafter produces today, and (a sample) still equal to one process at TP=2.

The full run (75 classes, minutes of CPU ranks) is the command's job, not CI's: here the stored outputs are checked
against each other and against today's drafter on the meta device, and two shipped plans are re-run at TP=2 with a
wrong plan beside them that must fail.
"""

import json
from pathlib import Path

import diffusers
import pytest
import torch

from neuron_diffusers.drafting import draft_plan, shipped
from neuron_diffusers.drafting.context import plan_text
from neuron_diffusers.drafting.coverage import transformer_classes
from neuron_diffusers.drafting.proof import verify_drafts
from neuron_diffusers.drafting.tiny import DEFAULT_CONFIG_GAPS, UNCONFIRMED_GAPS, tiny_case
from neuron_diffusers.tools.plan.draft import coverage_markdown, cp_verified_row
from neuron_diffusers.tools.plan.verify import DEFAULT_TOLERANCE

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: Shipped plans re-run at TP=2 here (cheap tiny cases; the hand-planned classes run in test_plan_draft.py).
SAMPLE = ["CogView4Transformer2DModel", "StableAudio3DiTModel"]


@pytest.fixture(scope="module")
def table() -> dict:
    return json.loads((DOCS / "coverage.json").read_text())


def _verified(table) -> dict:
    return {r["class"]: r for r in table["rows"] if r.get("verified", {}).get("ok")}


def test_the_table_is_the_commands_output_for_every_transformer_class(table):
    assert table["command"] == "neuron-diffusers plan draft --all --json"
    assert table["diffusers"] == diffusers.__version__ and table["date"].endswith("UTC")
    assert [r["class"] for r in table["rows"]] == transformer_classes()
    markdown = (DOCS / "coverage.md").read_text()
    assert markdown == coverage_markdown(table["rows"], {k: v for k, v in table.items() if k != "rows"})


def test_every_miss_has_a_reason(table):
    for row in table["rows"]:
        if not row.get("verified", {}).get("ok"):
            assert row.get("miss"), row["class"]
        elif not cp_verified_row(row):
            assert row.get("cp_miss"), row["class"]


def test_full_size_values_diffusers_does_not_state_are_marked_unconfirmed(table):
    marked = {r["class"]: r["config_unconfirmed"] for r in table["rows"] if r.get("config_unconfirmed")}
    assert marked == UNCONFIRMED_GAPS and set(UNCONFIRMED_GAPS) <= set(DEFAULT_CONFIG_GAPS)
    lines = {line.split(" | ")[0].strip("| "): line for line in (DOCS / "coverage.md").read_text().splitlines()
             if line.startswith("| ")}
    assert all("(unconfirmed)" in lines[name] for name in marked)


def test_the_shipped_plans_are_the_verified_ones_of_the_same_run(table):
    data = shipped.shipped()
    assert {k: data[k] for k in ("command", "date", "diffusers")} == {k: table[k] for k in ("command", "date",
                                                                                           "diffusers")}
    verified = _verified(table)
    assert set(data["plans"]) == set(verified)
    for name, entry in data["plans"].items():
        assert entry["plan"] == verified[name]["tiny_plan"], name
        assert entry["tp2_diff"] <= DEFAULT_TOLERANCE


def test_the_shipped_plans_equal_what_the_drafter_produces_today():
    """Each shipped plan, redrafted from the tiny config it was verified on: a drafter change that alters a verified
    plan fails here until `plan draft --all` verifies and ships the new one."""
    drifted = {}
    for name, entry in shipped.shipped()["plans"].items():
        with torch.device("meta"):
            model = getattr(diffusers, name).from_config(entry["tiny_config"])
        today = shipped.plan_text(draft_plan(model, shard_norms=entry["shard_norms"]).plan)
        if today != entry["plan"]:
            drifted[name] = sorted(set(today.items()) ^ set(entry["plan"].items()))[:4]
    assert not drifted, drifted


def test_shipped_styles_read_back_as_the_styles_written():
    for entry in shipped.shipped()["plans"].values():
        for text in entry["plan"].values():
            assert shipped.style_text(shipped.style_from_text(text)) == text
    with pytest.raises(ValueError, match="not a style a drafted plan uses"):
        shipped.style_from_text("__import__('os').system('true')")


def _flipped(plan: dict) -> dict:
    """The plan with its first rowwise rule turned colwise: that output's all-reduce is gone."""
    rule = next(rule for rule, style in plan.items() if style == "rowwise")
    return {**plan, rule: "colwise"}


def test_a_sample_of_shipped_plans_still_matches_one_process_at_tp2_and_a_wrong_one_does_not(tmp_path):
    entries = {}
    for name in SAMPLE:
        plan, shard_norms = shipped.verified_plan(name)
        case = tiny_case(getattr(diffusers, name), tmp_path / name)
        entries[name] = (case, plan)
    entries["control"] = (entries[SAMPLE[0]][0], _flipped(entries[SAMPLE[0]][1]))
    results = verify_drafts(entries)
    for name in SAMPLE:
        assert results[name]["ok"], (name, results[name])
    control = results["control"]
    assert not control["ok"] and control.get("diff", float("inf")) > 1000 * DEFAULT_TOLERANCE, control


def _folder(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_generic_adapter_loads_the_shipped_plan_where_the_checkpoint_drafts_to_it(tmp_path, monkeypatch):
    from neuron_diffusers.pipelines.drafted import drafted_family

    name = SAMPLE[0]
    entry = shipped.shipped()["plans"][name]
    family = drafted_family(diffusers.CogView4Pipeline, _folder(tmp_path, entry["tiny_config"]))
    assert family.verified and shipped.plan_text(family.drafted) == entry["plan"]
    # Control: a shipped plan this module tree does not draft to is not used; the load drafts afresh.
    plans = {**shipped.shipped()["plans"], name: {**entry, "plan": {"to_q": '"colwise"'}}}
    monkeypatch.setattr(shipped, "shipped", lambda: {"plans": plans})
    family = drafted_family(diffusers.CogView4Pipeline, tmp_path / "transformer")
    assert not family.verified and shipped.plan_text(family.drafted) != {"to_q": '"colwise"'}


def test_the_shipped_cp_plans_are_the_ones_verified_at_tp2_ulysses2_in_the_table(table):
    """Each shipped class names the CP plan that matched one process at tp=2 x ulysses=2 (drafted, or "stock"), or
    why none did; the drafted ones read back as the entries the table wrote, and nothing else is read as code."""
    verified = _verified(table)
    for name, entry in shipped.shipped()["plans"].items():
        row = verified[name]
        if (row.get("cp") or {}).get("plan"):
            assert entry["cp_plan"] == row["cp_candidates"][row["cp"]["plan"]], name
            plan, miss = shipped.verified_cp_plan(name)
            assert miss is None and plan_text(plan) == entry["cp_plan"], name
        elif (row.get("cp_stock") or {}).get("plan"):
            assert entry["cp_plan"] == "stock" and shipped.verified_cp_plan(name) == ("stock", None), name
        else:
            assert "cp_plan" not in entry and shipped.verified_cp_plan(name) == (None, row["cp_miss"]), name
    assert shipped.verified_cp_plan("UNet2DConditionModel")[0] is None
    with pytest.raises(ValueError, match="not an entry a context-parallel plan holds"):
        shipped.cp_plan_from_text({"proj_out": "__import__('os').system('true')"})


def test_a_gather_at_the_tiny_last_block_moves_to_the_checkpoints_last_block():
    plan, _ = shipped.verified_cp_plan("StableAudio3DiTModel")  # gathered at `transformer_blocks.1` of 2 tiny blocks
    assert "transformer_blocks.1" in plan
    with torch.device("meta"):
        model = diffusers.StableAudio3DiTModel.from_config(
            {**shipped.shipped()["plans"]["StableAudio3DiTModel"]["tiny_config"], "depth": 5})
    fitted = shipped.fitted(plan, model)
    assert "transformer_blocks.4" in fitted and "transformer_blocks.1" not in fitted
    assert fitted["transformer_blocks.0"] == plan["transformer_blocks.0"]  # the first block's split stays
