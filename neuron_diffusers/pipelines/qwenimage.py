"""QwenImagePipeline (Qwen-Image): Qwen2.5-VL hidden states plus a mask, true CFG with a negative prompt.

The transformer masks padded text positions out of attention and places the image's RoPE positions independently
of the text length, so right-padding the embeddings (mask 0) to a length bucket gives the unpadded image while
every prompt of a bucket shares one compiled graph. Buckets stop at 512, stock's `max_sequence_length`, which the
pipeline truncates to.
"""

from .base import StockPipelineAdapter


class QwenImageAdapter(StockPipelineAdapter):
    pipeline_class = "QwenImagePipeline"
    text_components = ("text_encoder", "tokenizer")
    encode_kwargs = ("max_sequence_length",)
    buckets = (64, 128, 256, 512)

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
