"""Tiny random Qwen-Image checkpoint: a stock `QwenImagePipeline`, built offline from a seed.

Every component keeps the real checkpoint's structure (Qwen2.5-VL text encoder, 8x Wan-style VAE with 16 latent
channels, 2x2-patched MMDiT) and shrinks only widths and depths.
"""

from __future__ import annotations

import os

import torch
from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from ._qwen import qwen2_tokenizer, qwen_image_scheduler, vl_token_ids

# The VAE downsamples 8x and the transformer packs 2x2 latent patches, so one image token covers 16x16 pixels and 16
# is the smallest side the pipeline accepts (`QwenImagePipeline` rounds sides down to multiples of 16).
# We default to 32x32, 2x2 image tokens, so the rotary embedding and the
# patch (un)packing are exercised on more than the single token that 16x16 would give.
DEFAULT_SIZE = (32, 32)
# Two transformer forwards: the first step and a later one (`tiny.smallest_call`).
SMALLEST_CALL = {"num_inference_steps": 2}

# Width of the text encoder's hidden states, which the transformer reads as `joint_attention_dim`. Kept unlike the
# transformer's width so a mixed-up projection fails loudly.
_TEXT_DIM = 32


def build(path: str | os.PathLike, seed: int = 0) -> None:
    """Build the complete tiny stock pipeline deterministically from `seed` and save_pretrained it to `path` (standard
    diffusers layout, safetensors)."""
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16 * 4,  # 2x2 patches of the VAE's 16 latent channels
        out_channels=16,
        num_layers=2,
        # 4 heads so TP=2 and TP=4 shard whole heads; 4 x 16 = 64 wide, and every sharded projection (64, the 4x MLP's
        # 256) divides by 4.
        num_attention_heads=4,
        attention_head_dim=16,
        joint_attention_dim=_TEXT_DIM,
        axes_dims_rope=(4, 6, 6),  # frame/height/width split of the head dim, each even, summing to 16
    )
    pipeline = QwenImagePipeline(
        scheduler=qwen_image_scheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )

    # The pipeline drops a hard-coded number of leading tokens (34) from the text embeddings: its system prompt, which
    # the real vocabulary tokenizes word by word. A tokenizer that keeps each word of the pipeline's own template whole
    # reproduces that count, so the drop removes exactly the system prompt here too.
    template = pipeline.prompt_template_encode
    tokenizer = qwen2_tokenizer([template])
    prefix_len = len(tokenizer(template.split("{}")[0]).input_ids)
    if prefix_len != pipeline.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"the prompt template prefix is {prefix_len} tokens, the pipeline drops "
            f"{pipeline.prompt_template_encode_start_idx}"
        )
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(_text_encoder_config(tokenizer))
    pipeline.register_modules(text_encoder=text_encoder, tokenizer=tokenizer)
    pipeline.save_pretrained(path, safe_serialization=True)


def _text_encoder_config(tokenizer) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL at two layers. The vision tower is never run for text-to-image but is part of the checkpoint."""
    head_dim = 16
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=_TEXT_DIM,
            intermediate_size=2 * _TEXT_DIM,
            num_hidden_layers=2,
            num_attention_heads=_TEXT_DIM // head_dim,
            num_key_value_heads=1,
            # Multimodal RoPE splits the head's 8 rotary frequencies over (time, height, width), as [16, 24, 24]
            # splits the real 64.
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0, mrope_section=[2, 3, 3]),
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=_TEXT_DIM,
            fullatt_block_indexes=[0],
        ),
        **vl_token_ids(tokenizer),
    )
