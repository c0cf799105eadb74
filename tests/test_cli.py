"""The `generate` job: tensor-parallel over torchrun ranks vs one process, and bad input."""

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from neuron_diffusers.cli import main


def _run(out, *extra, ranks=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}"] if ranks else [sys.executable]
    command = [*launcher, "-m", "neuron_diffusers", "generate", "--prompt", "a red fox", "--out", str(out), *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def _generate(out, *extra, ranks=None):
    _run(out, *extra, ranks=ranks)
    return np.asarray(Image.open(out).convert("RGB"), dtype=np.float64) / 255


def test_tp2_image_matches_single_process(tmp_path):
    # The README's first command: the embedded default model (a tiny FLUX.1 built into the cache).
    tp2 = _generate(tmp_path / "fox_tp2.png", "--tp", "2", ranks=2)
    single = _generate(tmp_path / "fox.png")
    assert tp2.shape == single.shape and tp2.size > 0
    assert tp2.std() > 0.01, "the image is flat: nothing was generated"
    assert np.abs(tp2 - single).mean() < 1 / 255
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fox.png", "fox_tp2.png"]  # no temporaries left
    settings = Image.open(tmp_path / "fox_tp2.png").text
    assert settings["prompt"] == "a red fox" and settings["seed"] == "0" and settings["tp"] == "2"


def test_h3_writes_a_playable_mp4_with_its_audio(tmp_path):
    import av

    _run(tmp_path / "fox.mp4", "--model", "h3", "--tp", "2", "--steps", "3", ranks=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fox.mp4", "fox.wav"]
    with av.open(str(tmp_path / "fox.mp4")) as container:
        kinds = sorted(stream.type for stream in container.streams)
        frames = sum(1 for _ in container.decode(video=0))
    assert kinds == ["audio", "video"] and frames == 124  # tiny H3's default clip (see tiny/h3.py)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "   "], "--prompt is empty"),
        (["--prompt", "a fox", "--tp", "3"], "Valid values for 1 rank(s): [1]"),
        (["--prompt", "a fox", "--model", "no-such-model"], "neither a local checkpoint folder nor a tiny family"),
        (["--prompt", "a fox", "--model", "h3"], "makes video with audio, so --out must end in .mp4"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_error(tmp_path, capsys, args, message):
    out = tmp_path / "out.png"
    assert main(["generate", *args, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_out_must_be_png_or_mp4(tmp_path, capsys):
    assert main(["generate", "--prompt", "a fox", "--out", str(tmp_path / "fox.jpg")]) == 2
    assert "must end in .png (image models) or .mp4 (MiniMax-H3)" in capsys.readouterr().err
    assert main(["generate", "--prompt", "a fox", "--out", str(tmp_path / "fox.mp4")]) == 2
    assert "makes images, so --out must end in .png" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
