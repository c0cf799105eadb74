"""A tiny random MiniMax-H3 (text -> video + stereo audio) for the stock modular `MiniMaxH3Blocks`, built offline.

MiniMax-H3 is modular only: the blocks drive the `t2va` (text), `fl2va` (keyframes) and `ref2va` (references)
workflows, and one checkpoint holds two transformer partitions, `transformer/` for `t2va` / `fl2va` and
`transformer_ref/` for `ref2va`. Both are built, so every workflow works.

Dimensions, chosen so that tensor parallelism over 2 or 4 ranks splits everything evenly:

- `transformer` / `transformer_ref` (`MiniMaxH3Transformer3DModel`): 2 blocks + 2 token-refiner blocks, hidden 32,
  4 heads x head_dim 16 (inner 64 > hidden, as in the released 56 x 128 > 5376), rope_freq_dim 2 (12 of the 16
  head channels rotated), SwiGLU ffn_dim 64 (fused gate/up projection 128), `adaln_proj.linear` 16 -> 576
  (6 chunks x 3 modalities x 32), time embedding 32 -> 32 -> 16, text_dim 16, 4 video latent channels with
  patch (1, 2, 2), 8 audio latent channels.
- `text_encoder` (`Qwen3VLForConditionalGeneration`): 51 text layers, because the pipeline reads
  `hidden_states[50]` and refuses a shallower stack; hidden 16, 8 query / 4 key-value heads x head_dim 8, mlp 32,
  mrope sections (2, 1, 1). A 2-block vision tower (hidden 32, 4 heads) so keyframes and references encode too.
- `vae` (`AutoencoderKLMiniMaxH3`): the released 16x spatial / 4x temporal compression and 17-frame chunks, which
  the pipeline's canvas and frame arithmetic hard-code, at 8 channels; a 1-block ViT decoder (2 heads x 8).
- `audio_vae` (`AutoencoderKLMiniMaxH3Audio`): hop 4 at 160 Hz. The pipeline hard-codes 40 audio latents per
  second, which this keeps while decoding 200x fewer samples than the released hop 800 at 32 kHz.

The stock `MiniMaxH3Scheduler` counts the terminal sigma as a step: `num_inference_steps=N` runs N - 1 transformer
forwards (N >= 2), so two denoising steps are `num_inference_steps=3`.
"""

from __future__ import annotations

import os
import zlib

import torch
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
)
from diffusers.modular_pipelines import MiniMaxH3Blocks
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from ._qwen import qwen3_vl_processor, vl_token_ids

# Height and width must be multiples of `canvas_multiple` = VAE spatial compression 16 x patch 2, so 32 x 32 is the
# smallest canvas: a single (1, 2, 2) patch row per latent frame.
DEFAULT_SIZE = (32, 32)
# The pipeline generates 5 to 15 seconds at a fixed 24 fps and the video VAE decodes `17 * n + 5` frames, so the
# 120 frames of 5 seconds round up to 124: 37 latent frames and 207 audio latents per stereo channel.
DEFAULT_NUM_FRAMES = 124
# Two transformer forwards (the scheduler counts the terminal sigma), at the default clip length.
SMALLEST_CALL = {"num_inference_steps": 3, "num_frames": DEFAULT_NUM_FRAMES}

_TEXT_DIM = 16  # the Qwen3-VL hidden size, i.e. the transformer's `text_dim`
_LATENT_CHANNELS = 4  # the released video VAE has 24
_AUDIO_LATENT_CHANNELS = 8  # the released audio VAE has 32


def _seed(seed: int, name: str) -> None:
    """Seed torch from `(seed, component)`, so a component's weights do not depend on what was built before it."""
    torch.manual_seed(zlib.crc32(f"{name}:{seed}".encode()))


def _transformer() -> MiniMaxH3Transformer3DModel:
    return MiniMaxH3Transformer3DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        hidden_size=32,
        num_layers=2,
        num_refiner_layers=2,
        ffn_dim=64,
        in_channels=_LATENT_CHANNELS,
        audio_in_channels=_AUDIO_LATENT_CHANNELS,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=2,
    )


def _text_encoder(token_ids: dict[str, int], vocab_size: int) -> Qwen3VLForConditionalGeneration:
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=_TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=51,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8,
            # mrope splits head_dim / 2 = 4 rotary frequencies over (t, h, w), as (24, 20, 20) splits 64.
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=_TEXT_DIM,
            num_position_embeddings=16,  # a 4 x 4 learned grid, interpolated to any image size
            deepstack_visual_indexes=[1],
        ),
        **token_ids,
    )
    return Qwen3VLForConditionalGeneration(config)


def _vae() -> AutoencoderKLMiniMaxH3:
    return AutoencoderKLMiniMaxH3(
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2, 2, 2),
        temporal_downsample_factors=(1, 2, 2, 1),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,  # 6 of its channels rotated: 0.75 x 8, split over 3 axes
        decoder_num_register_tokens=1,
        latents_mean=(0.0,) * _LATENT_CHANNELS,
        latents_std=(1.0,) * _LATENT_CHANNELS,
    )


def _audio_vae() -> AutoencoderKLMiniMaxH3Audio:
    return AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4,
        encoder_rates=(2, 2),
        latent_dim=16,
        latent_channels=_AUDIO_LATENT_CHANNELS,
        num_attention_heads=2,
        decoder_dim=8,
        decoder_rates=(2, 2),
        decoder_kernel_sizes=(4, 4),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1, 3),),
        sampling_rate=160,
        latents_mean=[0.0] * _AUDIO_LATENT_CHANNELS,
        latents_std=[1.0] * _AUDIO_LATENT_CHANNELS,
    )


def build(path: str | os.PathLike, seed: int = 0) -> None:
    """Build the complete tiny stock pipeline deterministically from `seed` and save it to `path` (safetensors)."""
    processor = qwen3_vl_processor()
    tokenizer = processor.tokenizer
    components = {"tokenizer": tokenizer, "processor": processor}
    builders = {
        "transformer": _transformer,
        "transformer_ref": _transformer,
        "text_encoder": lambda: _text_encoder(vl_token_ids(tokenizer), len(tokenizer)),
        "vae": _vae,
        "audio_vae": _audio_vae,
    }
    for name, make in builders.items():
        _seed(seed, name)
        components[name] = make()

    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(
        # The released schedules: one per modality, stepped inside the same transformer call.
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
        # Pipeline configs, saved in `modular_model_index.json`. The released 768-pixel canvas and 2048-pixel
        # reference images would pack tens of thousands of rows; these make a request without `height` / `width`
        # generate on `DEFAULT_SIZE`, and keep `ref2va` references as small.
        canvas_short_edge=DEFAULT_SIZE[0],
        canvas_max_pixels=DEFAULT_SIZE[0] * DEFAULT_SIZE[1],
        reference_image_short_edge=DEFAULT_SIZE[0],
        **components,
    )
    pipe.save_pretrained(os.fspath(path), overwrite_modular_index=True)
