"""CFG parallelism: the two guidance branches on two TP groups give the stock single-process image, with half the
transformer forwards per rank.

Two spawns (2 ranks: one CFG pair at tp=1; 4 ranks: cfg=2 x tp=2) run every check, the `generate` job included
(run in the spawned process group as torchrun would run it); the stock references run in this process.
"""

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import rank_jobs
import torch

from neuron_diffusers import tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.job import pair_work, plan_job
from neuron_diffusers.runner import _check_cfg_parallel_kwargs
from neuron_diffusers.tools.spawn import run_on_cpu_ranks

FAMILIES = ("qwenimage", "qwenimage21", "flux")
# FLUX.1 pads its text to `max_sequence_length`: 32 tokens instead of 512 keep the tiny model quick.
CALLS = {family: {**tiny.smallest_call(family), **({"max_sequence_length": 32} if family == "flux" else {})}
         for family in FAMILIES}
CASES = {family: (family, CALLS[family]) for family in FAMILIES}
CASES["qwenimage21 without KV cache"] = ("qwenimage21", {**tiny.smallest_call("qwenimage21"), "use_kv_cache": False})
STEPS = 2


def stock_image(checkpoint, call: dict, prompt=rank_jobs.CFG_PROMPT, seed=0, **cfg) -> np.ndarray:
    """The stock pipeline alone in this process, as float HWC in [0, 1]; counts its transformer forwards."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(checkpoint)
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        image = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **call,
                     **cfg).images[0]
    stock_image.forwards = len(calls)
    return image


def _guided(checkpoint, call):
    return stock_image(checkpoint, call, negative_prompt=rank_jobs.CFG_NEGATIVE, true_cfg_scale=4.0)


def _job_argv(out, family, checkpoint, *, mixed=False):
    prompts = out.parent / f"{out.name}.jsonl"
    lines = [{"prompt": rank_jobs.CFG_PROMPT, "negative_prompt": rank_jobs.CFG_NEGATIVE}]
    if mixed:  # two requests without true CFG: one per group of the pair
        lines += [{"prompt": "a blue bird"}, {"prompt": "a green frog"}]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    scale = ["--true-cfg-scale", "4"] if family == "flux" else ["--guidance", "4"]
    return ["--model", str(checkpoint), "--prompts", str(prompts), "--out", str(out), "--cfg-parallel",
            "--height", "32", "--width", "32", "--steps", str(STEPS), *scale]


def _png(image: np.ndarray) -> np.ndarray:
    """What the stock pipeline's PIL output (and so the job's PNG) holds for a float image."""
    return (image * 255).round().astype(np.uint8)


def _assert_same_image(output, expected, what):
    assert output.shape == expected.shape, what
    difference = np.abs(output.astype(np.float64) - expected.astype(np.float64)).mean()
    scale = 255 if output.dtype == np.uint8 else 1
    assert difference < scale / 255, f"{what}: mean abs difference {difference / scale:.5f}"


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return {family: tiny_checkpoint(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(checkpoints):
    images, forwards = {}, {}
    for case, (family, call) in CASES.items():
        images[case] = _guided(checkpoints[family], call)
        forwards[case] = stock_image.forwards
    return images, forwards


@pytest.fixture(scope="module")
def job_references(checkpoints, references):
    """The job's images as stock makes them (PNG pixels): the job leaves FLUX.1 its stock 512 text tokens."""
    images = {family: references[0][family] for family in FAMILIES}
    images["flux"] = _guided(checkpoints["flux"], tiny.smallest_call("flux"))
    return {family: _png(image) for family, image in images.items()}


