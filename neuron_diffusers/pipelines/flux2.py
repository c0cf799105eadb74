"""Flux2Pipeline (FLUX.2): one Mistral-3 sequence embedding, guidance-distilled (no negative prompt).

Like FLUX.1, stock pads the text to `max_sequence_length` and attends to every position: static by construction.
"""

from ..parallel import patches
from .base import StockPipelineAdapter


class Flux2Adapter(StockPipelineAdapter):
    pipeline_class = "Flux2Pipeline"
    static_text_length = True
    cp_text = "fixed"
    text_components = ("text_encoder", "tokenizer")
    encode_kwargs = ("max_sequence_length", "text_encoder_out_layers")
    takes_negative_prompt = False

    def shift_mu(self, checkpoint):
        """FLUX.2 computes mu with the pipeline module's empirical fit (`compute_empirical_mu`) instead of the
        scheduler's config; above 4300 tokens the fit no longer depends on the step count."""
        if self.dynamic_shift_config(checkpoint) is None:
            return None
        fit = patches.internal(self.own_module(), "compute_empirical_mu")
        return lambda tokens: fit(tokens, num_steps=1)

    def encode(self, encoder, prompt, negative_prompt, **encode_kwargs):
        sequence, _ = encoder.encode_prompt(prompt, device="cpu", **encode_kwargs)
        return {"prompt_embeds": sequence}
