"""CFG parallelism: the two guidance branches on two TP groups give the stock single-process latents, with half the
transformer forwards per rank.

Two jobs on the session's rank pool (2 ranks: one CFG pair at tp=1; 4 ranks: cfg=2 x tp=2) record every check as a
case of its own (`rank_cases`), the `generate` job included (run in the pool's process group as torchrun would run
it; torchrun's own launch is tested by .ci/run's README command and tests/test_multinode.py); the stock references
run in this process, once per module.

Every "equals stock" check compares latents (`output_type="latent"`; for the job, the latents its last step
checked) at `LATENT_TOL`, and holds a control in the same test: the stock latents of another prompt (and, with true
CFG, of another negative prompt) must be further from ours than that, or the test fails as blind. The job's PNGs are
held to at most one 8-bit level and 0.5% of values apart.
"""

import json
from types import SimpleNamespace

import cfg_jobs
import numpy as np
import pytest
import rank_jobs
import torch
from rank_cases import case

from neuron_diffusers import tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.job import pair_work, plan_job
from neuron_diffusers.runner import _check_cfg_parallel_kwargs

FAMILIES = ("qwenimage", "qwenimage21", "flux")
# FLUX.1 pads its text to `max_sequence_length`: 32 tokens instead of 512 keep the tiny model quick.
CALLS = {family: {**tiny.smallest_call(family), **({"max_sequence_length": 32} if family == "flux" else {})}
         for family in FAMILIES}
CASES = {family: (family, CALLS[family]) for family in FAMILIES}
CASES["qwenimage21 without KV cache"] = ("qwenimage21", {**tiny.smallest_call("qwenimage21"), "use_kv_cache": False})
STEPS = 2
PROMPT, NEGATIVE = rank_jobs.CFG_PROMPT, rank_jobs.CFG_NEGATIVE
#: The controls' inputs: another prompt, another negative prompt (what the second group of a pair computes with).
CONTROL_PROMPT, CONTROL_NEGATIVE = "a blue bird", "oversaturated, dark"
#: Max abs difference allowed between our latents and stock's. Latents are O(1) float32 values (eps 1.2e-7); a
#: different order of the same sums (TP's all-reduce, the pair's exchange, padded text buckets) moves them by a few
#: eps per operation, 1e-6 after two steps of the tiny models: 1e-4 leaves a hundredfold margin. A prompt swap moves
#: them by 0.02 to 0.5 here (stock against stock, measured 2026-12-04), and every test checks its own control.
LATENT_TOL = 1e-4
#: A job's PNG against stock's: 8-bit rounding of nearly equal floats may flip a value by one level, rarely.
PNG_LEVELS, PNG_SHARE = 1, 0.005
JOB_FILE = "00000-a-red-fox-in-the-snow.png"


