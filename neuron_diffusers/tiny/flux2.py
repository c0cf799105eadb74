"""A tiny random FLUX.2 [dev] checkpoint for the stock `diffusers.Flux2Pipeline`, built offline.

Every component keeps the real model's structure (a Mistral-Small-3 vision-language text encoder
behind a Pixtral processor, the batch-normalised FLUX.2 VAE, a dual-stream + single-stream DiT
with fused projections) at toy widths, so the stock pipeline code paths all run on a CPU.
"""

from __future__ import annotations

import os

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralImageProcessor,
    PixtralProcessor,
    PixtralVisionConfig,
    PreTrainedTokenizerFast,
)

from ._tokenizers import train_byte_level_bpe

# The VAE downsamples 8x (as the real one does) and the pipeline packs 2x2 latent patches, so one
# image token covers 16x16 pixels and 16 is the smallest side the pipeline accepts.
# We default to 32x32, 2x2 image tokens, so the rotary embedding and the
# patch (un)packing are exercised on more than the single token that 16x16 would give.
DEFAULT_SIZE = (32, 32)
# Two transformer forwards: the first step and a later one (`tiny.smallest_call`).
SMALLEST_CALL = {"num_inference_steps": 2}

_TEXT_DIM = 32  # the Mistral hidden size
# The pipeline stacks the text encoder's hidden states at layers (10, 20, 30) by default, so the
# encoder needs 31 layers for layer 30 to be an intermediate one, as in the 40-layer original.
_TEXT_LAYERS = 31
_TEXT_OUT_LAYERS = 3  # ...and concatenates those 3, which sets the transformer's context width
_LATENT_CHANNELS = 4  # real FLUX.2 has 32; the transformer and the VAE's batch norm see 4x that
_VISION_PATCH, _SPATIAL_MERGE, _IMAGE_SIZE = 4, 2, 32  # Pixtral: 14, 2, 1540

# Mistral-Small-3's chat format, cut down to what the pipeline sends: a system message, then user
# turns whose content is a list of text / image blocks (images become `[IMG]`, which the
# processor expands), plus assistant turns for prompt upsampling.
_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set blocks = [{'type': 'text', 'text': message['content']}] %}"
    "{%- else %}{%- set blocks = message['content'] %}{%- endif %}"
    "{%- set ns = namespace(text='') %}"
    "{%- for block in blocks %}"
    "{%- set ns.text = ns.text + (block['text'] if block['type'] == 'text' else '[IMG]') %}"
    "{%- endfor %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + ns.text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + ns.text + '[/INST]' }}"
    "{%- else %}{{- ns.text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def _processor() -> PixtralProcessor:
    """The Pixtral processor the pipeline calls `apply_chat_template` on, over a byte-level BPE."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_byte_level_bpe(
            ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
            + ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
        ),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=512,  # the pipeline's `max_sequence_length` default
    )
    image_processor = PixtralImageProcessor(
        patch_size={"height": _VISION_PATCH, "width": _VISION_PATCH}, size={"longest_edge": _IMAGE_SIZE}
    )
    return PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=_VISION_PATCH,
        spatial_merge_size=_SPATIAL_MERGE,
        chat_template=_CHAT_TEMPLATE,
    )


def _text_encoder(vocab_size: int, image_token_id: int) -> Mistral3ForConditionalGeneration:
    """Mistral-Small-3 stand-in: 31 narrow decoder layers plus a one-layer Pixtral vision tower.

    The vision tower is only used for image-conditioned prompt upsampling, but it is part of the
    stock class, so it is built (tiny) rather than left out.
    """
    return Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config=MistralConfig(
                vocab_size=vocab_size,
                hidden_size=_TEXT_DIM,
                intermediate_size=2 * _TEXT_DIM,
                num_hidden_layers=_TEXT_LAYERS,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=1024,
                sliding_window=None,
            ),
            vision_config=PixtralVisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=_IMAGE_SIZE,
                patch_size=_VISION_PATCH,
            ),
            image_token_index=image_token_id,
            spatial_merge_size=_SPATIAL_MERGE,
        )
    )


def _vae() -> AutoencoderKLFlux2:
    """Four resolution levels like the real VAE, so the pipeline's `vae_scale_factor` is the real 8.

    The batch norm over the 2x2-patchified latents is left at its identity statistics (mean 0,
    variance 1), which the pipeline reads to de-normalise latents before decoding.
    """
    return AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=4,
    )


def _transformer() -> Flux2Transformer2DModel:
    """2 dual-stream + 2 single-stream blocks, sized to shard under the stock `_tp_plan` at TP=2 and 4.

    4 heads of 16 give an inner dim of 64; with mlp_ratio 3 every sharded block (q / k / v / out
    at 64, the SwiGLU halves at 192, the single blocks' packed [64]*3 + [192]*2 input and
    [64, 192] output projections) then splits evenly 4 ways. The four RoPE axes (T, H, W, L) of 4
    sum to the head dim, as FLUX.2's four 32s sum to 128.
    """
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=_TEXT_OUT_LAYERS * _TEXT_DIM,
        timestep_guidance_channels=32,
        mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,
    )


def build(path: str | os.PathLike, seed: int = 0) -> None:
    """Build the complete tiny stock pipeline deterministically from `seed` and save_pretrained it to `path`
    (standard diffusers layout, safetensors).

    Each random component is built right after reseeding, so one component's shape never shifts
    another's weights.
    """
    processor = _processor()
    torch.manual_seed(seed)
    text_encoder = _text_encoder(len(processor.tokenizer), processor.image_token_id)
    torch.manual_seed(seed)
    vae = _vae()
    torch.manual_seed(seed)
    transformer = _transformer()
    # FLUX.2 [dev]'s scheduler; the pipeline passes a resolution-dependent `mu` for the shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )
    Flux2Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=processor, transformer=transformer
    ).save_pretrained(path)
