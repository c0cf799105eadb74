"""Tiny random Qwen-Image checkpoint: a stock `QwenImagePipeline`, built offline from a seed.

Every component keeps the real checkpoint's structure (Qwen2.5-VL text encoder, 8x Wan-style VAE with 16 latent
channels, 2x2-patched MMDiT) and shrinks only widths and depths.
"""

from __future__ import annotations

import os

import torch
from diffusers import QwenImagePipeline
from transformers import Qwen2_5_VLForConditionalGeneration

from ._qwen import qwen2_5_vl_config, qwen_image_denoiser, qwen_image_scheduler, template_tokenizer

# The VAE downsamples 8x and the transformer packs 2x2 latent patches, so one image token covers 16x16 pixels and 16
# is the smallest side the pipeline accepts (`QwenImagePipeline` rounds sides down to multiples of 16).
# We default to 32x32, 2x2 image tokens, so the rotary embedding and the
# patch (un)packing are exercised on more than the single token that 16x16 would give.
DEFAULT_SIZE = (32, 32)
# Two transformer forwards: the first step and a later one (`tiny.smallest_call`).
SMALLEST_CALL = {"num_inference_steps": 2}


def build(path: str | os.PathLike, seed: int = 0) -> None:
    """Build the complete tiny stock pipeline deterministically from `seed` and save_pretrained it to `path` (standard
    diffusers layout, safetensors)."""
    vae, transformer = qwen_image_denoiser(seed)
    pipeline = QwenImagePipeline(
        scheduler=qwen_image_scheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )
    tokenizer = template_tokenizer(pipeline)  # the pipeline drops its 34 system-prompt tokens
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config(tokenizer))
    pipeline.register_modules(text_encoder=text_encoder, tokenizer=tokenizer)
    pipeline.save_pretrained(path, safe_serialization=True)