def stock_run(pipe, call: dict, prompt=PROMPT, seed=0, **extra) -> dict:
    """The stock pipeline `pipe` alone in this process: its final latents (what `output_type="latent"` returns,
    read at the last step's callback), the image as PNG pixels, and its transformer forwards."""
    calls, final = [], {}
    hook = pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))

    def keep(pipe, step, timestep, kwargs):
        final["latents"] = kwargs["latents"].clone()
        return {}

    try:
        with torch.no_grad():
            image = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **call,
                         **extra, callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"]).images[0]
    finally:
        hook.remove()
    return {"latents": final["latents"][0].numpy(), "png": (image * 255).round().astype(np.uint8),
            "forwards": len(calls)}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return {family: tiny_checkpoint(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def stock(checkpoints):
    """`stock(family, call, prompt=, seed=, **extra)` → `stock_run`, each distinct run once per module, on one stock
    pipeline per family (a call keeps no state for the next)."""
    from diffusers import DiffusionPipeline

    made, pipes = {}, {}

    def get(family, call, prompt=PROMPT, seed=0, **extra):
        key = (family, repr(sorted(call.items())), prompt, seed, repr(sorted(extra.items())))
        if key not in made:
            if family not in pipes:
                pipes[family] = DiffusionPipeline.from_pretrained(checkpoints[family])
            made[key] = stock_run(pipes[family], call, prompt, seed, **extra)
        return made[key]

    return get


def guided(stock, family, call, prompt=PROMPT, negative=NEGATIVE):
    """Stock with true CFG (the negative prompt at `true_cfg_scale=4`)."""
    return stock(family, call, prompt, negative_prompt=negative, true_cfg_scale=4.0)


def assert_latents(ours, expected, controls: dict, what: str):
    """`ours` within `LATENT_TOL` of `expected`, and further than that from every control (else the check is blind)."""
    ours = np.asarray(ours)
    assert ours.shape == expected.shape, (what, ours.shape, expected.shape)
    difference = float(np.abs(ours - expected).max())
    assert difference < LATENT_TOL, f"{what}: latents differ from stock by {difference:.2e} (max abs)"
    for name, control in controls.items():
        moved = float(np.abs(ours - control).max())
        assert moved > LATENT_TOL, f"{what}: blind: stock with {name} is only {moved:.2e} from ours"


def assert_png(pixels: np.ndarray, expected: np.ndarray, what: str):
    """No value more than `PNG_LEVELS` apart, at most `PNG_SHARE` of the values differing."""
    assert pixels.shape == expected.shape, (what, pixels.shape, expected.shape)
    difference = np.abs(pixels.astype(np.int16) - expected.astype(np.int16))
    assert difference.max() <= PNG_LEVELS, f"{what}: a value {difference.max()} levels from stock's"
    assert (difference > 0).mean() <= PNG_SHARE, f"{what}: {(difference > 0).mean():.2%} of the values differ"


def assert_case_latents(stock, case_name, latents):
    family, call = CASES[case_name]
    assert_latents(latents, guided(stock, family, call)["latents"],
                   {"another prompt": guided(stock, family, call, prompt=CONTROL_PROMPT)["latents"],
                    "another negative prompt": guided(stock, family, call, negative=CONTROL_NEGATIVE)["latents"]},
                   case_name)


def _job_argv(out, family, checkpoint, *, mixed=False):
    prompts = out.parent / f"{out.name}.jsonl"
    lines = [{"prompt": PROMPT, "negative_prompt": NEGATIVE}]
    if mixed:  # two requests without true CFG: one per group of the pair
        lines += [{"prompt": "a blue bird"}, {"prompt": "a green frog"}]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    scale = ["--true-cfg-scale", "4"] if family == "flux" else ["--guidance", "4"]
    return ["--model", str(checkpoint), "--prompts", str(prompts), "--out", str(out), "--cfg-parallel",
            "--height", "32", "--width", "32", "--steps", str(STEPS), *scale]


def job_stock(stock, family, prompt=PROMPT):
    """Stock for the job's first request: the job leaves FLUX.1 its stock 512 text tokens."""
    return guided(stock, family, tiny.smallest_call(family), prompt)


def job_latents(result: dict, image: int) -> np.ndarray:
    """The latents of this rank's `image`-th image of a job (`cfg_jobs.final_latents`), without the batch axis."""
    return result["latents"][image][0][0]


def assert_job_image(result, stock, family, what):
    """The job's first image: its latents (the leader's first image) and its PNG against stock's, with a control."""
    expected = job_stock(stock, family)
    assert_latents(job_latents(result, 0), expected["latents"],
                   {"another prompt": job_stock(stock, family, prompt=CONTROL_PROMPT)["latents"]}, what)
    assert_png(result["outputs"]["pixels"][JOB_FILE], expected["png"], what)


@pytest.fixture(scope="module")
def pair(rank_pool, checkpoints, tmp_path_factory):
    """Both ranks' per-case reports of the 2-rank job (one CFG pair, tp=1)."""
    out = tmp_path_factory.mktemp("cfg_pair")
    jobs = {family: _job_argv(out / family, family, checkpoints[family], mixed=family == "qwenimage")
            for family in FAMILIES}
    return rank_pool.run(cfg_jobs.cfg_pair_checks, 2, checkpoints, CASES, tiny.smallest_call("qwenimage"), jobs,
                         timeout_s=600)


@pytest.fixture(scope="module")
def quad(rank_pool, checkpoints, tmp_path_factory):
    """Every rank's per-case reports of the 4-rank job (a CFG pair of TP=2 groups)."""
    out = tmp_path_factory.mktemp("cfg_tp")
    jobs = {family: _job_argv(out / family, family, checkpoints[family]) for family in FAMILIES}
    return rank_pool.run(cfg_jobs.cfg_tp_checks, 4, checkpoints, {name: CASES[name] for name in FAMILIES}, jobs,
                         timeout_s=900)


# --- one CFG pair, tp=1 (2 ranks) -----------------------------------------------------------------------------------


def test_cfg_pair_mesh(pair):
    assert [report["mesh"] for report in pair] == [(("dp", "cfg", "tp"), (1, 2, 1))] * 2


@pytest.mark.parametrize("name", CASES)
def test_cfg_pair_gives_the_stock_latents(pair, stock, name):
    mine, other = case(pair, ("case", name))
    assert other["latents"] is None, "only the pair's leader returns the latents"
    assert_case_latents(stock, name, mine["latents"])


@pytest.mark.parametrize("name", CASES)
def test_cfg_pair_is_bitwise_serial_cfg(pair, name):
    mine, _ = case(pair, ("case", name))
    assert mine["equals_serial"], f"{name}: CFG-parallel latents are not bitwise equal to serial CFG's"


@pytest.mark.parametrize("name", CASES)
def test_cfg_pair_halves_the_forwards_per_rank(pair, stock, name):
    mine, other = case(pair, ("case", name))
    family, call = CASES[name]
    # Transformer forwards per rank halve: one per step instead of two.
    assert guided(stock, family, call)["forwards"] == mine["serial_forwards"] == 2 * STEPS
    assert mine["forwards"] == other["forwards"] == STEPS, name
    assert mine["transformer_is_real"] and other["transformer_is_real"], "the proxy outlived the call"


def test_without_true_cfg_the_pair_splits_the_prompts(pair, stock):
    """One image per group, both back on the leader, in order: each the stock latents of its prompt and seed."""
    leader, partner = case(pair, "split")
    call = tiny.smallest_call("qwenimage")
    assert partner["latents"] is None and len(leader["latents"]) == 2
    for index, (prompt, other) in enumerate(((PROMPT, CONTROL_PROMPT), ("a blue bird", PROMPT))):
        assert_latents(leader["latents"][index], stock("qwenimage", call, prompt, seed=index)["latents"],
                       {"another prompt": stock("qwenimage", call, other, seed=index)["latents"]}, f"split {index}")
    assert leader["forwards"] == partner["forwards"] == STEPS


def test_divergent_seed_is_caught_on_both_ranks(pair):
    for message in case(pair, "divergence"):
        assert "holds different `hidden_states`" in message and "seed" in message, message


def test_ip_adapter_is_refused(pair):
    # Qwen-Image has no IP-Adapter: refused on both ranks as an unknown keyword, before anything runs.
    for message in case(pair, "ip_adapter"):
        assert "QwenImagePipeline takes no 'ip_adapter_image'" in message, message
    with pytest.raises(ValueError, match="CFG parallelism does not run FLUX's IP-Adapter"):
        _check_cfg_parallel_kwargs(resolve("flux").adapter, "blurry", {"ip_adapter_image": object(),
                                                                        "true_cfg_scale": 4.0})  # FLUX.1's, true CFG


def test_proxy_is_exact_with_unequal_branches_and_a_truncated_step(pair):
    for rank, proxy in enumerate(case(pair, "proxy")):
        assert proxy["exact"], "CFG-parallel differs from serial with unequal branch lengths and a truncated step"
        assert proxy["contexts"] == [("cond", "uncond")[rank]] * 3, "the real model ran outside its branch's context"


def test_proxy_forwards_the_real_models_attributes(pair):
    for proxy in case(pair, "proxy"):
        assert all(proxy["forwarded"].values()), proxy["forwarded"]


def test_proxy_refuses_what_it_cannot_run(pair):
    for proxy in case(pair, "proxy"):
        errors = proxy["errors"]
        assert "computed a different uncond branch" in errors["wrong_branch"], errors["wrong_branch"]
        assert "holds different `hidden_states`" in errors["diverged"], errors["diverged"]
        assert "outside `cache_context('cond')`" in errors["no_context"]
        assert "no cond call before it" in errors["uncond_first"]
        assert "IP-Adapter" in errors["ip_adapter"]


def test_compiled_real_model_compiles_nothing_new_under_cfg_parallel(pair):
    compiled = case(pair, "compiled")
    for report in compiled:
        assert report["warm_up_graphs"] > 0, report
        assert report["new_graphs"] == report["recompiles"] == 0, report
    assert compiled[0]["equal"], "compiled latents differ from eager's"


@pytest.mark.parametrize("family", FAMILIES)
def test_cfg_pair_job_gives_the_stock_image(pair, stock, family):
    leader, partner = case(pair, ("job", family))
    assert partner["outputs"] is None
    assert_job_image(leader, stock, family, f"job {family}")
    assert leader["outputs"]["summary"]["mesh"]["shape"] == [1, 2, 1]
    assert leader["outputs"]["settings"][JOB_FILE]["cfg"] == "2"


def test_cfg_pair_job_rerun_has_nothing_to_do(pair):
    rerun, _ = case(pair, "rerun")
    assert rerun["summary"]["generated"] == 0, "a rerun of a finished CFG-parallel job must resume with nothing to do"


def test_job_requests_without_cfg_alternate_between_the_groups(pair, stock):
    leader, partner = case(pair, ("job", "qwenimage"))
    by_file = {image["file"]: image for image in leader["outputs"]["summary"]["images"]}
    assert [by_file[name]["rank"] for name in sorted(by_file)] == [0, 0, 1], "requests without CFG must alternate"
    assert [by_file[name]["cfg_parallel"] for name in sorted(by_file)] == [True, False, False]
    # Request 2 ("a green frog", seed 2, no negative: no true CFG) is the second group's (rank 1's) second image.
    call = tiny.smallest_call("qwenimage")
    expected = stock("qwenimage", call, "a green frog", seed=2, true_cfg_scale=4.0)
    assert_latents(job_latents(partner, -1), expected["latents"],
                   {"another prompt": stock("qwenimage", call, CONTROL_PROMPT, seed=2, true_cfg_scale=4.0)["latents"]},
                   "job, request without CFG on the second group")
    assert_png(leader["outputs"]["pixels"]["00002-a-green-frog.png"], expected["png"], "job, 00002-a-green-frog.png")


# --- cfg=2 x tp=2 (4 ranks) -----------------------------------------------------------------------------------------


def test_cfg2_x_tp2_mesh(quad):
    assert quad[0]["mesh"] == (("dp", "cfg", "tp"), (1, 2, 2))


@pytest.mark.parametrize("family", FAMILIES)
def test_cfg2_x_tp2_gives_the_stock_latents(quad, stock, family):
    results = case(quad, ("case", family))
    assert all(result["latents"] is None for result in results[1:]), "only the pair's leader returns the latents"
    assert_case_latents(stock, family, results[0]["latents"])


@pytest.mark.parametrize("family", FAMILIES)
def test_cfg2_x_tp2_is_bitwise_tp2_alone_with_one_forward_per_step(quad, family):
    results = case(quad, ("case", family))
    assert results[0]["equals_serial"], f"{family}: cfg2 x tp2 differs from TP=2 alone"
    assert [result["forwards"] for result in results] == [STEPS] * 4


@pytest.mark.parametrize("family", FAMILIES)
def test_cfg2_x_tp2_job_gives_the_stock_image(quad, stock, family):
    results = case(quad, ("job", family))
    assert all(result["outputs"] is None for result in results[1:])
    assert_job_image(results[0], stock, family, f"cfg2 x tp2 job {family}")
    assert results[0]["outputs"]["summary"]["mesh"]["shape"] == [1, 2, 2]


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
    "two true cfg scales for Qwen-Image": (["--model", "qwenimage", "--guidance", "3", "--true-cfg-scale", "4"],
                                           "--guidance and --true-cfg-scale both set true_cfg_scale and differ"),
    "true cfg scale for FLUX.2": (["--model", "flux2", "--true-cfg-scale", "4"], "has no true CFG"),
}


@pytest.mark.parametrize("case", BAD_CFG_INPUT)
def test_bad_cfg_input_is_rejected_before_anything_is_written(tmp_path, capsys, case):
    from neuron_diffusers.cli import main

    extra, message = BAD_CFG_INPUT[case]
    assert main(["generate", "--prompt", "a fox", "--out", str(tmp_path / "out"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
