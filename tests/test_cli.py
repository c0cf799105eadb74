"""The `generate` job end to end: TP=2, DP=2 x TP=1, .jsonl seeds, resume, a killed rank, bad input.

A killed rank needs torchrun's own launch; the other multi-rank jobs run the command's body on the session's pool
ranks (`cli_jobs.on_pool`: the same `cli.main` on as many gloo ranks, minus torchrun's interpreter starts; .ci/run's
README command and tests/test_multinode.py launch the job with torchrun itself).

The job's PNGs are compared with another run's at one level per value and at most 0.5% of values differing, with a
control (stock's PNG of another prompt, same seed, must fail that bar); the same configurations, planned from the
same arguments, are compared at the latents with stock (`runner_jobs.job_latents` on the session's rank pool).
"""

import json
import os
import subprocess
import sys

import cli_jobs
import numpy as np
import pytest
import runner_jobs
from killing import kill_rank_1_after_first_image
from PIL import Image
from test_runner import LATENT_TOLERANCE, OTHER_PROMPT, max_diff, png_difference, png_matches, stock_latents

from neuron_diffusers.cli import main
from neuron_diffusers.tiny import FAMILIES

PROMPTS_JSONL = [
    {"prompt": "a red fox in the snow", "seed": 7},
    {"prompt": "a blue bird", "seed": 3, "negative_prompt": "blurry"},
    {"prompt": "a green frog on a leaf"},
]


def _command(out, *extra, ranks=None):
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}"] if ranks
                else [sys.executable])
    return [*launcher, "-m", "neuron_diffusers", "generate", "--out", str(out), *extra]


def _run(out, *extra, ranks=None, expect=0):
    result = subprocess.run(_command(out, *extra, ranks=ranks), capture_output=True, text=True, timeout=300)
    assert result.returncode == expect, result.stderr[-4000:]
    return result


def _run_on_pool(rank_pool, out, *extra, ranks: int = 2) -> dict:
    """The job on `ranks` pool ranks (as `torchrun --nproc_per_node=RANKS` would run it): exit 0, its output."""
    result = cli_jobs.on_pool(rank_pool, ["generate", "--out", str(out), *extra], ranks)
    assert result["code"] == 0, result["err"][-4000:]
    return result


def _run_here(out, *extra, capsys) -> str:
    """The one-process job, in this process (the same `main`; no interpreter start, seconds of imports): its stdout."""
    assert main(["generate", "--out", str(out), *extra]) == 0
    return capsys.readouterr().out


def _pixels(path):
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64) / 255


def _pngs(folder):
    return sorted(p.name for p in folder.glob("*.png"))


def _write_jsonl(path):
    path.write_text("\n".join(json.dumps(entry) for entry in PROMPTS_JSONL) + "\n")
    return path


@pytest.fixture
def prompts_jsonl(tmp_path):
    return _write_jsonl(tmp_path / "prompts.jsonl")


DP2_PROMPTS = "a red fox\na blue bird\n\na green frog\n"  # the blank line is skipped


@pytest.fixture(scope="module")
def stock_flux():
    """The stock FLUX.1 pipeline (the job's default model), alone in this process."""
    from diffusers import DiffusionPipeline

    from neuron_diffusers.checkpoint import resolve

    return DiffusionPipeline.from_pretrained(resolve(FAMILIES[0]).path)


@pytest.fixture(scope="module")
def job_latents(rank_pool, tmp_path_factory):
    """`job_latents(layout)` → every request's latents (and stock call) of the TP=2 .jsonl job ("tp2") or the DP=2
    job ("dp2"), planned from the tests' own arguments on 2 pool ranks (the first run of each)."""
    folder, made = tmp_path_factory.mktemp("job-latents"), {}
    (folder / "prompts.txt").write_text(DP2_PROMPTS)
    argv = {"tp2": ["--prompts", str(_write_jsonl(folder / "prompts.jsonl")), "--tp", "2"],
            "dp2": ["--prompts", str(folder / "prompts.txt"), "--tp", "1"]}

    def get(layout):
        if layout not in made:
            ranks = rank_pool.run(runner_jobs.job_latents, 2, [*argv[layout], "--out", str(folder / layout)],
                                  timeout_s=600)
            made[layout] = {request["index"]: request for rank in ranks for request in rank}
        return made[layout]

    return get


