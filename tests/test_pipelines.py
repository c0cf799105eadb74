"""Pipeline adapters in one process: padding to a length bucket, and the adapter registry's errors."""

import json

import pytest
import torch

from neuron_diffusers.checkpoint import resolve


def latents_from(pipe, embeds):
    with torch.no_grad():
        return pipe(**embeds, height=32, width=32, num_inference_steps=2, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images


@pytest.fixture(scope="module")
def qwen_runs(tiny_checkpoint):
    """For each Qwen family: latents from unpadded and from bucket-padded embeddings of the same prompts."""
    from diffusers import DiffusionPipeline

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
    return runs


def test_padding_to_a_bucket_keeps_qwen_image_exact(qwen_runs):
    adapter, embeds, padded, unpadded_latents, padded_latents = qwen_runs["qwenimage"]
    assert adapter.buckets, "Qwen-Image pads to static lengths"
    for prefix in ("", "negative_"):
        length = embeds[f"{prefix}prompt_embeds"].shape[1]
        assert length < 64 and padded[f"{prefix}prompt_embeds"].shape[1] == 64
        assert padded[f"{prefix}prompt_embeds_mask"].sum().item() == length
    assert (padded_latents - unpadded_latents).abs().max().item() < 1e-5


def test_qwen_image21_is_not_bucketed_because_padding_moves_the_image(qwen_runs):
    """Stock Qwen-Image-2.1 places the image after every text position, padding included: if this starts to
    pass exactly, upstream fixed it and the adapter can set `buckets`."""
    adapter, _, _, unpadded_latents, padded_latents = qwen_runs["qwenimage21"]
    assert adapter.buckets == ()
    assert (padded_latents - unpadded_latents).abs().max().item() > 1e-4


def test_pad_rejects_a_prompt_longer_than_every_bucket(qwen_runs):
    adapter, embeds, *_ = qwen_runs["qwenimage"]
    with pytest.raises(ValueError,
                       match="needs a length bucket above .* the largest of QwenImagePipeline is 4.*Shorten"):
        adapter.pad(embeds, (2, 4))


def test_every_family_has_an_adapter_and_unknown_pipelines_are_named(tiny_checkpoint, tmp_path):
    from neuron_diffusers import tiny

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
