"""QwenImage21Pipeline (Qwen-Image-2.1): Qwen3-VL hidden states plus a mask, true CFG with a negative prompt.

Bucketed exactly, like Qwen-Image: the embeddings are right-padded (mask 0) to a length bucket, so every prompt of a
bucket shares one compiled graph, and the image is the unpadded one (tested, KV cache on and off, CFG-parallel and
under context parallelism). Stock masks the padded rows out as keys but numbers RoPE positions along the joint
sequence with them, so the image block would start after the padding; `exact_text_padding`
(`qwenimage21_padding.py`), installed on each rank's transformer (`load_denoiser`), numbers the sequence without the
padded rows instead. The encoder does not truncate: an encoding of 1024 tokens or more (a long prompt, or an input
image's vision tokens) pads past the largest bucket to a multiple of 256 (`bucket_for`), a static length of its own;
padded rows take no position, and the rotary table holds 8192 positions for text and image sides together. Pass
larger `buckets=` to warm those up.
"""

import torch

from .base import StockPipelineAdapter
from .qwenimage21_padding import exact_text_padding


class QwenImage21Adapter(StockPipelineAdapter):
    pipeline_class = "QwenImage21Pipeline"
    text_components = ("text_encoder",)
    shared_components = ("processor",)  # the pipeline's `__init__` tokenizes its chat template
    guidance_kwarg = "true_cfg_scale"
    buckets = (64, 128, 256, 512, 1024)
    #: Under context parallelism (`pipelines/qwenimage21_context.py`) the buckets pad the joint sequence with masked
    #: positions (rounded to the degree); with `buckets=()` its length follows the prompt: `ulysses_anything`.
    cp_block_causal = True

    def split_lengths(self, checkpoint, call_kwargs: dict) -> dict[str, int]:
        """The target image's tokens (one per 16 x 16 pixels); the text is a bucket, rounded to the degree."""
        if "height" not in call_kwargs or "width" not in call_kwargs:
            return {}
        return {"image tokens": (call_kwargs["height"] // 16) * (call_kwargs["width"] // 16)}

    #: `QwenImage21Rope` keeps 1024 negative positions (its table is 8192 positive + 1024 negative, tested). An image
    #: block numbers its rows and columns from -(side - side // 2), so a side above 2048 latent tokens would index past
    #: them and wrap around into the positive positions: a silently wrong image, not an error.
    rope_negative_positions = 1024

    def load_denoiser(self, checkpoint, transformer, torch_dtype, device, decodes: bool, helps_decode: bool = False):
        """The stock denoiser, its transformer numbering RoPE positions as if the text were not padded."""
        pipe = super().load_denoiser(checkpoint, transformer, torch_dtype, device, decodes, helps_decode)
        exact_text_padding(pipe.transformer)
        return pipe

    def vae_scale_factor(self, vae_config: dict) -> int:
        return 16  # fixed in the pipeline's `__init__`

    def pixels_per_token(self, checkpoint) -> int:
        return self.vae_scale_factor({})  # the transformer's patch is one latent pixel

    def max_side(self, checkpoint) -> tuple[int, str]:
        token = self.pixels_per_token(checkpoint)
        return 2 * self.rope_negative_positions * token, (
            f"its rotary table holds {self.rope_negative_positions} negative positions for the rows and columns "
            f"above and left of the image's centre ({token} pixels each); beyond them positions would wrap around")

    def batch_key(self, embeds: dict[str, torch.Tensor]):
        """The real text lengths (prompt, negative): the image block's RoPE positions start after the text, in one
        position table for the whole batch, so only rows of one length share a call (`exact_text_padding` then
        numbers them as unpadded); rows of other lengths run in calls of their own."""
        return tuple(sorted((name, int(value.sum())) for name, value in embeds.items() if name.endswith("_mask")))

    def pad_encoded(self, encoded, buckets: tuple[int, ...]):
        """`encode_prompt(image=...)`'s (embeds, mask, image_pad_mask), padded to a bucket: the vision tokens stay
        where the processor put them (marked in `image_pad_mask`), padded rows are text rows masked out, numbered
        as unpadded by `exact_text_padding`. Static shapes with image inputs too, and under plain Ulysses a length
        that splits."""
        embeds, mask, image_pad_mask = encoded
        padded = self.pad({"prompt_embeds": embeds, **({} if mask is None else {"prompt_embeds_mask": mask})}, buckets)
        extra = padded["prompt_embeds"].shape[1] - embeds.shape[1]
        if extra == 0:
            return encoded
        image_pad_mask = torch.nn.functional.pad(image_pad_mask, (0, extra), value=False)
        return padded["prompt_embeds"], padded["prompt_embeds_mask"], image_pad_mask

    def encode(self, encoder, prompt, negative_prompt):
        embeds = {}
        for prefix, text in (("", prompt), ("negative_", negative_prompt)):
            if text is None:
                continue
            sequence, mask, _ = encoder.encode_prompt(text, device="cpu")
            embeds[f"{prefix}prompt_embeds"] = sequence
            if mask is not None:  # stock returns `None` for an all-ones mask
                embeds[f"{prefix}prompt_embeds_mask"] = mask
        return embeds