def _stock_png(stock_flux, request: dict, prompt: str):
    """Stock's 8-bit image of `request` with another prompt (same seed and call): the PNG bar's control."""
    import torch

    with torch.no_grad():
        return stock_flux(prompt=prompt, negative_prompt=request["negative_prompt"], **request["kwargs"],
                          generator=torch.Generator().manual_seed(request["seed"])).images[0]


def _assert_png_bar_sees_another_prompt(control, reference):
    """Stock's PNG of another prompt (same seed and call) falls outside the PNG bar: the comparisons can fail."""
    moved = png_difference(control, reference)
    assert not png_matches(control, reference), f"blind: another prompt is within the bar: {moved}"


def _assert_png_matches(path, reference):
    ours = Image.open(path).convert("RGB")
    assert png_matches(ours, reference), f"{path.name}: {png_difference(ours, reference)} (levels, fraction differing)"


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_job_configurations_give_stock_latents(job_latents, stock_flux, layout):
    """The jobs below, planned from the same arguments, make every request's latents within float32 rounding of
    stock's (same prompt, seed and call); stock's latents for another prompt differ by more."""
    made = job_latents(layout)
    assert sorted(made) == [0, 1, 2]
    first = made[0]
    moved = max_diff(stock_latents(stock_flux, first, prompt=OTHER_PROMPT), stock_latents(stock_flux, first))
    assert moved > LATENT_TOLERANCE, f"blind: another prompt moves the latents by only {moved:.1e}"
    for index, request in made.items():
        difference = max_diff(request["latents"], stock_latents(stock_flux, request))
        assert difference < LATENT_TOLERANCE, f"request {index}: latents differ from stock by {difference:.1e}"


def test_tp2_jsonl_matches_single_process_with_per_line_seeds(tmp_path, prompts_jsonl, job_latents, stock_flux,
                                                              capsys, rank_pool):
    tp2, single = tmp_path / "tp2", tmp_path / "single"
    _run_on_pool(rank_pool, tp2, "--prompts", str(prompts_jsonl), "--tp", "2")
    _run_here(single, "--prompts", str(prompts_jsonl), capsys=capsys)
    names = ["00000-a-red-fox-in-the-snow.png", "00001-a-blue-bird.png", "00002-a-green-frog-on-a-leaf.png"]
    assert _pngs(tp2) == _pngs(single) == names
    references = [Image.open(single / name).convert("RGB") for name in names]
    _assert_png_bar_sees_another_prompt(_stock_png(stock_flux, job_latents("tp2")[0], OTHER_PROMPT), references[0])
    for name, reference in zip(names, references, strict=True):
        _assert_png_matches(tp2 / name, reference)
    assert _pixels(tp2 / names[0]).std() > 0.01, "the image is flat: nothing was generated"
    settings = [Image.open(tp2 / name).text for name in names]
    # Per-line seeds win; a line without one gets --seed (0) + its index.
    assert [s["seed"] for s in settings] == ["7", "3", "2"]
    assert settings[1]["negative_prompt"] == "blurry" and settings[0]["tp"] == "2" and settings[0]["dp"] == "1"
    assert {"prompt", "steps", "size", "guidance", "model", "neuron_diffusers"} <= settings[0].keys()
    summary = json.loads((tp2 / "summary.json").read_text())
    assert settings[0]["plan"] == summary["plan"] == "default"  # the tensor-parallel plan, by name
    assert summary["mesh"]["shape"] == [1, 2] and summary["generated"] == 3
    assert [image["file"] for image in summary["images"]] == names
    phases = summary["phases_per_tp_group"][0]
    assert phases["denoise per transformer forward"] > 0 and phases["decode"] > 0 and phases["encode"] > 0
    assert not list(tp2.glob(".*")), "temporary files left behind"


