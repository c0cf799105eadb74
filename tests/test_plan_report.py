"""`neuron-diffusers plan report` and the memory benchmark, measured on meta-device models (no weights)."""

import json

import pytest
from PIL import Image

from neuron_diffusers.cli import main
from neuron_diffusers.tools.bench import memory as bench_memory

FAMILIES = ("flux", "flux2", "qwenimage", "qwenimage21", "h3")
GIB = 2**30

# Stock diffusers plans at TP=8 on the full-size default configs: (per-rank GiB, total GiB), bf16.
STOCK_TP8 = {
    "flux": (8.12, 22.15),
    "flux2": (8.83, 60.02),
    "qwenimage": (15.90, 38.05),
    "qwenimage21": (1.88, 13.25),
}


def _report(capsys, *args) -> dict:
    assert main(["plan", "report", *args, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one JSON object, nothing else


# Each family's leanest plan: the default, or the lean one where memory trades against collectives.
LEANEST = {family: "lean" if family == "qwenimage21" else "default" for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_our_leanest_plans_come_within_5_percent_of_total_over_8(capsys, family):
    report = _report(capsys, "--model", family, "--tp", "8", "--plan", LEANEST[family])
    assert report["family"] == family and report["tp"] == 8 and report["plan"] == LEANEST[family]
    assert report["per_rank_params"] <= 1.05 * report["total_params"] / 8
    assert report["per_rank_bytes_bf16"] == 2 * report["per_rank_params"]
    assert 8 in report["valid_tp_degrees"]
    assert report["all_reduces_per_forward"] > 0 and report["all_gathers_per_forward"] > 0
    shares = [row["share"] for row in report["replicated"]]
    assert shares == sorted(shares, reverse=True)


@pytest.mark.parametrize("family", sorted(STOCK_TP8))
def test_stock_plan_reproduces_the_stock_figures(capsys, family):
    per_rank_gib, total_gib = STOCK_TP8[family]
    report = _report(capsys, "--model", family, "--tp", "8", "--plan", "stock")
    assert report["per_rank_params"] * 2 / GIB == pytest.approx(per_rank_gib, rel=0.01)
    assert report["total_params"] * 2 / GIB == pytest.approx(total_gib, rel=0.01)
    assert report["all_gathers_per_forward"] == 0  # stock has no gathered style
    # What stock leaves replicated is exactly what the per-rank excess over total/8 consists of.
    excess = report["per_rank_params"] - report["total_params"] / 8
    assert excess == pytest.approx(report["replicated_params"] * 7 / 8, rel=1e-6)


@pytest.mark.parametrize("family", sorted(STOCK_TP8))
def test_default_plans_issue_no_more_collectives_than_stock(capsys, family):
    report = _report(capsys, "--model", family, "--tp", "8")
    assert report["plan"] == "default"
    plans = {row["plan"]: row for row in report["variants"]}
    calls = {name: row["all_reduces_per_forward"] + row["all_gathers_per_forward"] for name, row in plans.items()
             if "unavailable" not in row}
    assert calls["default"] == report["all_reduces_per_forward"] + report["all_gathers_per_forward"]
    assert calls["default"] <= calls["stock"]
    assert plans["default"]["per_rank_gib_bf16"] <= plans["stock"]["per_rank_gib_bf16"]
    if family == "qwenimage21":  # the trade, named: less memory per rank for one all-reduce and one all-gather more
        assert plans["lean"]["per_rank_gib_bf16"] < plans["default"]["per_rank_gib_bf16"]
        assert calls["lean"] == calls["default"] + 2
    else:
        assert "has no 'lean' plan" in plans["lean"]["unavailable"]


def test_a_plan_a_family_lacks_is_refused_before_any_weight_is_read(capsys, tiny_checkpoint):
    import neuron_diffusers as nd

    assert main(["plan", "report", "--model", "flux", "--tp", "8", "--plan", "lean"]) == 2
    err = capsys.readouterr().err
    assert "FLUX.1 has no 'lean' plan" in err and "'lean' exists for: Qwen-Image-2.1" in err
    # load_pipeline checks the name right after resolving the folder: no process group, no weight read.
    with pytest.raises(ValueError, match="FLUX.1 has no 'lean' plan"):
        nd.load_pipeline(tiny_checkpoint("flux"), plan="lean")
    with pytest.raises(ValueError, match="Unknown tensor-parallel plan 'ours'"):
        nd.load_pipeline(tiny_checkpoint("flux"), plan="ours")


def test_h3_has_no_stock_plan(capsys):
    assert _report(capsys, "--model", "h3", "--tp", "8")["total_params"] * 2 / GIB == pytest.approx(61.70, rel=0.01)
    assert main(["plan", "report", "--model", "h3", "--tp", "8", "--plan", "stock"]) == 2
    assert "ships no tensor-parallel plan for MiniMaxH3Transformer3DModel" in capsys.readouterr().err


def test_a_tp_degree_that_does_not_divide_names_the_valid_ones(capsys):
    assert main(["plan", "report", "--model", "flux", "--tp", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("neuron-diffusers plan report: error: A tensor-parallel degree of 5")
    assert "Valid degrees: [1, 2, 3, 4, 6, 8, 12, 24]" in err


def test_table_output_is_readable(capsys):
    assert main(["plan", "report", "--model", "qwenimage", "--tp", "8", "--plan", "stock"]) == 0
    out = capsys.readouterr().out
    assert "QwenImageTransformer2DModel (qwenimage, default config): stock plan, TP=8" in out
    assert "20.43 B" in out and "15.90" in out  # params in B, GiB in bf16
    assert "transformer_blocks.*.img_mod.1" in out  # the largest replicated group, block index collapsed


def test_a_checkpoint_folder_reports_its_own_config(capsys, tiny_checkpoint):
    checkpoint = tiny_checkpoint("flux")
    report = _report(capsys, "--model", str(checkpoint), "--tp", "2")
    assert report["family"] == "flux" and report["config"] == "checkpoint"
    assert report["total_params"] < 10**7  # the tiny config, not the 12 B default
    assert report["per_rank_params"] < report["total_params"]


def test_not_a_model_is_a_clear_error(capsys, tmp_path):
    assert main(["plan", "report", "--model", str(tmp_path), "--tp", "2"]) == 2
    assert "has neither transformer/config.json nor config.json" in capsys.readouterr().err


def test_memory_benchmark_writes_table_json_and_chart(tmp_path, capsys):
    paths = bench_memory.run(tmp_path, names=("qwenimage21", "h3"), degrees=(1, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.json", "memory.md", "memory.png"]
    stored = json.loads(paths["json"].read_text())
    assert stored["command"].startswith("neuron-diffusers bench memory") and stored["versions"]["diffusers"]
    rows = stored["rows"]
    assert [(r["family"], r["tp"]) for r in rows] == [("qwenimage21", 1), ("qwenimage21", 2), ("h3", 1), ("h3", 2)]
    h3_tp2 = rows[3]
    assert not h3_tp2["stock_has_plan"] and h3_tp2["stock_gib"] == h3_tp2["total_gib"]  # no plan: full model
    assert h3_tp2["ours_gib"] <= 1.05 * h3_tp2["limit_gib"]
    assert paths["md"].read_text() in capsys.readouterr().out
    assert "no plan" in paths["md"].read_text()
    with Image.open(paths["png"]) as image:
        assert image.format == "PNG" and image.width > image.height