def test_cfg_pair_matches_stock_with_half_the_forwards(checkpoints, references, job_references, tmp_path):
    jobs = {family: _job_argv(tmp_path / family, family, checkpoints[family], mixed=family == "qwenimage")
            for family in FAMILIES}
    split_call = tiny.smallest_call("qwenimage")
    leader, partner = run_on_cpu_ranks(rank_jobs.cfg_pair_checks, 2, checkpoints, CASES, split_call, jobs,
                                       timeout_s=600)
    images, stock_forwards = references
    assert leader["mesh"] == (("dp", "cfg", "tp"), (1, 2, 1))

    for case in CASES:
        mine, other = leader["cases"][case], partner["cases"][case]
        assert other["image"] is None, "only the pair's leader returns the image"
        _assert_same_image(mine["image"], images[case], case)
        assert mine["equals_serial"], f"{case}: CFG-parallel is not bitwise equal to serial CFG"
        # Transformer forwards per rank halve: one per step instead of two.
        assert stock_forwards[case] == mine["serial_forwards"] == 2 * STEPS
        assert mine["forwards"] == other["forwards"] == STEPS, case
        assert mine["transformer_is_real"] and other["transformer_is_real"]

    # Without true CFG the pair splits the prompts: one image per group, both back on the leader, in order.
    first, second = leader["split"]["images"]
    _assert_same_image(first, stock_image(checkpoints["qwenimage"], split_call), "split, image 0")
    _assert_same_image(second, stock_image(checkpoints["qwenimage"], split_call, prompt="a blue bird", seed=1),
                       "split, image 1")
    assert leader["split"]["forwards"] == partner["split"]["forwards"] == STEPS and partner["split"]["images"] is None

    for report in (leader, partner):
        assert "holds different `hidden_states`" in report["divergence"] and "seed" in report["divergence"]
        # Qwen-Image has no IP-Adapter: refused on both ranks as an unknown keyword, before anything runs.
        assert "QwenImagePipeline takes no 'ip_adapter_image'" in report["ip_adapter"]
    with pytest.raises(ValueError, match="CFG parallelism does not run FLUX's IP-Adapter"):
        _check_cfg_parallel_kwargs(resolve("flux").adapter, {"ip_adapter_image": object()})  # FLUX.1's, true CFG

    for rank, report in enumerate((leader, partner)):
        proxy = report["proxy"]
        assert proxy["exact"], "CFG-parallel differs from serial with unequal branch lengths and a truncated step"
        assert proxy["contexts"] == [("cond", "uncond")[rank]] * 3, "the real model ran outside its branch's context"
        assert all(proxy["forwarded"].values()), proxy["forwarded"]
        errors = proxy["errors"]
        assert "computed a different uncond branch" in errors["wrong_branch"], errors["wrong_branch"]
        assert "holds different `hidden_states`" in errors["diverged"], errors["diverged"]
        assert "outside `cache_context('cond')`" in errors["no_context"]
        assert "no cond call before it" in errors["uncond_first"]
        assert "IP-Adapter" in errors["ip_adapter"]

    # Only the real model is compiled: a CFG-parallel call after warm-up compiles nothing new.
    for report in (leader, partner):
        assert report["compiled"]["warm_up_graphs"] > 0, report["compiled"]
        assert report["compiled"]["new_graphs"] == report["compiled"]["recompiles"] == 0, report["compiled"]
    assert leader["compiled"]["equal"]

    assert partner["jobs"] == {family: None for family in FAMILIES}
    for family, job in leader["jobs"].items():
        _assert_same_image(job["pixels"]["00000-a-red-fox-in-the-snow.png"], job_references[family], f"job {family}")
        assert job["summary"]["mesh"]["shape"] == [1, 2, 1]
        assert job["settings"]["00000-a-red-fox-in-the-snow.png"]["cfg"] == "2"
    assert leader["rerun_generated"] == 0, "a rerun of a finished CFG-parallel job must resume with nothing to do"
    mixed = leader["jobs"]["qwenimage"]
    by_file = {image["file"]: image for image in mixed["summary"]["images"]}
    assert [by_file[name]["rank"] for name in sorted(by_file)] == [0, 0, 1], "requests without CFG must alternate"
    assert [by_file[name]["cfg_parallel"] for name in sorted(by_file)] == [True, False, False]
    call = tiny.smallest_call("qwenimage")
    _assert_same_image(mixed["pixels"]["00002-a-green-frog.png"],
                       _png(stock_image(checkpoints["qwenimage"], call, prompt="a green frog", seed=2,
                                        true_cfg_scale=4.0)),
                       "job, request without CFG on the second group")