def test_dp2_splits_prompts_and_a_rerun_resumes(tmp_path, job_latents, stock_flux, capsys, rank_pool):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(DP2_PROMPTS)
    out = tmp_path / "out"
    result = _run_on_pool(rank_pool, out, "--prompts", str(prompts), "--tp", "1")
    assert "wrote 3 of 3" in result["out"] and "dp=2" in result["out"]
    assert _pngs(out) == ["00000-a-red-fox.png", "00001-a-blue-bird.png", "00002-a-green-frog.png"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mesh"]["shape"] == [2, 1] and len(summary["phases_per_tp_group"]) == 2
    single = tmp_path / "single"
    _run_here(single, "--prompt", "a blue bird", "--seed", "1", capsys=capsys)  # image 1 of the file: seed 0 + 1
    reference = Image.open(single / "00000-a-blue-bird.png").convert("RGB")
    _assert_png_bar_sees_another_prompt(_stock_png(stock_flux, job_latents("dp2")[1], OTHER_PROMPT), reference)
    _assert_png_matches(out / "00001-a-blue-bird.png", reference)

    written = {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")}
    result = _run_on_pool(rank_pool, out, "--prompts", str(prompts), "--tp", "1")
    assert "wrote 0 of 3" in result["out"] and "nothing left to generate" in result["out"]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")} == written
    assert "wrote 1 of 1" in _run_here(out, "--prompt", "a red fox", "--overwrite", capsys=capsys)



def test_killed_rank_fails_cleanly_and_a_rerun_completes_the_set(tmp_path, rank_pool):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"prompt number {i}" for i in range(6)) + "\n")  # rank 1 dies after the first
    out = tmp_path / "out"
    args = ("--prompts", str(prompts), "--tp", "2", "--steps", "6", "--timeout", "60")
    launcher = subprocess.Popen(_command(out, *args, ranks=2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    kill_rank_1_after_first_image(launcher, out, timeout_s=240)
    _, stderr = launcher.communicate(timeout=180)  # no hang: the others fail within the collective timeout
    assert launcher.returncode != 0
    # The survivor's collective fails at once and says so; if torchrun's agent stops it first, torchrun names
    # the killed rank instead. Either way the user reads what happened.
    assert "error on rank 0" in stderr or "SIGKILL" in stderr, stderr[-3000:]
    written = _pngs(out)
    assert 0 < len(written) < 6, "the kill did not land mid-run"
    for name in written:
        Image.open(out / name).verify()  # complete files only
    assert not list(out.glob(".*")), "a partial (temporary) file was left behind"

    result = _run_on_pool(rank_pool, out, *args)
    assert f"wrote {6 - len(written)} of 6" in result["out"]
    assert len(_pngs(out)) == 6


def test_h3_writes_a_playable_mp4_with_its_audio(tmp_path, rank_pool):
    import av

    _run_on_pool(rank_pool, tmp_path, "--prompt", "a red fox", "--model", "h3", "--tp", "2", "--steps", "3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000-a-red-fox.mp4", "00000-a-red-fox.wav", "summary.json"]
    with av.open(str(tmp_path / "00000-a-red-fox.mp4")) as container:
        kinds = sorted(stream.type for stream in container.streams)
        settings = dict(container.metadata)
        frames = sum(1 for _ in container.decode(video=0))
    assert kinds == ["audio", "video"] and frames == 124  # tiny H3's default clip (see tiny/h3.py)
    assert settings["prompt"] == "a red fox" and settings["seed"] == "0" and settings["tp"] == "2"


def test_compile_and_warmup_report_no_recompiles(tmp_path):
    result = _run(tmp_path, "--prompt", "a red fox", "--model", "flux2", "--compile", "aot_eager", "--warmup")
    report = json.loads(result.stdout.split("compile report: ")[1].splitlines()[0])
    assert report["graphs"] == 2 and report["graph_breaks"] == 0 and report["recompiles"] == 0
    assert json.loads((tmp_path / "summary.json").read_text())["compile"]["graphs"] == 2


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _no_safetensors(tmp_path, tiny_checkpoint):
    import shutil

    import torch
    from safetensors.torch import load_file

    copy = tmp_path / "bin-checkpoint"
    shutil.copytree(tiny_checkpoint("flux"), copy)
    weights = next((copy / "transformer").glob("*.safetensors"))
    torch.save(load_file(weights), weights.with_name("diffusion_pytorch_model.bin"))
    weights.unlink()
    return str(copy)


def _unsplittable_vae(tmp_path, tiny_checkpoint):
    """A tiny FLUX.1 whose index names a VAE class parallel VAE cannot split (refused before any weight is read)."""
    import shutil

    copy = tmp_path / "other-vae-checkpoint"
    shutil.copytree(tiny_checkpoint("flux"), copy)
    index = json.loads((copy / "model_index.json").read_text())
    index["vae"] = ["diffusers", "AutoencoderKLCogVideoX"]
    (copy / "model_index.json").write_text(json.dumps(index))
    return str(copy)


BAD_INPUT = {
    "unknown model": (lambda t, c: ["--prompt", "a fox", "--model", "no-such-model"],
                      "is neither a local checkpoint folder, a Hub id (owner/name) nor a tiny family"),
    "unreadable prompt file": (lambda t, c: ["--prompts", str(t / "missing.txt")], "missing.txt cannot be read"),
    "malformed jsonl": (lambda t, c: ["--prompts", _write(t, "p.jsonl", '{"prompt": "ok"}\n{"prompt": \n')],
                        "p.jsonl, line 2 is not valid JSON"),
    "jsonl without prompt": (lambda t, c: ["--prompts", _write(t, "p.jsonl", '{"seed": 1}\n')],
                             "p.jsonl, line 1 has no string 'prompt'"),
    "unknown jsonl key": (lambda t, c: ["--prompts", _write(t, "p.jsonl", '{"prompt": "a", "sede": 1}\n')],
                          "unknown keys ['sede']"),
    "empty prompt": (lambda t, c: ["--prompt", "   "], "the prompt is empty"),
    "empty prompt file": (lambda t, c: ["--prompts", _write(t, "p.txt", "\n\n")], "holds no prompt"),
    "size not a multiple": (lambda t, c: ["--prompt", "a fox", "--height", "40"], "must be multiples of 16"),
    "tp does not divide the world": (lambda t, c: ["--prompt", "a fox", "--tp", "3"],
                                     "Valid values for 1 rank(s): [1]"),
    "out is a file": (lambda t, c: ["--prompt", "a fox", "--out", _write(t, "file.txt", "")], "is a file"),
    "no safetensors": (lambda t, c: ["--prompt", "a fox", "--model", _no_safetensors(t, c)],
                       "has no .safetensors weights"),
    "both prompt and prompts": (lambda t, c: ["--prompt", "a", "--prompts", _write(t, "p.txt", "b\n")],
                                "exactly one of --prompt TEXT or --prompts FILE"),
    "warmup without compile": (lambda t, c: ["--prompt", "a fox", "--warmup"], "needs --compile"),
    "unknown backend": (lambda t, c: ["--prompt", "a fox", "--compile", "no-such"],
                        "Unknown torch.compile backend 'no-such'"),
    "guidance for a distilled model": (lambda t, c: ["--prompt", "a fox", "--model", "h3", "--guidance", "3"],
                                       "guidance-distilled: drop --guidance"),
    "plan the family lacks": (lambda t, c: ["--prompt", "a fox", "--plan", "lean"], "FLUX.1 has no 'lean' plan"),
    "missing plan file": (lambda t, c: ["--prompt", "a fox", "--plan", str(t / "nope.py")], "nope.py does not exist"),
    "plan file for another class": (lambda t, c: ["--prompt", "a fox", "--plan", _write(
        t, "qi.py", 'from .flux import PLAN\nMODEL_CLASS = "QwenImageTransformer2DModel"\n')],
        "is written for QwenImageTransformer2DModel (its MODEL_CLASS), but this checkpoint's transformer is a "
        "FluxTransformer2DModel"),
    "plan file that does not fit": (lambda t, c: ["--prompt", "a fox", "--plan", _write(
        t, "typo.py", 'PLAN = {"transformer_blocks.*.attn.to_qq": "colwise"}\n')], "does not fit"),
    "parallel VAE it cannot split": (lambda t, c: ["--prompt", "a fox", "--model", _unsplittable_vae(t, c),
                                                   "--parallel-vae"],
                                     "parallel_vae does not support AutoencoderKLCogVideoX"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_rejected_before_anything_is_written(tmp_path, tiny_checkpoint, generate_refuses, case):
    make_args, message = BAD_INPUT[case]
    generate_refuses(make_args(tmp_path, tiny_checkpoint), message)


def test_tp_that_does_not_divide_the_heads_is_rejected(tmp_path, capsys, monkeypatch):
    # 3 ranks cannot be launched cheaply here; the head check runs on the same path with the world size faked.
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["generate", "--prompt", "a fox", "--tp", "3", "--out", str(tmp_path / "out")]) == 2
    assert "divide" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_unwritable_out_is_rejected(tmp_path, capsys, monkeypatch):
    # Tests run as root here, which may write anywhere, so the permission answer is what is faked.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert main(["generate", "--prompt", "a fox", "--out", str(tmp_path / "out")]) == 2
    assert "is not writable. Choose another output folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_hub_id_that_cannot_be_fetched_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "--prompt", "a fox", "--model", "no-owner/no-model", "--out", str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err
    assert "'no-owner/no-model' is not a local folder and could not be fetched from the Hub" in error
    assert "hf download no-owner/no-model --local-dir DIR" in error and not (tmp_path / "o").exists()
