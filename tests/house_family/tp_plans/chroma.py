"""Chroma's tensor-parallel plan: FLUX.1's blocks with stock styles only (its modulation comes from an approximator
outside the blocks, left replicated)."""

from diffusers.hooks.tensor_parallel import PackedRowwiseParallel

MODEL_CLASS = "ChromaTransformer2DModel"

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
    "transformer_blocks.*.ff.net.2": "rowwise",
    "transformer_blocks.*.ff_context.net.0.proj": "colwise",
    "transformer_blocks.*.ff_context.net.2": "rowwise",
    "single_transformer_blocks.*.attn.to_q": "colwise",
    "single_transformer_blocks.*.attn.to_k": "colwise",
    "single_transformer_blocks.*.attn.to_v": "colwise",
    "single_transformer_blocks.*.proj_mlp": "colwise",
    # input = cat([attention output (inner dim), MLP hidden (4 x inner dim)])
    "single_transformer_blocks.*.proj_out": PackedRowwiseParallel([1, 4]),
}
