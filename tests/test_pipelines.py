"""Pipeline adapters: padding to a length bucket in one process and on 2 ranks (the session's pool, `rank_pool`, one
job a layout, a case each), and the adapter registry's errors."""

import json

import numpy as np
import pipeline_jobs
import pytest
import torch
from rank_cases import case

from neuron_diffusers import tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.pipelines import bucket_for


def latents_from(pipe, embeds):
    with torch.no_grad():
        return pipe(**embeds, height=32, width=32, num_inference_steps=2, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images


@pytest.fixture(scope="module")
def qwen_runs(tiny_checkpoint):
    """For each Qwen family: latents from unpadded and from bucket-padded embeddings of the same prompts, from the stock
    pipeline as it is; for Qwen-Image-2.1 also from padded embeddings with our positions (`exact_text_padding`)."""
    from diffusers import DiffusionPipeline

    from neuron_diffusers.pipelines.qwenimage21_padding import exact_text_padding

    runs = {}
    for family in ("qwenimage", "qwenimage21"):
        checkpoint = tiny_checkpoint(family)
        adapter = resolve(checkpoint).adapter
        pipe = DiffusionPipeline.from_pretrained(checkpoint)
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            embeds = adapter.encode(pipe, "a red fox in the snow", "blurry")
        padded = adapter.pad(embeds, (64,))
        runs[family] = adapter, embeds, padded, latents_from(pipe, embeds), latents_from(pipe, padded)
        if family == "qwenimage21":
            handle = exact_text_padding(pipe.transformer)
            runs["qwenimage21 exact"] = latents_from(pipe, padded), latents_from(pipe, embeds)
            handle.remove()
            runs["qwenimage21 removed"] = latents_from(pipe, padded)
    return runs


def test_padding_to_a_bucket_keeps_qwen_image_exact(qwen_runs):
    adapter, embeds, padded, unpadded_latents, padded_latents = qwen_runs["qwenimage"]
    assert adapter.buckets, "Qwen-Image pads to static lengths"
    for prefix in ("", "negative_"):
        length = embeds[f"{prefix}prompt_embeds"].shape[1]
        assert length < 64 and padded[f"{prefix}prompt_embeds"].shape[1] == 64
        assert padded[f"{prefix}prompt_embeds_mask"].sum().item() == length
    assert (padded_latents - unpadded_latents).abs().max().item() < 1e-5


def test_qwen_image21_is_exact_padded_only_with_our_positions(qwen_runs):
    """The sentinel: stock Qwen-Image-2.1 places the image after every text position, padding included, so padding
    moves the image; with `exact_text_padding` it does not (and unpadded input is untouched). If stock alone starts to
    give the unpadded latents, upstream changed the RoPE layout: `exact_text_padding` can go."""
    adapter, embeds, padded, unpadded_latents, stock_padded_latents = qwen_runs["qwenimage21"]
    assert adapter.buckets == (64, 128, 256, 512, 1024)
    assert padded["prompt_embeds"].shape[1] == 64 > embeds["prompt_embeds"].shape[1]
    assert (stock_padded_latents - unpadded_latents).abs().max().item() > 1e-4
    exact_padded, exact_unpadded = qwen_runs["qwenimage21 exact"]
    assert (exact_padded - unpadded_latents).abs().max().item() < 1e-5
    assert torch.equal(exact_unpadded, unpadded_latents)
    assert torch.equal(qwen_runs["qwenimage21 removed"], stock_padded_latents), "remove() restores stock"


QI21_PROMPTS = ["a red fox", " ".join(["a red fox in the snow under a pale winter light"] * 12)]
QI21_CASES = [(use_kv_cache, index) for use_kv_cache in (True, False) for index in range(len(QI21_PROMPTS))]


@pytest.fixture(scope="module")
def bucket_reports(tiny_checkpoint, rank_pool):
    """`bucket_reports(layout)` → both ranks' per-case reports: default (bucketed) Qwen-Image-2.1 against
    `buckets=()` on the same two ranks, true CFG, KV cache on and off, a short prompt and a long one (run on first
    use, on the session's pool of 2 ranks)."""
    made = {}

    def get(layout):
        if layout not in made:
            made[layout] = rank_pool.run(pipeline_jobs.qwenimage21_bucket_checks, 2, layout,
                                         tiny_checkpoint("qwenimage21"), tiny.smallest_call("qwenimage21"),
                                         QI21_PROMPTS, timeout_s=900)
        return made[layout]

    return get


@pytest.mark.parametrize("use_kv_cache, index", QI21_CASES)
@pytest.mark.parametrize("layout", pipeline_jobs.QI21_LAYOUTS)
def test_qwen_image21_bucketed_transformer_outputs_equal_unpadded(bucket_reports, layout, use_kv_cache, index):
    """TP=2, CFG-parallel (cfg=2) and context-parallel (tp1 x ulysses2): every forward's target rows, on each rank."""
    for rank, result in enumerate(case(bucket_reports(layout), (use_kv_cache, index))):
        assert result["output_diff"] < 1e-5, (rank, result)


@pytest.mark.parametrize("layout", pipeline_jobs.QI21_LAYOUTS)
def test_qwen_image21_bucketed_images_equal_unpadded(bucket_reports, layout):
    """Float images (before 8-bit rounding) at 1e-4, max abs: the transformer outputs agree within 1e-5; another
    prompt's image (the control) must lie further away, or the comparison is blind."""
    leaders = {key: case(bucket_reports(layout), key)[0] for key in QI21_CASES}
    for key, result in leaders.items():
        assert result["image_diff"] < 1e-4, (key, result["image_diff"])
        other = next(leaders[k] for k in QI21_CASES if k[0] == key[0] and k[1] != key[1])
        moved = float(np.abs(other["image"].astype(np.float64) - result["image"]).max())
        assert moved > 1e-4, f"{key}: another prompt moves the image by only {moved:.1e}: blind"


@pytest.mark.parametrize("layout", pipeline_jobs.QI21_LAYOUTS)
def test_qwen_image21_pads_text_into_its_buckets(bucket_reports, layout):
    for key in QI21_CASES:
        for result in case(bucket_reports(layout), key):
            bucketed, unpadded = result["text_lengths"]["bucketed"], result["text_lengths"]["unpadded"]
            assert bucketed and set(bucketed) <= {64, 128, 256, 512, 1024} and max(unpadded) < max(bucketed), key
    long_prompt = {length for key in QI21_CASES if key[1] == 1
                   for result in case(bucket_reports(layout), key) for length in result["text_lengths"]["bucketed"]}
    assert max(long_prompt) >= 256, "the long prompt pads into a larger bucket"


def test_qwen_image21_under_ulysses_is_plain_when_bucketed_and_any_length_unpadded(bucket_reports):
    """Padded: plain Ulysses, static shapes; unpadded: ulysses_anything."""
    for key in QI21_CASES:
        for result in case(bucket_reports("tp1 x ulysses2"), key):
            assert result["modes"] == {"bucketed": (False, False, True), "unpadded": (True, False, True)}, key


def test_pad_rounds_a_prompt_longer_than_every_bucket_up_to_a_static_length(qwen_runs):
    """Stock runs a prompt of any length the model can position: past the largest bucket the length is rounded up
    to a multiple of a quarter of it (a few static shapes), never refused."""
    adapter, embeds, *_ = qwen_runs["qwenimage"]
    length = embeds["prompt_embeds"].shape[1]
    buckets = (2, 4)
    assert length >= buckets[-1], "the case must overflow the buckets"
    padded = adapter.pad(embeds, buckets)
    assert padded["prompt_embeds"].shape[1] == length + 1  # step 4 // 4 = 1: the next length, one masked row
    assert torch.equal(padded["prompt_embeds"][:, :length], embeds["prompt_embeds"])
    assert not padded["prompt_embeds_mask"][:, length:].any()
    assert bucket_for((64, 128), 130, "P") == 160 and bucket_for((64, 128), 128, "P") == 160
    assert bucket_for((64, 128), 127, "P") == 128  # inside the buckets: unchanged


def test_every_family_has_an_adapter_and_unknown_pipelines_are_named(tiny_checkpoint, tmp_path):
    for family in tiny.FAMILIES:
        assert resolve(tiny_checkpoint(family)).adapter is not None
    index = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError,
                       match="StableDiffusionPipeline, which neuron_diffusers does not run.*Supported: FluxPipeline"):
        resolve(tmp_path)


def test_component_names_skip_config_values(tiny_checkpoint):
    names = resolve(tiny_checkpoint("qwenimage21")).component_names()
    assert "sample_sigmas" not in names and {"transformer", "vae", "processor"} <= set(names)
