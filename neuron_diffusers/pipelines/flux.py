"""FluxPipeline (FLUX.1): CLIP pooled + T5 sequence embeddings.

Stock FLUX.1 already pads the T5 embeddings to `max_sequence_length` (512) and attends to every position, so
the length is static by construction and there is nothing to bucket: padding further would change the image.
"""

from .base import StockPipelineAdapter


class FluxAdapter(StockPipelineAdapter):
    pipeline_class = "FluxPipeline"
    static_text_length = True
    cp_text = "fixed"
    text_components = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    encode_kwargs = ("max_sequence_length",)

    def encode(self, encoder, prompt, negative_prompt, max_sequence_length=512):
        embeds = {}
        for prefix, text in (("", prompt), ("negative_", negative_prompt)):
            if text is None:
                continue
            sequence, pooled, _ = encoder.encode_prompt(
                text, prompt_2=None, device="cpu", max_sequence_length=max_sequence_length
            )
            embeds[f"{prefix}prompt_embeds"] = sequence
            embeds[f"{prefix}pooled_prompt_embeds"] = pooled
        return embeds
