"""Tiny random Qwen-Image-2.1 checkpoint: a stock `QwenImage21Pipeline`, built offline from a seed.

Every component keeps the real checkpoint's structure (Qwen3-VL text encoder and processor, RGBA VAE compressing 16x
into 64 latent channels, single-stream block-causal transformer) and shrinks only widths and depths.
"""

from __future__ import annotations

import os

import torch
from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from ._qwen import qwen3_vl_processor, qwen_image_scheduler, vl_token_ids

# The pipeline hard-codes a VAE scale factor of 16 and groups latent tokens 2x2 per vision-language image slot, so it
# rounds sides down to multiples of 32: at 32x32 the target image is a 2x2 latent, one slot.
DEFAULT_SIZE = (32, 32)
# Two transformer forwards: the first step and a later one (`tiny.smallest_call`).
SMALLEST_CALL = {"num_inference_steps": 2}

# Width of the text encoder's hidden states, which the transformer reads as `context_in_dim`. Kept unlike the
# transformer's width so a mixed-up projection fails loudly.
_TEXT_DIM = 32


def build(path: str | os.PathLike, seed: int = 0) -> None:
    """Build the complete tiny stock pipeline deterministically from `seed` and save_pretrained it to `path` (standard
    diffusers layout, safetensors)."""
    torch.manual_seed(seed)
    # The pipeline's scale factor of 16 is a constant, not read from the VAE, so the VAE must keep all four of the
    # real checkpoint's 2x downsampling stages (five `dim_mult` levels).
    vae = AutoencoderKLQwenImage21(base_dim=4, decoder_base_dim=6, z_dim=64, dim_mult=[1, 2, 4, 8, 8], num_res_blocks=1)
    torch.manual_seed(seed)
    transformer = QwenImage21Transformer2DModel(
        in_channels=64,
        out_channels=64,
        num_layers=2,
        # 4 heads so TP=2 and TP=4 shard whole heads; 4 x 16 = 64 wide, and every sharded projection (64, the 3x
        # SwiGLU's 192) divides by 4.
        num_attention_heads=4,
        attention_head_dim=16,
        context_in_dim=_TEXT_DIM,
        axes_dims_rope=(4, 6, 6),  # frame/height/width split of the head dim, each even, summing to 16
    )
    pipeline = QwenImage21Pipeline(
        scheduler=qwen_image_scheduler(),
        vae=vae,
        text_encoder=None,
        processor=qwen3_vl_processor(),
        transformer=transformer,
    )

    # The pipeline counts the system-prompt tokens it drops with the processor's chat template when it loads, so any
    # tokenization is consistent. Keeping each word of its prompt template whole, as the real vocabulary does, also
    # makes that count realistic (12 rather than 34 byte-level pieces). The template is only defined on an instance,
    # hence the processor swap.
    processor = qwen3_vl_processor([pipeline.prompt_template_t2i])
    torch.manual_seed(seed)
    text_encoder = Qwen3VLForConditionalGeneration(_text_encoder_config(processor.tokenizer))
    pipeline.register_modules(text_encoder=text_encoder, processor=processor)
    pipeline.save_pretrained(path, safe_serialization=True)


def _text_encoder_config(tokenizer) -> Qwen3VLConfig:
    """Qwen3-VL at two text layers and one vision block.

    The vision tower only runs for image-conditioned generation, but it is part of the checkpoint. Its patching must
    match the processor's (16 px patches, 2x2 merge, 2 frames), and its one block doubles as the single deepstack
    layer (the real model taps 3 of 27).
    """
    head_dim = 16
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=_TEXT_DIM,
            intermediate_size=2 * _TEXT_DIM,
            num_hidden_layers=2,
            num_attention_heads=_TEXT_DIM // head_dim,
            num_key_value_heads=1,
            head_dim=head_dim,
            # Interleaved multimodal RoPE over the head's 8 rotary frequencies, as [24, 20, 20] splits the real 64.
            rope_parameters=dict(
                rope_type="default", rope_theta=5_000_000.0, mrope_section=[2, 3, 3], mrope_interleaved=True
            ),
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=_TEXT_DIM,
            num_position_embeddings=16,  # a 4x4 learned grid, interpolated to each image like the real 48x48
            deepstack_visual_indexes=[0],
        ),
        **vl_token_ids(tokenizer),
    )
