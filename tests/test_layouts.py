"""Layouts of N ranks (`parallel/layouts.py`) and `plan report --cores N`: costs from shapes and a traced step."""

import json

import pytest

from neuron_diffusers import families
from neuron_diffusers.cli import main
from neuron_diffusers.parallel.layouts import Layout, layout_problem, valid_layouts
from neuron_diffusers.parallel.rules import collectives_per_forward
from neuron_diffusers.tools.plan.layout_report import layouts_report
from neuron_diffusers.tools.plan.meta import meta_transformer
from neuron_diffusers.tools.plan.profiles import PROFILES
from neuron_diffusers.tools.plan.trace import trace

# Rows of the main attention per forward, from the released geometry: FLUX.1 / FLUX.2 1024x1024 = 64 x 64 tokens of
# 16 px + 512 text; Qwen-Image 4096 + its 64-row text bucket; H3 1344x768 x 124 frames = 37 latent frames x
# (42 x 24) patches + 2 x 207 audio latents + a 64-row text bucket.
SIZES = {"flux": "1024x1024", "flux2": "1024x1024", "qwenimage": "1024x1024", "qwenimage21": "1024x1024",
         "h3": "1344x768", "wan": "1280x720"}
ATTENTION_ROWS = {"flux": 4608, "flux2": 4608, "qwenimage": 4160, "h3": 37 * 42 * 24 + 2 * 207 + 64}
TRN2_MEMORY_GIB = 24


