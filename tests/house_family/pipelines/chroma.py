"""ChromaPipeline: T5 sequence embeddings with their attention mask, padded by the pipeline to
`max_sequence_length`."""

from neuron_diffusers.pipelines import StockPipelineAdapter


class ChromaAdapter(StockPipelineAdapter):
    pipeline_class = "ChromaPipeline"
    static_text_length = True
    cp_text = "fixed"
    text_components = ("text_encoder", "tokenizer")
    encode_kwargs = ("max_sequence_length",)

    def encode(self, encoder, prompt, negative_prompt, max_sequence_length=512):
        """Both branches always: Chroma runs true CFG, and stock encodes "" when no negative prompt is given."""
        sequence, _, mask, negative, _, negative_mask = encoder.encode_prompt(
            prompt, negative_prompt or "", device="cpu", max_sequence_length=max_sequence_length,
            do_classifier_free_guidance=True)
        return {"prompt_embeds": sequence, "prompt_attention_mask": mask, "negative_prompt_embeds": negative,
                "negative_prompt_attention_mask": negative_mask}
