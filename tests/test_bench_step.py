"""`bench step` at tiny size: the output's structure, and that every figure is a measured one."""

import json
import statistics

from PIL import Image

from neuron_diffusers.cli import main
from neuron_diffusers.tools.bench import step
from neuron_diffusers.tools.bench.step import one_process_after


def test_bench_step_measures_every_variant_beside_one_process(tmp_path, capsys, pooled):
    out = tmp_path / "step"
    with pooled(step):  # its rank job times and compares outputs only: the session's 2 ranks, not a spawn of its own
        code = main(["bench", "step", "--family", "qwenimage21", "--width", "tiny", "--tokens", "64", "--text", "16",
                     "--repeats", "2", "--control", "--quantize", "fp8:16", "--json", "--out", str(out)])
    assert code == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["family"] == "qwenimage21" and result["tp"] == 2 and result["blocks"] == {"num_layers": 1}
    assert (result["image_tokens"], result["text_tokens"]) == (64, 16)  # read off the captured call
    assert set(result["seconds"]) == {"default", "lean", "stock", "stock again", "default fp8:16", "one process"}
    for label, samples in result["seconds"].items():
        assert len(samples) == 2 and all(s > 0 for s in samples), label
        assert result["median_s"][label] == statistics.median(samples)
    assert result["ideal_s"] == result["median_s"]["one process"] / 2
    ratios = [lean / stock for lean, stock in zip(result["seconds"]["lean"], result["seconds"]["stock"], strict=True)]
    assert result["vs_stock_rounds"]["lean"] == ratios and result["vs_stock"]["lean"] == statistics.median(ratios)
    diffs = dict(result["max_abs_diff"])
    assert diffs.pop("default fp8:16") > 1e-5  # fp8 beside bf16 in one run: the quantization acts
    assert all(diff < 1e-5 for diff in diffs.values()), diffs
    assert result["max_abs_diff"]["stock again"] == result["max_abs_diff"]["stock"]  # the same plan, the same output
    assert result["one_process_after"] is False  # tiny: everything fits, all five in alternation
    stored = json.loads((out / "step.json").read_text())
    assert stored["results"] == [result] and stored["command"].startswith("neuron-diffusers bench step --family")
    table = (out / "step.md").read_text()
    assert "| Qwen-Image-2.1 | layers=1 |" in table and "(lean)" in table and "(stock again)" in table
    assert "(default fp8:16)" in table and "on CPU their times say little" in table
    with Image.open(out / "step.png") as image:
        assert image.format == "PNG"


def test_a_token_count_that_is_not_square_is_refused(capsys):
    assert main(["bench", "step", "--family", "flux", "--width", "tiny", "--tokens", "63"]) == 2
    assert "--tokens 63 is not a square number" in capsys.readouterr().err


def test_one_process_after_the_tp_copies_when_they_would_not_fit(capsys, pooled):
    """FLUX.2's real-width copies do not fit a 24 GiB host together: the whole model is timed after the TP ones."""
    assert one_process_after(2_290_000_000, 2, available=24 * 2**30)  # FLUX.2's slice: 3 x 9.2 GB
    assert not one_process_after(550_000_000, 2, available=24 * 2**30)  # FLUX.1's: 3 x 2.2 GB
    with pooled(step):
        code = main(["bench", "step", "--family", "flux", "--width", "tiny", "--tokens", "64", "--text", "16",
                     "--repeats", "1", "--one-process", "after", "--json"])
    assert code == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["one_process_after"] is True
    assert {label: len(samples) for label, samples in result["seconds"].items()} == \
        {"default": 1, "stock": 1, "one process": 1}
    assert all(diff < 1e-5 for diff in result["max_abs_diff"].values()), result["max_abs_diff"]


def test_rounds_alternate_their_order_so_no_variant_always_runs_first(monkeypatch):
    calls = []
    monkeypatch.setattr(step.dist, "barrier", lambda: None)
    monkeypatch.setattr(step, "forward_call", lambda model, args, kwargs: calls.append(model))
    monkeypatch.setattr(step, "predictions", lambda output: output)
    seconds, outputs = {}, {}
    step._alternate({"ours": "A", "stock": "B", "one process": None}, (), {}, 3, seconds, outputs)
    assert calls == ["A", "B"] + ["A", "B"] + ["B", "A"] + ["A", "B"]  # warm-up, then A B / B A / A B
    assert {label: len(values) for label, values in seconds.items()} == {"ours": 3, "stock": 3}
