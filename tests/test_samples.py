"""Every script in samples/ runs offline on its tiny checkpoint and writes a valid PNG (MiniMax-H3: MP4 + WAV; Wan:
MP4).

Each interpreter start costs seconds of imports, so only FLUX.1 runs tensor-parallel, on 2 of the session's gloo
ranks (`cli_jobs.on_pool`: the script as `__main__` on each, as torchrun would start it); the others run as plain
one-process scripts, which the same scripts support, one after another in one offline interpreter
(`sample_runner.py`: each as `__main__` with its own argv, cwd and captured output).
Qwen-Image-2.1 runs with true CFG and `--compile aot_eager`, its length buckets included, so the compile path of the
samples is exercised too.
"""

import json
import os
import re
import subprocess
import sys
import wave
from pathlib import Path

import cli_jobs
import numpy as np
import pytest
from PIL import Image

from neuron_diffusers import families, tiny
from neuron_diffusers.tiny import h3, wan

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
# script, family, output name, extra arguments, ranks (None: one plain process)
CASES = [
    ("flux.py", "flux", "flux.png", ["--tp", "2"], 2),
    ("flux2.py", "flux2", "flux2.png", [], None),
    ("qwenimage.py", "qwenimage", "qwenimage.png", [], None),
    ("qwenimage21.py", "qwenimage21", "q21.png",
     ["--negative-prompt", "blurry", "--true-cfg-scale", "4", "--compile", "aot_eager"], None),
    ("h3.py", "h3", "h3.mp4", [], None),
    ("wan.py", "wan", "wan.mp4", [], None),
]
# One sample per family, named after it, pointing at the family's released checkpoint.
REAL_IDS = {f"{family.name}.py": family.hub_id for family in families.FAMILIES if family.adapter is not None}


def _offline(**env) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", **env}  # tiny checkpoints come from the hermetic cache (conftest.py)


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory) -> dict:
    """Every one-process sample, run in one offline interpreter: script -> (its folder, its CompletedProcess)."""
    logs = tmp_path_factory.mktemp("sample-logs")
    runs = {script: (tmp_path_factory.mktemp(family) / name, extra) for script, family, name, extra, ranks in CASES
            if not ranks}
    spec = [[str(SAMPLES / script), str(out), extra, str(logs / script)] for script, (out, extra) in runs.items()]
    (logs / "runs.json").write_text(json.dumps(spec))
    runner = Path(__file__).with_name("sample_runner.py")
    subprocess.run([sys.executable, str(runner), str(logs / "runs.json")], env=_offline(), check=True, timeout=900)
    return {script: (out.parent, subprocess.CompletedProcess(
        [script], int((logs / f"{script}.code").read_text()), (logs / f"{script}.out").read_text(),
        (logs / f"{script}.err").read_text())) for script, (out, _) in runs.items()}


@pytest.mark.parametrize("script, family, name, extra, ranks", CASES, ids=[case[0] for case in CASES])
def test_sample_runs_offline_and_writes_valid_media(request, tmp_path_factory, script, family, name, extra, ranks):
    if ranks:
        tmp_path = tmp_path_factory.mktemp(family)
        # The multi-rank run starts from an empty cache, so its ranks build the tiny model on first use, as a user's.
        launch = cli_jobs.on_pool(request.getfixturevalue("rank_pool"), ["--out", str(tmp_path / name), *extra],
                                  ranks, cwd=tmp_path, script=SAMPLES / script, env={
                                      "HF_HUB_OFFLINE": "1",
                                      "NEURON_DIFFUSERS_CACHE": str(tmp_path_factory.mktemp("cold-cache"))})
        result = subprocess.CompletedProcess([script], launch["code"], launch["out"], launch["err"])
    else:
        tmp_path, result = request.getfixturevalue("plain_runs")[script]
    out = tmp_path / name
    assert result.returncode == 0, (
        f"{script} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    # Only rank 0 logs: one settings line and one "wrote" line, whatever the number of ranks.
    assert result.stdout.count("wrote ") == 1 and result.stdout.count(" steps ") == 1, result.stdout
    assert "recompiled after warm-up" not in result.stderr
    height, width = tiny.default_size(family)
    if out.suffix == ".mp4":
        import av

        audio = family == "h3"  # MiniMax-H3 makes stereo audio beside its video; Wan makes video alone
        expected = [name, out.with_suffix(".wav").name] if audio else [name]
        assert sorted(p.name for p in tmp_path.iterdir()) == expected  # no temporaries left
        with av.open(str(out)) as container:
            kinds = sorted(stream.type for stream in container.streams)
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        assert kinds == (["audio", "video"] if audio else ["video"])
        assert len(frames) == (h3 if audio else wan).DEFAULT_NUM_FRAMES
        assert frames[0].shape == (height, width, 3)
        if audio:
            with wave.open(str(out.with_suffix(".wav"))) as wav:
                assert wav.getnchannels() == 2 and wav.getnframes() > 0
        return
    assert [p.name for p in tmp_path.iterdir()] == [name]  # the leader wrote it once, no temporaries left
    with Image.open(out) as image:
        image.verify()
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (width, height)
        assert image.text["model"] == family and image.text["seed"] == "0" and image.text["prompt"]
        pixels = np.asarray(image.convert("RGB"), dtype=np.float64) / 255
    assert pixels.std() > 0.01, "the image is flat: nothing was generated"


def test_every_sample_is_listed_and_documents_its_real_checkpoint():
    scripts = sorted(p.name for p in SAMPLES.glob("*.py"))
    assert scripts == sorted(REAL_IDS) == sorted(case[0] for case in CASES)
    readme = (SAMPLES / "README.md").read_text()
    for script, model_id in REAL_IDS.items():
        assert f"samples/{script}" in readme and model_id in readme, script
        docstring = re.match(r'"""(.*?)"""', (SAMPLES / script).read_text(), re.S).group(1)
        # The same script runs the real model: download it, then pass the folder with --model.
        assert f"hf download {model_id} --local-dir" in docstring, script
        assert f"samples/{script} --model " in docstring, script