def _report(capsys, *args) -> dict:
    assert main(["plan", "report", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_layout_rules():
    layouts = valid_layouts(24, 64, cfg_degrees=(1,))
    assert len(layouts) == 50 and all(layout.ranks == 64 for layout in layouts)
    assert Layout(dp=1, ring=8, tp=8) in layouts and Layout(dp=1, ring=8, ulysses=2, tp=4) in layouts
    assert not any(layout.tp * layout.ulysses > 8 for layout in layouts)  # 24 heads: tp x ulysses divides 24
    # Ulysses splits the heads a TP rank keeps: 56 heads pass at tp2 x ulysses4, not at tp4 x ulysses4.
    assert layout_problem(56, 8, tp=2, ulysses=4) is None
    assert "14 heads each tensor-parallel rank keeps" in layout_problem(56, 16, tp=4, ulysses=4)
    assert "= 2 x 8 x 1 x 4 = 64 does not divide the world size 48" in layout_problem(24, 48, tp=8, ring=4, cfg=2)
    assert "cfg is 1 or 2" in layout_problem(24, 12, cfg=3)
    # ulysses_anything pads heads only below diffusers' limit (its own examples: 30 heads over 8 yes, over 16 no).
    assert layout_problem(30, 8, ulysses=8, ulysses_anything=True) is None
    assert "diffusers refuses" in layout_problem(30, 16, ulysses=16, ulysses_anything=True)
    narrowed = valid_layouts(24, 4, tp_degrees=(1, 2))  # a plan that cannot shard at 4
    assert Layout(dp=1, cfg=2, tp=2) in narrowed and all(layout.tp != 4 for layout in narrowed)


@pytest.mark.parametrize("family", families.PIPELINE_FAMILIES)
def test_every_family_fills_64_ranks_with_one_image(capsys, family):
    profile = ["--profile", "trn2"] if family == "h3" else []
    report = _report(capsys, "--model", family, "--cores", "64", "--size", SIZES[family], *profile)
    rows = report["layouts"]
    assert rows and all(row["dp"] * row["ranks_per_image"] == 64 for row in rows)
    one_image = [row for row in rows if row["dp"] == 1]
    assert one_image, f"no layout puts all 64 ranks on one {family} image"
    assert all(row["weights_gib_bf16"] > 0 and row["tflop"] > 0 for row in rows)
    if family in ATTENTION_ROWS:
        assert report["attention_rows"] == ATTENTION_ROWS[family]
    if family == "qwenimage":
        # Its _cp_plan splits at the first block: the input projections run on the whole sequence, the blocks and
        # the output Linear (where diffusers gathers) on the split one.
        forward = trace(families.get(family), 1024, 1024).step[0]
        assert not forward.linears["img_in"][0].split and not forward.linears["txt_in"][0].split
        assert forward.linears["transformer_blocks.*.attn.to_q"][0].split and forward.linears["proj_out"][0].split
    if family == "h3":
        # 37,774 packed rows = 2 x 11 x 17 x 101: a context split of 4 or more needs padding; its bucketed text is
        # masked, so every ring layout is flagged; 61.7 GiB of weights fit a 24 GiB core only at tp >= 4.
        assert report["split_lengths"] == [ATTENTION_ROWS["h3"]] and report["masked_attention"]
        for row in rows:
            context = row["ring"] * row["ulysses"]
            assert ("pad" in row["notes"]) == (ATTENTION_ROWS["h3"] % context != 0), row
            assert ("ring+mask" in row["notes"]) == (row["ring"] > 1), row
            assert ("no-fit" in row["notes"]) == (row["weights_gib_bf16"] > TRN2_MEMORY_GIB), row
        assert {row["tp"] for row in rows if "no-fit" not in row["notes"]} == {4, 8}
    if family == "qwenimage21":
        # 32 heads: tp x ulysses <= 32, so 64 ranks on one image need ring, or the CFG pair with true CFG.
        assert all(row["ring"] > 1 for row in one_image)
        cfg = _report(capsys, "--model", family, "--cores", "64", "--true-cfg")
        assert any(row["dp"] == 1 and row["cfg"] == 2 and row["ring"] == 1 for row in cfg["layouts"])


def test_costs_follow_the_layout(capsys):
    report = layouts_report("flux", 8, hardware="trn2")
    rows = {tuple(row[d] for d in ("dp", "cfg", "ring", "ulysses", "tp")): row for row in report["layouts"]}
    single, tp8, ulysses8, ring8 = rows[8, 1, 1, 1, 1], rows[1, 1, 1, 1, 8], rows[1, 1, 1, 8, 1], rows[1, 1, 8, 1, 1]
    assert report["split_lengths"] == [512, 4096] and report["attention_rows"] == 4608
    # One rank of the image: attention is 57 blocks x 4 x S^2 x (24 heads x 128), nothing is sent.
    assert single["attention_tflop"] * 1e12 == pytest.approx(57 * 4 * 4608**2 * 24 * 128)
    assert sum(single["collectives"].values()) == 0 and single["seconds"]["total"] == single["seconds"]["compute"]
    # FLUX splits its sequence at the model input: 8-way CP leaves 1/8 of the work (the per-image time
    # embedding, 1 row, is not split).
    assert ulysses8["tflop"] == pytest.approx(single["tflop"] / 8, rel=1e-3)
    assert ring8["tflop"] == pytest.approx(ulysses8["tflop"])
    # TP: the plan's collectives, each of a full-sequence activation; weights as `plan report --tp 8`.
    plan = families.get("flux").plan
    assert tp8["collectives"]["all_reduce"] == collectives_per_forward(meta_transformer("flux").module, plan)[
        "all_reduce"] == 76
    assert tp8["weights_gib_bf16"] * 2**30 == _report(capsys, "--model", "flux", "--tp", "8")["per_rank_bytes_bf16"]
    # Ulysses: q, k, v, out of every attention, 7/8 of each rank's 576 rows x 3072 sent; ring: its K and V to 7 peers.
    local = 4608 / 8 * 3072 * 2
    assert ulysses8["collectives"]["all_to_all"] == 57 * 4
    assert ulysses8["sent_gb"]["all_to_all"] * 1e9 == pytest.approx(57 * 4 * local * 7 / 8)
    assert ring8["sent_gb"]["ring"] * 1e9 == pytest.approx(57 * 2 * local * 7)
    assert ring8["notes"] == [] and tp8["notes"] == []
    # The estimate: FLOPs at peak, plus latency and bytes over the link for every collective, nothing overlapped.
    trn2 = PROFILES["trn2"]
    assert tp8["seconds"]["compute"] == pytest.approx(tp8["tflop"] * 1e12 / trn2.peak_flops.value)
    assert tp8["seconds"]["all_reduce"] == pytest.approx(
        76 * trn2.latency.value + tp8["sent_gb"]["all_reduce"] * 1e9 / trn2.bandwidth.value)
    assert tp8["seconds"]["total"] == pytest.approx(sum(v for k, v in tp8["seconds"].items() if k != "total"))
    # The table: one line per layout, under its header.
    assert main(["plan", "report", "--model", "flux", "--cores", "8"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].endswith(f"{len(rows)} layouts of 8 ranks")
    printed = [tuple(map(int, line.split()[:5])) for line in table if line[:7].strip().isdigit()]
    assert sorted(printed) == sorted(rows) and all(line == line.rstrip() for line in table)


def test_profiles_name_their_sources():
    for hardware in PROFILES.values():
        for figure in (hardware.peak_flops, hardware.bandwidth, hardware.latency, hardware.memory):
            assert figure.value > 0 and len(figure.source) > 20, hardware.name


def test_bad_layout_requests_are_clear_errors(capsys):
    assert main(["plan", "report", "--model", "flux", "--cores", "8", "--size", "1000x1000"]) == 2
    assert "multiples of 16" in capsys.readouterr().err
    assert main(["plan", "report", "--model", "flux2", "--cores", "8", "--true-cfg"]) == 2
    assert "guidance-distilled" in capsys.readouterr().err
    assert main(["plan", "report", "--model", "flux", "--tp", "8", "--profile", "h100"]) == 2
    assert "pass --cores N instead of --tp" in capsys.readouterr().err
    assert main(["plan", "report", "--model", "hunyuanvideo", "--cores", "8"]) == 2
    assert "no pipeline here" in capsys.readouterr().err
