"""QwenImage21Pipeline (Qwen-Image-2.1): Qwen3-VL hidden states plus a mask, true CFG with a negative prompt.

Not bucketed: the transformer numbers RoPE positions along one joint sequence in which the target image follows
*all* text positions, padding included, so padding shifts the image's positions and changes the image (measured:
0.0025 max abs latent difference on the tiny model after 3 steps, with the padding masked out of attention). One
prompt per call needs no padding, so the image matches stock exactly; the price is one graph per prompt length.
For static shapes (Neuron), opt in with `load_pipeline(..., buckets=(64, 128, 256, 512, 1024))`: the image then
matches what stock makes of that prompt batched with longer ones (stock right-pads a batch the same way).
"""

from .base import StockPipelineAdapter


class QwenImage21Adapter(StockPipelineAdapter):
    pipeline_class = "QwenImage21Pipeline"
    text_components = ("text_encoder",)
    shared_components = ("processor",)  # the pipeline's `__init__` tokenizes its chat template
    guidance_kwarg = "true_cfg_scale"
    #: Under context parallelism (`parallel/context_qwenimage21.py`): unbucketed, the joint sequence's length follows
    #: the prompt, so Ulysses runs in `ulysses_anything`; opted-in buckets pad it with masked positions instead.
    cp_text = "none"

    def split_lengths(self, checkpoint, call_kwargs: dict) -> dict[str, int]:
        """The target image's tokens (one per 16 x 16 pixels); the text is a bucket, rounded to the degree."""
        if "height" not in call_kwargs or "width" not in call_kwargs:
            return {}
        return {"image tokens": (call_kwargs["height"] // 16) * (call_kwargs["width"] // 16)}

    #: `QwenImage21Rope` keeps 1024 negative positions (its table is 8192 positive + 1024 negative, tested). An image
    #: block numbers its rows and columns from -(side - side // 2), so a side above 2048 latent tokens would index past
    #: them and wrap around into the positive positions: a silently wrong image, not an error.
    rope_negative_positions = 1024

    def vae_scale_factor(self, vae_config: dict) -> int:
        return 16  # fixed in the pipeline's `__init__`

    def pixels_per_token(self, checkpoint) -> int:
        return self.vae_scale_factor({})  # the transformer's patch is one latent pixel

    def max_side(self, checkpoint) -> tuple[int, str]:
        token = self.pixels_per_token(checkpoint)
        return 2 * self.rope_negative_positions * token, (
            f"its rotary table holds {self.rope_negative_positions} negative positions for the rows and columns "
            f"above and left of the image's centre ({token} pixels each); beyond them positions would wrap around")

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
