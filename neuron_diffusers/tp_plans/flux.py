"""Tensor-parallel plan for FLUX.1 (`FluxTransformer2DModel`): stock diffusers 0.42.1 plan + AdaLN.

Stock shards attention and MLPs but leaves the AdaLN modulation Linears replicated: `norm1.linear`
and `norm1_context.linear` (3072 -> 6 x 3072) in each of the 19 double-stream blocks and
`norm.linear` (3072 -> 3 x 3072) in each of the 38 single-stream blocks. They are 27.2% of the
model, so at TP=8 stock holds 8.12 GiB (bf16) per rank against an ideal 2.77 GiB.

We shard those, plus `norm_out.linear` and `context_embedder`, with `GatheredColwiseParallel`:
each rank computes 1/tp of the output columns and one all-gather rebuilds the exact full output
(no reduction, so bit-identical to one process). Nothing downstream changes: `AdaLayerNormZero*` /
`AdaLayerNormContinuous` `chunk` the full vector as usual, and the text stream enters the blocks
whole. All outputs are multiples of `inner_dim` = heads x head_dim, so they divide like the heads.

Per rank at TP=8 (bf16): stock 8.12 GiB, ours 2.81 GiB, ideal (total / 8) 2.77 GiB -> 1.013 x ideal.
"""

from diffusers.hooks.tensor_parallel import PackedRowwiseParallel

from .styles import GatheredColwiseParallel

MODEL_CLASS = "FluxTransformer2DModel"

# Left replicated on purpose (shares of the full-size default config's parameters):
# - time_text_embed.timestep_embedder / text_embedder (0.19%): small MLPs on a [batch, dim] vector,
#   not needed for the budget. (FLUX.1-dev also has a `guidance_embedder` that schnell lacks
#   (`guidance_embeds=False`), so a plan shared by both could not name it anyway.)
# - x_embedder (64 -> 3072) and proj_out (3072 -> 64): 0.003% together.
# - attn.norm_q / norm_k / norm_added_q / norm_added_k: RMSNorm over head_dim, applied per head
#   after the heads are split, so every rank needs the whole (tiny) weight. <0.001%.
# - All LayerNorms here have no parameters (`elementwise_affine=False`).
# - Rowwise biases (`attn.to_out.0`, `to_add_out`, `ff.net.2`, `proj_out` of single blocks): added
#   once after the all-reduce, so they stay whole by construction. 0.003%.
# Everything left replicated: 0.19% of the model.
PLAN = {
    # --- stock diffusers 0.42.1 `FluxTransformer2DModel._tp_plan`, verbatim ---
    # double-stream (MMDiT) blocks
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
    # single-stream (parallel attention + MLP) blocks
    "single_transformer_blocks.*.attn.to_q": "colwise",
    "single_transformer_blocks.*.attn.to_k": "colwise",
    "single_transformer_blocks.*.attn.to_v": "colwise",
    "single_transformer_blocks.*.proj_mlp": "colwise",
    # input = cat([attn_output (inner_dim), mlp_hidden_states (mlp_hidden_dim)]); blocks set in __init__
    "single_transformer_blocks.*.proj_out": PackedRowwiseParallel(),
    # --- added by neuron_diffusers ---
    # AdaLN modulation: temb -> 6 x dim (double) / 3 x dim (single) shift/scale/gate, needed whole.
    "transformer_blocks.*.norm1.linear": GatheredColwiseParallel(),  # 9.05%
    "transformer_blocks.*.norm1_context.linear": GatheredColwiseParallel(),  # 9.05%
    "single_transformer_blocks.*.norm.linear": GatheredColwiseParallel(),  # 9.05%
    "norm_out.linear": GatheredColwiseParallel(),  # temb -> (scale, shift), 0.16%
    # Text input projection (4096 -> 3072); its output enters the double-stream blocks whole.
    "context_embedder": GatheredColwiseParallel(),  # 0.11%
}
