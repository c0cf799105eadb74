"""The rank that does not encode never loads a text encoder, and its peak RSS shows it (`bench_encoder`)."""

import argparse
import json

import pytest

from neuron_diffusers.tools.bench import encoder as bench_encoder

ENCODER_MIB = 32  # big enough that the leader's extra weights stand out of the ranks' common RSS, fast to run


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return bench_encoder.measure(ENCODER_MIB, steps=1, directory=tmp_path_factory.mktemp("bench") / "ckpt")


def test_checkpoint_text_encoder_has_the_requested_size(result):
    t5_mib = result["checkpoint"]["safetensors_mib"]["text_encoder_2"]
    assert 0.8 * ENCODER_MIB < t5_mib < 1.2 * ENCODER_MIB
    assert t5_mib > 10 * result["checkpoint"]["safetensors_mib"]["transformer"]  # the encoder dominates


def test_only_the_leader_holds_text_encoders(result):
    leader, other = result["tp2"]
    assert (leader["tp_rank"], other["tp_rank"]) == (0, 1)
    assert leader["holds_encoder"] and not other["holds_encoder"]
    assert {"CLIPTextModel", "T5EncoderModel"} <= set(leader["pretrained_model_classes"])
    assert other["pretrained_models"] == 0 and other["pretrained_model_classes"] == []
    assert leader["image_size"] == list(reversed(result["size"])) and other["image_size"] is None


def test_the_rank_that_does_not_encode_peaks_lower(result):
    leader, other = result["tp2"]
    assert other["peak_rss_mib"] < leader["peak_rss_mib"]
    assert other["peak_rss_mib"] < result["stock"]["peak_rss_mib"]
    assert result["stock"]["holds_encoder"] and result["stock"]["pretrained_models"] >= 2


def test_main_prints_the_table_or_json(result, monkeypatch, capsys):
    monkeypatch.setattr(bench_encoder, "measure", lambda *args, **kwargs: result)
    parser = argparse.ArgumentParser()
    bench_encoder.add_arguments(parser)
    bench_encoder.main(parser.parse_args([]))
    table = capsys.readouterr().out
    assert "| TP=2 rank 1 | 1 | denoises only | no | 0 |" in table
    bench_encoder.main(parser.parse_args(["--json"]))
    assert json.loads(capsys.readouterr().out)["tp2"][1]["holds_encoder"] is False
