"""`plan check`: every shipped plan lints clean; each kind of mistake is an error naming the rule and the fix."""

import pytest
from diffusers import HunyuanVideoTransformer3DModel
from diffusers.hooks.tensor_parallel import PackedRowwiseParallel

from neuron_diffusers import families, stock_plan
from neuron_diffusers.cli import main
from neuron_diffusers.tools.plan.cases import TRANSFORMER_CASES
from neuron_diffusers.tools.plan.check import check_plan, load_plan
from neuron_diffusers.tools.plan.meta import meta_transformer
from neuron_diffusers.tp_plans.hunyuanvideo import PLAN as HUNYUAN

FF_OUT = "transformer_blocks.*.ff.net.2"
FF_IN = "transformer_blocks.*.ff.net.0.proj"
REFINER_ATTN = "context_embedder.token_refiner.refiner_blocks.*.attn"
PROJ_OUT = "single_transformer_blocks.*.proj_out"


@pytest.fixture(scope="module")
def hunyuanvideo():
    return meta_transformer("hunyuanvideo").module


def _without(*rules):
    return {rule: style for rule, style in HUNYUAN.items() if rule not in rules}


@pytest.mark.parametrize("family", [family.name for family in families.FAMILIES])
def test_our_plans_have_no_errors_and_shard_nearly_everything(family):
    plan = load_plan(family)
    meta = meta_transformer(family)
    description, model = meta.description, meta.module
    assert check_plan(model, plan.rules, tp=8).errors == []
    # The leanest plan is what shards nearly everything: the default, or the lean one where a family trades memory
    # for collectives (Qwen-Image-2.1, whose default is stock's plan).
    report = check_plan(model, families.get(family).plan_variants.get("lean", plan.rules), tp=8)
    assert report.errors == []
    assert description == f"{plan.model_class} (default config)"
    assert 8 in report.valid_degrees and report.sharded_linears > 0
    assert report.whole_params < 0.01 * report.total_params


@pytest.mark.parametrize("family", ["flux", "flux2", "qwenimage", "qwenimage21"])
def test_stock_plans_pass_the_partner_rule_too(family):
    """No false alarms on diffusers' own plans; what they leave replicated is listed, not an error."""
    report = check_plan(meta_transformer(family).module, stock_plan(families.get(family).model_class()))
    assert report.errors == []
    assert report.unsharded_linears and report.unsharded_linears[0]["share"] > 0.005


@pytest.mark.parametrize(
    "plan, rules, message",
    [
        (_without(FF_OUT), [FF_IN], f"colwise, but no rowwise Linear in '{FF_OUT.rpartition('.')[0]}' closes it"),
        (_without(FF_IN), [FF_OUT], "rowwise, but no colwise Linear in 'transformer_blocks.*.ff.net' splits its input"),
        (_without(f"{REFINER_ATTN}.to_out.0"), [f"{REFINER_ATTN}.to_{x}" for x in "qkv"], "attn.to_out.0 (unsharded)"),
        # 1 + 6 parts do not divide the 5 x 3072 input columns (and the rule still closes its colwise partners)
        ({**HUNYUAN, PROJ_OUT: PackedRowwiseParallel([1, 6])}, [PROJ_OUT], "sum([1, 6])=7 does not divide 15360"),
        ({**HUNYUAN, PROJ_OUT: PackedRowwiseParallel()}, [PROJ_OUT], "has no blocks"),
        ({**HUNYUAN, "transformer_blocks.*.attn.to_qq": "colwise"}, ["transformer_blocks.*.attn.to_qq"],
         "matches nothing"),
        ({**HUNYUAN, "norm_out.*.linear": "colwise"}, ["norm_out.*.linear"], "which is not a ModuleList"),
        ({**HUNYUAN, "norm_out.linear": "gathered"}, ["norm_out.linear"], "Unsupported tensor-parallel style"),
    ],
    ids=["colwise-without-rowwise", "rowwise-without-colwise", "attention-without-out", "packed-not-dividing",
         "packed-without-blocks", "typo", "star-on-non-modulelist", "unknown-style"],
)
def test_each_mistake_is_an_error_on_exactly_its_rules(hunyuanvideo, plan, rules, message):
    report = check_plan(hunyuanvideo, plan)
    assert [finding.rule for finding in report.errors] == rules
    assert all(message in finding.message for finding in report.errors)


