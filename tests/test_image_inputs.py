"""Image-conditioned stock pipelines under TP give the stock single-process image, and what the transformer sees.

Each case runs as its own job on the session's 2 CPU ranks (`rank_pool`), through `load_pipeline(...,
pipeline_class=...)` and `generate(image=...)`: FLUX.1 Kontext, img2img and inpainting from the tiny FLUX.1 folder,
Qwen-Image-Edit-Plus with two input images, FLUX.2 with two reference images and Qwen-Image-2.1 with an input image
at TP=2, and Qwen-Image-Edit-Plus with true CFG over a CFG pair (cfg=2), all with `parallel_vae=False` (one rank
encodes); then Kontext and Qwen-Image-Edit-Plus with `parallel_vae=True` (every rank encodes and decodes a band).
The stock references run in this process.

Besides the issue's pixel criterion (mean abs difference < 1/255), the transformer's first-call inputs are held to
1e-5 (float32 rounding: the ranks run one thread, this process more, so convolutions sum in another order): on
these random tiny models another input image moves Kontext's output by ~3e-5 per pixel, far under 1/255, so pixels
alone could not tell right image latents from wrong ones. A control shows that another input image moves those
inputs far more (and, for the vision-language encoders, the prompt embeddings too).
"""

import numpy as np
import pytest
import torch
from image_jobs import (
    CASES,
    COMPARED,
    NEGATIVE,
    PROMPT,
    case_inputs,
    first_call_inputs,
    image_case_check,
    input_image,
    leader_failure_check,
    pair_share_check,
)

from neuron_diffusers import tiny
from neuron_diffusers.pipelines.qwenimage21 import QwenImage21Adapter

#: Classes whose vision-language text encoder reads the input images.
READS_IMAGE = ("edit_plus", "qwenimage21", "edit_plus_cfg")
#: Cases whose in-call encoding (`encode_prompt(image=...)`) is padded to the family's text buckets.
PADDED = {"qwenimage21": QwenImage21Adapter.buckets}


@pytest.fixture(scope="module")
def checkpoints():
    return {name: str(tiny.cached_tiny(name)) for name in ("flux", "flux2", "qwenimage21", "qwenimage_edit")}


@pytest.fixture(scope="module")
def case_reports(checkpoints, rank_pool):
    """`case_reports(name)` → both ranks' entries of case `name`, one job a case (run on first use)."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = rank_pool.run(image_case_check, 2, checkpoints, CASES[name], timeout_s=900)
        return made[name]

    return get


_STOCK = {}  # (case without `parallel_vae`, first image) -> stock(): a parallel-VAE case has its twin's reference


def stock(checkpoints, case, first_image=None):
    """The stock class alone in this process: its image and the transformer's first-call inputs."""
    key = (repr({k: v for k, v in case.items() if k != "parallel_vae"}), first_image)
    if key not in _STOCK:
        _STOCK[key] = _stock(checkpoints, case, first_image)
    return _STOCK[key]


def _stock(checkpoints, case, first_image=None):
    import diffusers
    from image_jobs import shrink_edit_vae_area

    shrink_edit_vae_area()
    pipe = getattr(diffusers, case["class"]).from_pretrained(checkpoints[case["model"]])
    pipe.set_progress_bar_config(disable=True)
    negative = {"negative_prompt": case["negative"]} if case.get("negative") else {}
    with torch.no_grad(), first_call_inputs(pipe.transformer) as seen:
        image = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), output_type="np", **negative,
                     **case_inputs(case, first_image), **case["call"]).images[0]
    return np.asarray(image, dtype=np.float32), seen[0].numpy(), seen[1].numpy()


@pytest.mark.parametrize("name", COMPARED)
def test_tp2_matches_the_stock_single_process_image_and_inputs(checkpoints, case_reports, name):
    leader, other = case_reports(name)
    assert "error" not in leader and "error" not in other, (leader.get("error"), other.get("error"))
    case = CASES[name]
    if case.get("cfg"):  # a CFG pair at tp=1: both ranks are TP leaders, the pair's leader returns the image
        assert other["output"] is None and other["holds_vae"]
    image, hidden, text = stock(checkpoints, case)
    output, (hidden_tp, text_tp) = leader["output"], leader["inputs"]
    assert output.shape == image.shape
    assert np.abs(output - image).mean() < 1 / 255
    assert hidden_tp.shape == hidden.shape and np.abs(hidden_tp - hidden).max() < 1e-5, "noise or image latents"
    if name in PADDED:  # the in-call encoding is padded to a bucket as the text-only path's is: zero rows, masked
        length = text.shape[1]
        assert text_tp.shape[1] in PADDED[name] and text_tp.shape[1] > length, text_tp.shape
        assert not text_tp[:, length:].any()
        text_tp = text_tp[:, :length]
        # Exact, not only within 1/255: a padded row numbered as stock numbers it would move the image block.
        assert np.abs(output - image).max() < 1e-4
    assert text_tp.shape == text.shape and np.abs(text_tp - text).max() < 1e-5, "prompt embeddings"

    # Control: the comparison above can fail. Another first input image moves the transformer's inputs by far more.
    _, hidden_other, text_other = stock(checkpoints, case, first_image=case["images"][0] + 10)
    assert np.abs(hidden_other - hidden).mean() > 1e-3
    if name in READS_IMAGE:
        assert text_other.shape != text.shape or np.abs(text_other - text).max() > 1e-2


