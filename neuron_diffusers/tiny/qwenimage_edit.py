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
from diffusers import QwenImageEditPlusPipeline
from transformers import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from ._qwen import CHAT_TEMPLATE, qwen2_5_vl_config, qwen_image_denoiser, qwen_image_scheduler, template_tokenizer

# Any size works (the pipeline sizes the output from `height`/`width` and resizes the inputs itself); 32x32 gives
# 2x2 target tokens, as the other tiny Qwen checkpoints do.
DEFAULT_SIZE = (32, 32)
# Two transformer forwards: the first step and a later one (`tiny.smallest_call`); every call needs an input image.
SMALLEST_CALL = {"num_inference_steps": 2}

_PATCH, _MERGE = 14, 2  # the real Qwen2.5-VL vision patching
# At most 2x2 merged vision tokens per image (real: 28 * 28 * 1280). Not exactly 56 * 56: the processor's rounding
# would then land a hair under 56 px and keep one token.
_MAX_PIXELS = 64 * 64


def build(path: str | os.PathLike, seed: int = 0) -> None:
    """Build the complete tiny stock pipeline deterministically from `seed` and save_pretrained it to `path`."""
    vae, transformer = qwen_image_denoiser(seed)  # the tiny Qwen-Image ones
    pipeline = QwenImageEditPlusPipeline(
        scheduler=qwen_image_scheduler(), vae=vae, text_encoder=None, tokenizer=None, processor=None,
        transformer=transformer,
    )
    # The pipeline drops its 64 system-prompt tokens, and prefixes each condition image with "Picture i: ".
    tokenizer = template_tokenizer(pipeline, ["Picture 1: Picture 2: Picture 3:"])
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config(tokenizer))
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