def test_wrong_packed_proportions_that_divide_pass_the_check(hunyuanvideo):
    """[1, 3] splits the 5 x 3072 input columns evenly, just at the wrong place: only `plan verify` sees it."""
    assert check_plan(hunyuanvideo, {**HUNYUAN, PROJ_OUT: PackedRowwiseParallel([1, 3])}).errors == []


def test_a_degree_that_splits_a_head_is_an_error(hunyuanvideo):
    errors = check_plan(hunyuanvideo, HUNYUAN, tp=5).errors
    assert len(errors) == 1 and "Valid degrees: [1, 2, 3, 4, 6, 8, 12, 24]" in errors[0].message


def test_a_glob_over_blocks_that_differ_is_caught():
    """SD3's last block has no context output (`to_add_out` is None): one glob cannot cover every block."""
    model = meta_transformer("SD3Transformer2DModel").module
    report = check_plan(model, {"transformer_blocks.*.attn.to_v": "colwise",
                                "transformer_blocks.*.attn.to_out.0": "rowwise",
                                "transformer_blocks.*.attn.to_add_out": "rowwise"})
    assert [f.rule for f in report.errors] == ["transformer_blocks.*.attn.to_add_out"]
    assert "fits blocks 0 to 16 but not block 17" in report.errors[0].message  # 18 blocks in the default config


def test_cli_prints_the_report_and_exits_0(capsys):
    assert main(["plan", "check", "hunyuanvideo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "hunyuanvideo plan (neuron_diffusers.tp_plans.hunyuanvideo) on HunyuanVideoTransformer3DModel")
    assert "valid TP degrees: 1, 2, 3, 4, 6, 8, 12, 24" in out
    assert "unsharded Linears (largest first):\n    time_text_embed.guidance_embedder.linear_2" in out  # optional
    assert out.rstrip().endswith("OK: no errors")


def test_cli_checks_a_plan_file_written_like_ours_and_exits_1_on_errors(tmp_path, capsys):
    plan_file = tmp_path / "my_plan.py"
    plan_file.write_text(
        "from .styles import GatheredColwiseParallel\n\n"  # relative, as in neuron_diffusers/tp_plans/
        "MODEL_CLASS = 'HunyuanVideoTransformer3DModel'\n"
        "PLAN = {'transformer_blocks.*.ff.net.0.proj': 'colwise', 'norm_out.linear': GatheredColwiseParallel()}\n"
    )
    assert main(["plan", "check", str(plan_file)]) == 1
    out = capsys.readouterr().out
    assert f"my_plan plan ({plan_file}) on HunyuanVideoTransformer3DModel" in out
    assert f"error in '{FF_IN}': colwise, but no rowwise Linear" in out and out.rstrip().endswith("1 error")


def test_cli_checks_against_a_pipeline_folder_and_a_model_folder(tmp_path, capsys, tiny_checkpoint):
    assert main(["plan", "check", "flux", "--model", str(tiny_checkpoint("flux"))]) == 0
    assert "FluxTransformer2DModel (config of" in capsys.readouterr().out
    folder = tmp_path / "tiny-hunyuanvideo"
    HunyuanVideoTransformer3DModel.from_config(TRANSFORMER_CASES["HunyuanVideoTransformer3DModel"].config) \
        .save_config(folder)
    assert main(["plan", "check", "hunyuanvideo", "--model", str(folder), "--tp", "4"]) == 0
    assert "valid TP degrees: 1, 2, 4" in capsys.readouterr().out
    assert main(["plan", "check", "hunyuanvideo", "--model", str(folder), "--tp", "8"]) == 1  # 4 heads


@pytest.mark.parametrize(
    "args, message",
    [
        (["no-such-plan"], "neither a registered family"),
        (["hunyuanvideo", "--model", "NotAModel"], "not a diffusers model class"),
        (["hunyuanvideo", "--model", "./missing"], "does not exist"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, args, message):
    assert main(["plan", "check", *args]) == 2
    assert message in capsys.readouterr().err


def test_plan_files_need_a_plan_and_a_model(tmp_path, capsys):
    no_plan, no_class = tmp_path / "empty.py", tmp_path / "classless.py"
    no_plan.write_text("RULES = {}\n")
    no_class.write_text("PLAN = {'norm_out.linear': 'colwise'}\n")
    assert main(["plan", "check", str(no_plan)]) == 2
    assert "assigns no non-empty `PLAN` dict" in capsys.readouterr().err
    assert main(["plan", "check", str(no_class)]) == 2
    assert "sets no MODEL_CLASS, so `plan check` needs --model" in capsys.readouterr().err
