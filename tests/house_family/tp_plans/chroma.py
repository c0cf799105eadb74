"""Chroma's tensor-parallel plan: FLUX.1's blocks (its modulation comes from an approximator outside the blocks, left
replicated), with each double-stream block's feed-forward pair reduced together by the family's own block forward
(`pipelines/chroma_blocks.py`, named by `BLOCK_FORWARDS`), and the step-cache metadata diffusers lacks for its
blocks. `families.register` pushes all of it where ours go."""

from diffusers.hooks.tensor_parallel import PackedRowwiseParallel

from neuron_diffusers.tp_plans import PartialRowwiseParallel

MODEL_CLASS = "ChromaTransformer2DModel"
BLOCK_FORWARDS = "pipelines.chroma_blocks"
#: Which output of each block is `hidden_states` (and `encoder_hidden_states`): the double-stream block returns
#: (encoder_hidden_states, hidden_states), the single-stream one hidden_states alone.
CACHE_BLOCK_METADATA = {"ChromaTransformerBlock": (1, 0), "ChromaSingleTransformerBlock": (0, None)}

PLAN = {
    "transformer_blocks.*.attn.to_q": "colwise",
    "transformer_blocks.*.attn.to_k": "colwise",
    "transformer_blocks.*.attn.to_v": "colwise",
    "transformer_blocks.*.attn.to_out.0": "rowwise",
    "transformer_blocks.*.attn.add_q_proj": "colwise",
    "transformer_blocks.*.attn.add_k_proj": "colwise",
    "transformer_blocks.*.attn.add_v_proj": "colwise",
    "transformer_blocks.*.attn.to_add_out": "rowwise",
    "transformer_blocks.*.ff.net.0.proj": "colwise",
    "transformer_blocks.*.ff.net.2": PartialRowwiseParallel(reduced_at="block"),
    "transformer_blocks.*.ff_context.net.0.proj": "colwise",
    "transformer_blocks.*.ff_context.net.2": PartialRowwiseParallel(reduced_at="block"),
    "single_transformer_blocks.*.attn.to_q": "colwise",
    "single_transformer_blocks.*.attn.to_k": "colwise",
    "single_transformer_blocks.*.attn.to_v": "colwise",
    "single_transformer_blocks.*.proj_mlp": "colwise",
    # input = cat([attention output (inner dim), MLP hidden (4 x inner dim)])
    "single_transformer_blocks.*.proj_out": PackedRowwiseParallel([1, 4]),
}
