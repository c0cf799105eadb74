"""Tiny random Qwen-Image-Edit-Plus checkpoint: a stock `QwenImageEditPlusPipeline`, built offline from a seed.

The structure of Qwen-Image-Edit-2509 at toy widths: the Qwen-Image transformer and VAE (as in `tiny/qwenimage.py`),
and a Qwen2.5-VL text encoder *with its vision tower*, fed by a `Qwen2VLProcessor` whose image processor has the
real patching (14 px patches, 2x2 merge, 2-frame temporal patches), so the condition images really go through the
vision-language encoder. Only the processor's pixel budget is lowered: the pipeline hands it each condition image
at 384x384, which the real budget would keep at 196 vision tokens; here it becomes 2x2 merged tokens.

What the pipeline itself fixes stays real and costs the most on a CPU: it resizes every input image to a 1024x1024
area for the VAE (its module constant `VAE_IMAGE_SIZE`), about 10 s per image on one CPU thread, and each input
image adds 64x64 = 4096 image tokens to the transformer's sequence. Tests shrink that constant for the stock
reference and the parallel run alike (a test-only speed knob; the package never touches it).
"""

from __future__ import annotations

import os

import torch
from diffusers import AutoencoderKLQwenImage, QwenImageEditPlusPipeline, QwenImageTransformer2DModel
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from ._qwen import CHAT_TEMPLATE, qwen2_tokenizer, qwen_image_scheduler, vl_token_ids

# Any size works (the pipeline sizes the output from `height`/`width` and resizes the inputs itself); 32x32 gives
# 2x2 target tokens, as the other tiny Qwen checkpoints do.
DEFAULT_SIZE = (32, 32)
# Two transformer forwards: the first step and a later one (`tiny.smallest_call`); every call needs an input image.
SMALLEST_CALL = {"num_inference_steps": 2}

_TEXT_DIM = 32  # the text encoder's width, which the transformer reads as `joint_attention_dim`
_PATCH, _MERGE = 14, 2  # the real Qwen2.5-VL vision patching
# At most 2x2 merged vision tokens per image (real: 28 * 28 * 1280). Not exactly 56 * 56: the processor's rounding
# would then land a hair under 56 px and keep one token.
_MAX_PIXELS = 64 * 64


def build(path: str | os.PathLike, seed: int = 0) -> None:
    """Build the complete tiny stock pipeline deterministically from `seed` and save_pretrained it to `path`."""
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16 * 4,
        out_channels=16,
        num_layers=2,
        num_attention_heads=4,  # TP=2 and TP=4 shard whole heads
        attention_head_dim=16,
        joint_attention_dim=_TEXT_DIM,
        axes_dims_rope=(4, 6, 6),
    )
    pipeline = QwenImageEditPlusPipeline(
        scheduler=qwen_image_scheduler(), vae=vae, text_encoder=None, tokenizer=None, processor=None,
        transformer=transformer,
    )
    # The pipeline drops a fixed number of leading tokens (64) from the text embeddings: the system prompt, which the
    # real vocabulary tokenizes word by word. Keeping each word of the template whole reproduces that count.
    template = pipeline.prompt_template_encode
    tokenizer = qwen2_tokenizer([template, "Picture 1: Picture 2: Picture 3:"])
    prefix_len = len(tokenizer(template.split("{}")[0]).input_ids)
    if prefix_len != pipeline.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"the prompt template prefix is {prefix_len} tokens, the pipeline drops "
            f"{pipeline.prompt_template_encode_start_idx}"
        )
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(_text_encoder_config(tokenizer))
    pipeline.register_modules(text_encoder=text_encoder, tokenizer=tokenizer, processor=_processor(tokenizer))
    pipeline.save_pretrained(path, safe_serialization=True)


def _processor(tokenizer) -> Qwen2VLProcessor:
    """The Qwen2-VL processor of Qwen-Image-Edit-2509 (CLIP normalization, 14 px patches), with a tiny pixel budget."""
    patching = dict(patch_size=_PATCH, merge_size=_MERGE, temporal_patch_size=2)
    size = {"shortest_edge": (_PATCH * _MERGE) ** 2, "longest_edge": _MAX_PIXELS}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **patching),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size=size, **patching),
        chat_template=CHAT_TEMPLATE,
    )


def _text_encoder_config(tokenizer) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL at two text layers and one vision block (window attention off: every block is full attention)."""
    head_dim = 16
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=_TEXT_DIM,
            intermediate_size=2 * _TEXT_DIM,
            num_hidden_layers=2,
            num_attention_heads=_TEXT_DIM // head_dim,
            num_key_value_heads=1,
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
            out_hidden_size=_TEXT_DIM,  # vision tokens are spliced into the text sequence, so they share its width
            patch_size=_PATCH,
            spatial_merge_size=_MERGE,
            temporal_patch_size=2,
            fullatt_block_indexes=[0],
        ),
        **vl_token_ids(tokenizer),
    )
