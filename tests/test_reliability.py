"""Never out of step, never silently wrong (docs/reliability.md): bad requests and partial calls on a group, NaN,
resume keyed by settings, every check before anything starts, a full disk.

The multi-rank cases run on the session's pool of 2 CPU ranks (`rank_pool`), one job a topic, each case recorded on
its own (`rank_cases`), so a failure fails only the test that reads it; the rest runs in this process.
"""

import fcntl
import json
import os
import shutil
import signal
from dataclasses import dataclass, field

import numpy as np
import pytest
import reliability_jobs
import torch
from PIL import Image
from rank_cases import case
from safetensors.torch import load_file, save_file

from neuron_diffusers.cli import main
from neuron_diffusers.consistency import LatentAgreement, NonFiniteLatentsError
from neuron_diffusers.media import VideoWithAudio, read_png_text, read_video_text, save_video
from neuron_diffusers.outputs import LOCK_NAME, JobLock, check_unlocked, digest, settings_key

FLUX_TIME_WEIGHT = "time_text_embed.timestep_embedder.linear_1.weight"


def _copy(tiny_checkpoint, family, folder):
    shutil.copytree(tiny_checkpoint(family), folder)
    return folder


def _nan_checkpoint(tiny_checkpoint, folder):
    """The tiny FLUX.1 with one weight of the timestep embedding NaN: every modulation, then the latents, go NaN."""
    _copy(tiny_checkpoint, "flux", folder)
    weights = next((folder / "transformer").glob("*.safetensors"))
    tensors = load_file(weights)
    tensors[FLUX_TIME_WEIGHT] = torch.full_like(tensors[FLUX_TIME_WEIGHT], float("nan"))
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder


def _lines(path, *lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def group(tiny_checkpoint, tmp_path_factory, rank_pool):
    """(the folder the jobs write into, `reports(name)`: both ranks' per-case reports of one job, run on first use
    on the pool's 2 ranks, so a job that fails fails only its own tests)."""
    root = tmp_path_factory.mktemp("reliability")
    flux = str(tiny_checkpoint("flux"))
    tp2 = ["--model", flux, "--prompts", _lines(root / "three.txt", "a red fox", "a blue bird", "a green frog"),
           "--out", str(root / "tp2"), "--tp", "2", "--steps", "1"]
    dp2 = ["--model", flux, "--prompts", _lines(root / "four.txt", "one fox", "two foxes", "three foxes", "four"),
           "--out", str(root / "dp2"), "--tp", "1", "--steps", "1"]
    jobs = {"serving": lambda: (reliability_jobs.serving_loop, tiny_checkpoint("qwenimage")),
            "cfg": lambda: (reliability_jobs.cfg_pair_loop, tiny_checkpoint("qwenimage")),
            "nan": lambda: (reliability_jobs.nan_checks, _nan_checkpoint(tiny_checkpoint, root / "nan-flux")),
            "disk_full": lambda: (reliability_jobs.disk_full, tp2, dp2)}
    made = {}

    def reports(name):
        if name not in made:
            fn, *args = jobs[name]()
            made[name] = rank_pool.run(fn, 2, *args, timeout_s=900)
        return made[name]

    return root, reports


def _same_on_both_ranks(outcomes, kind: str, snippet: str):
    first, second = outcomes
    assert first == second, f"the ranks disagree: {first} vs {second}"
    assert first["type"] == kind, first
    assert snippet in first["message"] and "\n" not in first["message"], first["message"]


SERVING_ERRORS = {
    "prompt not a string": "`prompts` must be a string or a non-empty list of strings, got 5",
    "encoding fails on the leader only": "the leader's tokenizer refused this prompt",
    "bad return option": "output_type='bogus' is not an output of QwenImagePipeline",
    "negative prompt not a string": "`negative_prompt` must be a string or a list of strings, got 5",
    "NaN guidance": "true_cfg_scale is nan: it must be a finite number",
    "unknown keyword": "QwenImagePipeline takes no 'guidance_scal'",
    "seed beyond 64 bits": "`seed` must be an integer from 0 to 2**64 - 1 (and seed + 1",
    "size beyond the model": "its rotary table holds 4096 positions",
}


@pytest.mark.parametrize("kind", SERVING_ERRORS)
def test_a_serving_loop_survives_each_bad_request_with_the_same_error_on_both_ranks(group, kind):
    _, reports = group
    _same_on_both_ranks(case(reports("serving"), ("bad", kind)), "ValueError", SERVING_ERRORS[kind])


@pytest.mark.parametrize("after", ["again", "after_partial", "after_mismatch"])
def test_after_the_bad_requests_the_group_returns_the_right_image(group, after):
    _, reports = group
    first, _ = case(reports("serving"), "first")
    assert first is not None and first.std() > 0.01, "the first image is flat: nothing was generated"
    leader, other = case(reports("serving"), after)
    assert np.array_equal(leader, first), f"{after}: not the first request's image"
    assert other is None
    print(f"serving loop, all requests: {reports('serving')[0]['seconds']:.1f} s")


def test_a_rank_that_does_not_enter_generate_is_named_within_the_entry_timeout(group):
    _, reports = group
    partial, _ = case(reports("serving"), "partial")
    assert partial["type"] == "GroupOutOfStepError", partial
    assert "Rank(s) [1] did not enter `generate` within 3 s" in partial["message"]


def test_ranks_that_call_generate_with_different_arguments_all_refuse(group):
    _, reports = group
    _same_on_both_ranks(case(reports("serving"), "mismatch"), "GroupOutOfStepError",
                        "called `generate` with different arguments")


@pytest.mark.parametrize("kind", ["leader_only", "leader_only_split"])
def test_a_cfg_pair_fails_alike_on_both_groups(group, kind):
    _, reports = group
    _same_on_both_ranks(case(reports("cfg"), kind), "ValueError", "the leader's tokenizer refused")


def test_a_cfg_pair_stays_usable_after_a_failed_request(group):
    _, reports = group
    leader, other = case(reports("cfg"), "good")
    assert leader is not None and other is None


def test_a_nan_checkpoint_fails_with_non_finite_latents(group):
    _, reports = group
    _same_on_both_ranks(case(reports("nan"), "nan_checkpoint"), "NonFiniteLatentsError",
                        "The latents of rank(s) [0, 1] hold NaN or infinite values at step 0")


def test_a_nan_checkpoint_gives_no_plan_warning(group):
    _, reports = group
    warnings = case(reports("nan"), "warnings")
    assert not [w for messages in warnings for w in messages if "plan" in w], warnings[0]


def test_one_nan_element_on_one_rank_is_caught(group):
    _, reports = group
    _same_on_both_ranks(case(reports("nan"), "one_nan"), "NonFiniteLatentsError",
                        "The latents of rank(s) [1] hold NaN or infinite values at step 3")


@pytest.mark.parametrize("job", ["tp2", "dp2"])
def test_a_full_disk_stops_every_rank_with_the_same_error_and_keeps_finished_images(group, job):
    root, reports = group
    _same_on_both_ranks(case(reports("disk_full"), job), "OutputWriteError", "No space left on device")
    out = root / job
    pngs = sorted(p.name for p in out.glob("*.png"))
    if job == "tp2":  # the first image was written, the second failed on its way to the disk
        assert pngs == ["00000-a-red-fox.png"], pngs
    else:  # rank 0's group wrote its first image and failed on its second; the other group's are complete
        assert "00000-one-fox.png" in pngs and "00002-three-foxes.png" not in pngs, pngs
    for name in pngs:
        assert read_png_text(out / name) is not None, f"{name} is not a complete PNG"
    assert not list(out.glob(".*")), "a temporary file or the lock was left behind"


# -- in this process: checks before anything starts ----------------------------------------------------------------


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _truncated(tmp_path, tiny_checkpoint):
    copy = _copy(tiny_checkpoint, "flux", tmp_path / "truncated")
    weights = next((copy / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return str(copy), weights


def _garbage_vae(tmp_path, tiny_checkpoint):
    copy = _copy(tiny_checkpoint, "flux", tmp_path / "garbage")
    weights = next((copy / "vae").glob("*.safetensors"))
    weights.write_bytes(b"this is not a safetensors file at all")
    return str(copy), weights


def _broken_config(tmp_path, tiny_checkpoint):
    copy = _copy(tiny_checkpoint, "flux", tmp_path / "config")
    (copy / "text_encoder" / "config.json").write_text("{")
    return str(copy), copy / "text_encoder" / "config.json"


BAD_INPUT = {
    "NaN in a .jsonl": (lambda t, c: ["--prompts", _write(t, "p.jsonl", '{"prompt": "a", "guidance": NaN}\n')],
                        "p.jsonl, line 1: 'guidance' must be a finite number, got nan"),
    "Infinity in a .jsonl": (lambda t, c: ["--prompts", _write(t, "p.jsonl", '{"prompt": "a"}\n'
                                                               '{"prompt": "b", "true_cfg_scale": -Infinity}\n')],
                             "p.jsonl, line 2: 'true_cfg_scale' must be a finite number"),
    "seed + index beyond 64 bits": (lambda t, c: ["--seed", str(2**64 - 1), "--prompts", _write(t, "p.txt", "a\nb\n")],
                                    "--seed must be an integer from 0 to 2**64 - 1 (and seed + 1"),
    "per-line seed beyond 64 bits": (lambda t, c: ["--prompts", _write(t, "p.jsonl", '{"prompt": "a", "seed": '
                                                                       f'{2**64}}}\n')],
                                     "line 1: 'seed' must be an integer from 0 to 18446744073709551615"),
    "above the pixel cap": (lambda t, c: ["--prompt", "a fox", "--height", "4096", "--width", "4096"],
                            "above the cap of 4194304 (--max-pixels)"),
    "above the model's sequence range": (lambda t, c: ["--prompt", "a fox", "--height", "65536", "--width", "65536",
                                                       "--max-pixels", str(10**10)],
                                         "exp(mu) overflows above 4190480 tokens"),
    "above the model's rotary table": (lambda t, c: ["--prompt", "a fox", "--model", "qwenimage21", "--height",
                                                     "32800", "--width", "32", "--max-pixels", str(10**10)],
                                       "holds 1024 negative positions"),
    "one step of a terminal-stretched schedule": (
        lambda t, c: ["--prompt", "a fox", "--model", "qwenimage", "--steps", "1"],
        "--steps: 1 denoising step(s) cannot run with this model's scheduler: its sigmas are stretched to end at "
        "shift_terminal=0.02"),
    "per-line one step of a terminal-stretched schedule": (
        lambda t, c: ["--model", "qwenimage", "--prompts", _write(t, "p.jsonl", '{"prompt": "a", "steps": 1}\n')],
        "p.jsonl, line 1: 1 denoising step(s) cannot run"),
    "--out looks like a file name": (lambda t, c: ["--prompt", "a fox", "--out", str(t / "fox.png")],
                                     "looks like a file name, but --out names a folder"),
    "--out cannot be written": (lambda t, c: ["--prompt", "a fox", "--out", "/proc/neuron-diffusers-out"],
                                "cannot write into /proc"),
    "lone surrogate on the command line": (lambda t, c: ["--prompt", "a \udc80 fox"], "holds a lone surrogate"),
    "lone surrogate in a .jsonl": (lambda t, c: ["--prompts", _write(t, "p.jsonl", '{"prompt": "a"}\n'
                                                                     '{"prompt": "a \\ud800 fox"}\n')],
                                   "p.jsonl, line 2: the prompt holds a lone surrogate"),
    "NUL in a .jsonl": (lambda t, c: ["--prompts", _write(t, "p.jsonl", '{"prompt": "a\\u0000fox"}\n')],
                        "p.jsonl, line 1: the prompt holds a NUL character"),
    "negative_prompt not a string": (lambda t, c: ["--prompts", _write(t, "p.jsonl",
                                                                       '{"prompt": "a", "negative_prompt": 5}\n')],
                                     "p.jsonl, line 1: 'negative_prompt' must be a string (or null), got 5"),
    "per-line negative prompt, distilled family": (
        lambda t, c: ["--model", "flux2", "--prompts", _write(t, "p.jsonl", '{"prompt": "a"}\n'
                                                              '{"prompt": "b", "negative_prompt": "c"}\n')],
        "p.jsonl, line 2: Flux2Pipeline is guidance-distilled and takes no negative prompt"),
    "truncated safetensors": (lambda t, c: ["--prompt", "a fox", "--model", _truncated(t, c)[0]],
                              "diffusion_pytorch_model.safetensors is not a complete safetensors file: its tensors "
                              "need"),
    "garbage safetensors": (lambda t, c: ["--prompt", "a fox", "--model", _garbage_vae(t, c)[0]],
                            "vae/diffusion_pytorch_model.safetensors is not a complete safetensors file"),
    "broken component config": (lambda t, c: ["--prompt", "a fox", "--model", _broken_config(t, c)[0]],
                                "text_encoder/config.json: Expecting property name"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_refused_in_one_line_before_anything_is_written(tmp_path, tiny_checkpoint, generate_refuses,
                                                                       case):
    make_args, message = BAD_INPUT[case]
    generate_refuses(make_args(tmp_path, tiny_checkpoint), message)


ARGUMENT_ERRORS = {
    "--guidance nan": (["--guidance", "nan"], "argument --guidance: must be a finite number, got nan"),
    "--true-cfg-scale inf": (["--true-cfg-scale", "inf"], "argument --true-cfg-scale: must be a finite number"),
    "--strength nan": (["--strength", "nan"], "argument --strength: must be a finite number"),
    "--timeout 0": (["--timeout", "0"], "argument --timeout: must be a number above 0, got 0"),
    "--timeout nan": (["--timeout", "nan"], "argument --timeout: must be a finite number"),
    '--out ""': (["--out", ""], "argument --out: is empty"),
    "--max-pixels 0": (["--max-pixels", "0"], "argument --max-pixels: must be a positive integer"),
}


@pytest.mark.parametrize("case", ARGUMENT_ERRORS)
def test_bad_arguments_exit_2_in_one_line(tmp_path, capsys, case):
    extra, message = ARGUMENT_ERRORS[case]
    argv = ["generate", "--prompt", "a fox", *(["--out", str(tmp_path / "out")] if "--out" not in extra else []),
            *extra]
    with pytest.raises(SystemExit) as leaving:
        main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert leaving.value.code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_sigterm_during_a_save_leaves_no_temporary_file_and_no_lock(tmp_path, monkeypatch):
    """torchrun stops its workers with SIGTERM: one landing mid-write leaves the job through Python (exit 143), the
    half-written temporary file removed and the folder's lock released."""
    real_save = Image.Image.save

    def save_then_sigterm(self, fp, *args, **kwargs):
        with open(fp, "wb") as file:
            file.write(b"\x89PNG half an image")
        os.kill(os.getpid(), signal.SIGTERM)  # the Python handler runs at the next bytecode, still in here
        return real_save(self, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save_then_sigterm)
    out, handler = tmp_path / "out", signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as leaving:
        main(["generate", "--prompt", "a red fox", "--out", str(out), "--steps", "1"])
    assert leaving.value.code == 128 + signal.SIGTERM
    assert sorted(p.name for p in out.iterdir()) == [], "a temporary file, an image or the lock was left behind"
    assert signal.getsignal(signal.SIGTERM) is handler, "the job's SIGTERM handler was not put back"


def test_a_nan_checkpoint_exits_1_with_non_finite_latents_and_writes_no_image(tmp_path, capsys, tiny_checkpoint):
    nan_flux = _nan_checkpoint(tiny_checkpoint, tmp_path / "nan-flux")
    out = tmp_path / "out"
    assert main(["generate", "--prompt", "a red fox", "--model", str(nan_flux), "--out", str(out), "--steps", "1"]) == 1
    assert "The latents of rank(s) [0] hold NaN or infinite values at step 0" in capsys.readouterr().err
    assert not list(out.glob("*.png")) and not list(out.glob(".*"))


# -- in this process: resume keyed by settings, one job per folder ------------------------------------------------


def test_resume_is_keyed_by_settings(tmp_path, capsys):
    out = tmp_path / "out"
    base = ["generate", "--out", str(out), "--steps", "1"]
    assert main([*base, "--prompt", "a red fox"]) == 0
    fox = out / "00000-a-red-fox.png"
    stamp = fox.stat().st_mtime_ns
    assert len(read_png_text(fox)["settings_digest"]) == 64

    # Other settings into the same folder: refused before anything loads, naming what differs.
    capsys.readouterr()
    assert main([*base, "--prompt", "a red fox", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "00000-a-red-fox.png was made with other settings than this job's: seed 0 here, 5 now" in err
    assert "--overwrite" in err and "another --out" in err and fox.stat().st_mtime_ns == stamp

    # Broken outputs are made again, stale temporary files and a dead job's lock are cleared, earlier records stay.
    (out / "00001-a-blue-bird.png").write_bytes(b"")
    (out / "00002-a-green-frog.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    (out / ".00000-a-red-fox.png.0123abcd.tmp").write_bytes(b"half")
    (out / LOCK_NAME).write_text(json.dumps({"pid": 999999999, "digest": "gone"}))  # no process holds its flock
    prompts = _write(tmp_path, "p.txt", "a red fox\na blue bird\na green frog\n")
    assert main([*base, "--prompts", prompts]) == 0
    err = capsys.readouterr().err
    assert "2 incomplete output(s)" in err and "removed 1 temporary file(s)" in err
    assert fox.stat().st_mtime_ns == stamp, "the finished image was made again"
    for name in ("00001-a-blue-bird.png", "00002-a-green-frog.png"):
        assert read_png_text(out / name) is not None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated"] == 2 and [r["file"] for r in summary["images"]] == sorted(
        ["00000-a-red-fox.png", "00001-a-blue-bird.png", "00002-a-green-frog.png"])
    assert sorted(p.name for p in out.glob(".*")) == []

    # A folder where an output goes, and a folder in use by a live job: refused.
    (out / "00003-a-cat.png").mkdir()
    assert main([*base, "--prompts", _write(tmp_path, "q.txt", "a red fox\na blue bird\na green frog\na cat\n")]) == 2
    assert "00003-a-cat.png is a folder, where the output of request 3 goes" in capsys.readouterr().err
    lock = JobLock(out, "another job").acquire()
    try:
        assert main([*base, "--prompts", prompts]) == 2
        assert f"is in use by another job (pid {os.getpid()}" in capsys.readouterr().err
    finally:
        lock.release()


# -- units ---------------------------------------------------------------------------------------------------------


def test_a_lock_taken_but_not_yet_written_is_left_to_rank_0s_acquire(tmp_path):
    """Rank 0 of a running group took the folder's lock and has not written its record yet: another rank planning the
    same job does not refuse it as another job's (seen in CI: "pid ? on ?"); once the record names other settings,
    the folder is refused."""
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        check_unlocked(tmp_path, "this job")
        os.write(fd, json.dumps({"digest": "another job", "pid": 1, "host": "h"}).encode())
        with pytest.raises(ValueError, match=r"in use by another job \(pid 1 on h\) with other settings"):
            check_unlocked(tmp_path, "this job")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Request:
    index: int = field(metadata={"key": False})
    prompt: str


@dataclass(frozen=True)
class _LaterRequest(_Request):
    image: str | None = field(default=None, metadata={"key": lambda path: f"sha256 of {path}"})
    loras: tuple = ()


def test_the_settings_key_grows_without_changing_earlier_digests():
    key = settings_key(_Request(0, "a fox"), model="flux", dtype="float32")
    assert key == {"key_version": 1, "model": "flux", "dtype": "float32", "prompt": "a fox"}
    # A field added later, left at its default, and another index (it is in the file name): the same digest.
    assert digest(settings_key(_LaterRequest(7, "a fox"), model="flux", dtype="float32")) == digest(key)
    later = settings_key(_LaterRequest(0, "a fox", image="fox.png", loras=("style",)), model="flux", dtype="float32")
    assert later["image"] == "sha256 of fox.png" and later["loras"] == ("style",)
    assert digest(later) != digest(key)
    assert digest(settings_key(_Request(0, "a fox"), model="flux", dtype="bfloat16")) != digest(key)


def test_incomplete_outputs_are_not_read_as_done(tmp_path):
    image = tmp_path / "ok.png"
    Image.new("RGB", (8, 8)).save(image, pnginfo=_info({"settings_digest": "abc"}))
    assert read_png_text(image) == {"settings_digest": "abc"}
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(image.read_bytes()[:-20])
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "folder.png").mkdir()
    for name in ("truncated.png", "empty.png", "folder.png", "missing.png"):
        assert read_png_text(tmp_path / name) is None, name
    (tmp_path / "garbage.mp4").write_bytes(b"not a video")
    assert read_video_text(tmp_path / "garbage.mp4") is None
    video = VideoWithAudio(torch.rand(5, 3, 16, 16), fps=24.0, audio=torch.rand(2, 800) * 2 - 1, sampling_rate=16000)
    save_video(video, tmp_path / "clip.mp4", text={"settings_digest": "abc"})  # MiniMax-H3's outputs
    assert read_video_text(tmp_path / "clip.mp4")["settings_digest"] == "abc"
    (tmp_path / "clip.wav").unlink()
    assert read_video_text(tmp_path / "clip.mp4") is None, "an MP4 without its WAV is not a complete H3 output"


def _info(text):
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    return info


def test_size_limits_sit_exactly_where_the_stock_code_breaks():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Rope

    from neuron_diffusers.checkpoint import resolve
    from neuron_diffusers.pipelines.qwenimage21 import QwenImage21Adapter

    flux = resolve("flux")
    tokens = flux.adapter.max_pixels(flux)[0] // 16**2
    mu = flux.adapter.shift_mu(flux)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(flux.config("scheduler", "scheduler_config.json"))
    scheduler.set_timesteps(2, mu=mu(tokens))  # the largest allowed size runs
    with pytest.raises(OverflowError):
        scheduler.set_timesteps(2, mu=mu(tokens + 1))  # one token more: the raw error the limit prevents
    with torch.device("meta"):
        table = QwenImage21Rope(theta=10000, axes_dim=[2, 2, 2]).freqs[0].shape[0]
    assert table == 8192 + QwenImage21Adapter.rope_negative_positions


def test_nan_latents_are_caught_without_a_group():
    with pytest.raises(NonFiniteLatentsError, match=r"rank\(s\) \[0\] hold NaN or infinite values at step 1"):
        LatentAgreement(None).check([torch.tensor([1.0, float("inf")])], "step 1")


def test_a_failed_agreement_is_a_lost_group_not_the_calls_error(monkeypatch):
    """gloo reports a dead peer as a plain RuntimeError: when the exchange `agree` makes fails, that becomes a
    `GroupLostError`, a `DistError`, which ends the job or the server instead of passing for one request's error."""
    import torch.distributed as dist

    from neuron_diffusers import consistency

    def lost(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer")

    monkeypatch.setattr(consistency.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(consistency.dist, "all_gather_object", lost)
    with pytest.raises(consistency.GroupLostError, match="a peer of this rank's group is gone: .*Connection reset") as \
            raised:
        consistency.agree(ValueError("the call's own error"), object())
    assert isinstance(raised.value, dist.DistError)
