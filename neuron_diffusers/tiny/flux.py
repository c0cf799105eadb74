"""A tiny random FLUX.1 [dev] checkpoint for the stock `diffusers.FluxPipeline`, built offline.

Every component keeps the real model's structure (CLIP + T5 text encoders, an 8x-downsampling VAE
with shift / scale, a dual-stream + single-stream MMDiT with guidance embedding) at toy widths, so
the stock pipeline code paths all run on a CPU.
"""

from __future__ import annotations

import os

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from ._tokenizers import clip_tokenizer, t5_tokenizer

# The VAE downsamples 8x (as the real one does) and the transformer packs 2x2 latent patches, so
# one image token covers 16x16 pixels and 16 is the smallest side the pipeline accepts.
# We default to 32x32, 2x2 image tokens, so the rotary embedding and the
# patch (un)packing are exercised on more than the single token that 16x16 would give.
DEFAULT_SIZE = (32, 32)
# Two transformer forwards: the first step and a later one (`tiny.smallest_call`).
SMALLEST_CALL = {"num_inference_steps": 2}

_TEXT_DIM = 32  # width of both text encoders; the transformer's context / pooled inputs follow it
_LATENT_CHANNELS = 4  # real FLUX.1 has 16; the transformer sees 4x that after 2x2 packing


def _clip(vocab_size: int, bos_token_id: int, eos_token_id: int) -> CLIPTextModel:
    """CLIP-L stand-in; its pooled output feeds the transformer's `pooled_projections`."""
    return CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=_TEXT_DIM,
            intermediate_size=2 * _TEXT_DIM,
            projection_dim=_TEXT_DIM,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,  # the pipeline pads CLIP prompts to `model_max_length`
            hidden_act="quick_gelu",
            # CLIP pools at the first eos token, so these must be the tokenizer's ids.
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )
    )


def _t5(vocab_size: int) -> T5EncoderModel:
    """T5 v1.1 (gated-GELU) stand-in; its last hidden state is the transformer's context."""
    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=_TEXT_DIM,
            d_kv=8,
            d_ff=2 * _TEXT_DIM,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
        )
    )


def _vae() -> AutoencoderKL:
    """Four resolution levels like the real VAE, so the pipeline's `vae_scale_factor` is the real 8.

    Like FLUX.1's VAE it has no quant convs, and it keeps that VAE's shift / scale factors, which
    the pipeline applies to the latents before decoding.
    """
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    )


def _transformer() -> FluxTransformer2DModel:
    """2 dual-stream + 2 single-stream blocks, sized to shard under the stock `_tp_plan` at TP=2 and 4.

    4 heads of 16 give an inner dim of 64; every sharded block (q / k / v / out at 64, the MLPs
    at 4 x 64 = 256, the single blocks' packed [64, 256] `proj_out`) then splits evenly 4 ways.
    The RoPE axes (4, 6, 6) sum to the head dim, as FLUX.1's (16, 56, 56) sum to 128.
    """
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=_TEXT_DIM,
        pooled_projection_dim=_TEXT_DIM,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )


def build(path: str | os.PathLike, seed: int = 0) -> None:
    """Build the complete tiny stock pipeline deterministically from `seed` and save_pretrained it to `path`
    (standard diffusers layout, safetensors).

    Each random component is built right after reseeding, so one component's shape never shifts
    another's weights.
    """
    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed)
    text_encoder = _clip(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    text_encoder_2 = _t5(len(tokenizer_2))
    torch.manual_seed(seed)
    vae = _vae()
    torch.manual_seed(seed)
    transformer = _transformer()
    # FLUX.1 [dev]'s scheduler: resolution-dependent shift between base_shift and max_shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    ).save_pretrained(path)