def test_cfg2_x_tp2_matches_stock_and_tp_alone(checkpoints, references, job_references, tmp_path):
    cases = {case: CASES[case] for case in FAMILIES}
    jobs = {family: _job_argv(tmp_path / family, family, checkpoints[family]) for family in FAMILIES}
    reports = run_on_cpu_ranks(rank_jobs.cfg_tp_checks, 4, checkpoints, cases, jobs, timeout_s=900)
    images, _ = references
    leader = reports[0]
    assert leader["mesh"] == (("dp", "cfg", "tp"), (1, 2, 2))
    for case in cases:
        _assert_same_image(leader["cases"][case]["image"], images[case], f"cfg2 x tp2 {case}")
        assert leader["cases"][case]["equals_serial"], f"{case}: cfg2 x tp2 differs from TP=2 alone"
        assert [report["cases"][case]["forwards"] for report in reports] == [STEPS] * 4
        assert all(report["cases"][case]["image"] is None for report in reports[1:])
        job = leader["jobs"][case]
        assert job["summary"]["mesh"]["shape"] == [1, 2, 2]
        _assert_same_image(job["pixels"]["00000-a-red-fox-in-the-snow.png"], job_references[case], f"job {case}")


def _plan(tmp_path, world_size, *extra):
    from neuron_diffusers.cli import _parser

    args = _parser().parse_args(["generate", "--prompt", "a fox", "--out", str(tmp_path / "out"), *extra])
    return plan_job(args, world_size, "cpu")


def test_cfg_parallel_without_true_cfg_is_data_parallel(tmp_path):
    # Guidance-distilled families never call the transformer twice: a note, and the ("dp", "tp") mesh.
    plan = _plan(tmp_path, 4, "--model", "h3", "--cfg-parallel")
    assert plan.cfg == 1 and plan.tp == 2 and "guidance-distilled" in plan.notes[0] and "dp=2, tp=2" in plan.notes[0]
    plan = _plan(tmp_path, 2, "--model", "qwenimage", "--cfg-parallel")  # no negative prompt
    assert plan.cfg == 1 and plan.tp == 1 and "data parallelism" in plan.notes[0]
    plan = _plan(tmp_path, 2, "--model", "flux2", "--cfg-parallel", "--tp", "2")  # 2 ranks cannot pair: no error
    assert plan.cfg == 1 and plan.tp == 2 and "dp=1, tp=2" in plan.notes[0]
    plan = _plan(tmp_path, 4, "--model", "flux", "--cfg-parallel", "--negative-prompt", "blurry",
                 "--true-cfg-scale", "4", "--tp", "1")
    assert plan.cfg == 2 and plan.true_cfg == {0} and not plan.notes


def test_pair_work_alternates_requests_without_true_cfg():
    requests = [SimpleNamespace(index=i) for i in range(5)]
    plan = SimpleNamespace(cfg=2, true_cfg={1, 3})
    assert [(r.index, joint) for r, joint in pair_work(requests, plan, 0)] == [(0, False), (1, True), (3, True),
                                                                                (4, False)]
    assert [(r.index, joint) for r, joint in pair_work(requests, plan, 1)] == [(1, True), (2, False), (3, True)]


BAD_CFG_INPUT = {
    "world not divisible by 2 x tp": (["--cfg-parallel", "--negative-prompt", "blurry", "--true-cfg-scale", "4"],
                                      "--cfg-parallel with --tp 1 needs a multiple of 2 x 1 = 2 ranks"),
    "true cfg scale for Qwen-Image": (["--model", "qwenimage", "--true-cfg-scale", "4"], "use --guidance 4"),
    "true cfg scale for FLUX.2": (["--model", "flux2", "--true-cfg-scale", "4"], "has no true CFG"),
}


@pytest.mark.parametrize("case", BAD_CFG_INPUT)
def test_bad_cfg_input_is_rejected_before_anything_is_written(tmp_path, capsys, case):
    from neuron_diffusers.cli import main

    extra, message = BAD_CFG_INPUT[case]
    assert main(["generate", "--prompt", "a fox", "--out", str(tmp_path / "out"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_generate_command_runs_cfg_parallel_under_torchrun(tmp_path, checkpoints, job_references):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "neuron_diffusers",
               "generate", *_job_argv(tmp_path / "out", "flux", checkpoints["flux"])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "tp=1, cfg=2, dp=1" in result.stdout
    from PIL import Image

    pixels = np.asarray(Image.open(tmp_path / "out" / "00000-a-red-fox-in-the-snow.png"))
    _assert_same_image(pixels, job_references["flux"], "torchrun flux")
