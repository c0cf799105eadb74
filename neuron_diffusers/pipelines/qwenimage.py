"""QwenImagePipeline (Qwen-Image): Qwen2.5-VL hidden states plus a mask, true CFG with a negative prompt.

The transformer masks padded text positions out of attention and places the image's RoPE positions independently
of the text length, so right-padding the embeddings (mask 0) to a length bucket gives the unpadded image while
every prompt of a bucket shares one compiled graph. Prompts are encoded (and truncated) at stock's
`max_sequence_length` of 512 tokens, so a 512-token prompt pads into the 1024 bucket; the call then passes
`max_sequence_length=1024`, the most stock accepts, so the pipeline keeps the padding it would otherwise slice off.
"""

import torch

from ..parallel import patches
from .base import StockPipelineAdapter


class QwenImageAdapter(StockPipelineAdapter):
    pipeline_class = "QwenImagePipeline"
    text_components = ("text_encoder", "tokenizer")
    encode_kwargs = ("max_sequence_length",)
    buckets = (64, 128, 256, 512, 1024)
    call_overrides = {"max_sequence_length": 1024}
    guidance_kwarg = "true_cfg_scale"

    def vae_scale_factor(self, vae_config: dict) -> int:
        return 2 ** len(vae_config["temperal_downsample"])

    def max_side(self, checkpoint) -> tuple[int, str]:
        """Qwen-Image's rotary tables (`QwenEmbedRope`, read here on the meta device) hold a fixed number of
        positions. Image positions are centred, so half the side is used, and the text takes the positions after the
        image's (up to 1024 tokens, `call_overrides`): past that the text slice comes out short and the call fails."""
        rope = patches.internal("diffusers.models.transformers.transformer_qwenimage", "QwenEmbedRope")
        with torch.device("meta"):
            positions = rope(theta=10000, axes_dim=[2, 2, 2], scale_rope=True).pos_freqs.shape[0]
        text, token = self.call_overrides["max_sequence_length"], self.pixels_per_token(checkpoint)
        return 2 * (positions - text) * token, (f"its rotary table holds {positions} positions, shared by half the "
                                               f"image's side in latent tokens ({token} pixels each) and up to {text} "
                                               "text tokens")

    def encode(self, encoder, prompt, negative_prompt, max_sequence_length=512):
        embeds = {}
        for prefix, text in (("", prompt), ("negative_", negative_prompt)):
            if text is None:
                continue
            sequence, mask = encoder.encode_prompt(text, device="cpu", max_sequence_length=max_sequence_length)
            embeds[f"{prefix}prompt_embeds"] = sequence
            if mask is not None:  # stock returns `None` for an all-ones mask
                embeds[f"{prefix}prompt_embeds_mask"] = mask
        return embeds