@pytest.mark.parametrize("name", COMPARED)
def test_followers_hold_no_vae_weights_nor_encoder_and_the_pipeline_is_restored(case_reports, name):
    leader, other = case_reports(name)
    assert leader["holds_vae"] and leader["holds_encoder"], name
    assert leader["vae_after_call"].startswith("AutoencoderKL"), name
    assert leader["encode_prompt_restored"] and other["encode_prompt_restored"], name
    if CASES[name].get("parallel_vae"):  # every rank holds the VAE and encodes its band of every input image
        assert other["holds_vae"] and not other["holds_encoder"], name
        assert other["vae_encoder_calls"] == leader["vae_encoder_calls"] > 0, name
    elif not CASES[name].get("cfg"):
        assert leader["vae_encoder_calls"] > 0 and other["vae_encoder_calls"] == 0, name
        assert not other["holds_vae"] and not other["holds_encoder"] and other["vae_after_call"] is None, name
        real = other["follower_vae_real"]
        assert not [n for n in real if n.startswith(("encoder.", "decoder."))], (name, real)
        if name == "flux2":  # FLUX.2 normalises image latents with the VAE's batch-norm statistics on every rank
            assert {"bn.running_mean", "bn.running_var"} <= set(real)


def test_a_rank_given_another_image_fails_on_every_rank(case_reports):
    reports = case_reports("diverged")
    entry_errors = [report.get("entry_error", "") for report in reports]
    assert entry_errors[0] == entry_errors[1] and "called `generate` with different arguments" in entry_errors[0]
    errors = [report.get("error", "") for report in reports]
    assert all(error.startswith("ImageInputsDivergedError") for error in errors), errors
    assert all("image the VAE encodes" in error and "rank(s) [1]" in error for error in errors)


def test_a_failure_on_the_encoding_rank_reaches_every_rank(rank_pool):
    leader, other = rank_pool.run(leader_failure_check, 2)
    assert leader == "MemoryError: out of memory in the VAE"
    assert other.startswith("LeaderFailedError") and "out of memory in the VAE" in other


def test_a_tp_group_that_computes_itself_shares_over_the_cfg_pair_only(rank_pool):
    """Parallel VAE on a CFG pair: CFG rank 0's TP group encodes (here one rank), its partner only receives."""
    for rank, report in enumerate(rank_pool.run(pair_share_check, 2)):
        assert report == {"computed": [0] if rank == 0 else [], "shared": [[1.0] * 3] * 2, "none": True}


def test_the_cfg_case_uses_true_cfg():
    """The CFG-pair case must really run true CFG (a negative prompt and a scale above 1), or it proves nothing."""
    case = CASES["edit_plus_cfg"]
    assert case["negative"] == NEGATIVE and case["call"]["true_cfg_scale"] > 1 and case["cfg"] == 2


@pytest.mark.parametrize("buckets", [None, ()], ids=["default buckets", "no buckets (control)"])
def test_qwenimage21_with_an_input_image_compiles_once_across_prompt_lengths(checkpoints, buckets):
    """The in-call encoding is padded to the text buckets: after warm-up, prompts of 1 to 30 words reuse the graphs
    (aot_eager, one process). The control without buckets compiles again for each length, so the check can fail."""
    import neuron_diffusers as nd
    from neuron_diffusers.compile import compile_repeated_blocks, compile_report

    torch._dynamo.reset()  # the other case's graphs of the same block code would count against the recompile limit
    pipe = nd.load_pipeline(checkpoints["qwenimage21"], **({} if buckets is None else {"buckets": buckets}))
    compile_repeated_blocks(pipe, backend="aot_eager")
    call = {"image": input_image(1), **CASES["qwenimage21"]["call"], "output_type": "np"}
    pipe.generate(["warm up"], seed=0, **call)
    before = compile_report()
    for words in (1, 5, 12, 30):
        pipe.generate([" ".join(["fox"] * words)], seed=0, **call)
    after = compile_report()
    new = after["graphs"] - before["graphs"], after["recompiles"] - before["recompiles"]
    assert new == (0, 0) if buckets is None else min(new) > 0, new
