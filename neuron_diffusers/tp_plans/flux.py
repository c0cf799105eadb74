"""Tensor-parallel plan for FLUX.1 (`FluxTransformer2DModel`): stock diffusers 0.42.1 plan + AdaLN, fewer collectives.

Stock shards attention and MLPs but leaves the AdaLN modulation Linears replicated: `norm1.linear`
and `norm1_context.linear` (3072 -> 6 x 3072) in each of the 19 double-stream blocks and
`norm.linear` (3072 -> 3 x 3072) in each of the 38 single-stream blocks. They are 27.2% of the
model, so at TP=8 stock holds 8.12 GiB (bf16) per rank against an ideal 2.77 GiB.

We shard those and `norm_out.linear` with `GatheredColwiseParallel(hoist_from="time_text_embed")`
(all read `silu(temb)`; `styles.py` says how hoisting works). `AdaLayerNormZero*` /
`AdaLayerNormContinuous` `chunk` the full vectors as usual. All outputs are multiples of `inner_dim`,
so they divide like the heads.

A double-stream block's attention pair is reduced as the attention returns both streams
(`reduced_at="attn"`) and its feed-forward pair in the block (`reduced_at="block"`, see
`pipelines/flux_blocks.py`): per forward 19 x 2 + 38 = 76 all-reduces and 1 all-gather, against stock's
114 all-reduces.

`context_embedder` (4096 -> 3072, 0.11%) stays replicated: sharding it would cost a second
collective per forward for 0.8% of a rank's weights at TP=8.

Per rank at TP=8 (bf16): stock 8.12 GiB, ours 2.83 GiB, ideal (total / 8) 2.77 GiB -> 1.021 x ideal.
"""

from diffusers.hooks.tensor_parallel import PackedRowwiseParallel

from .styles import GatheredColwiseParallel, PartialRowwiseParallel

#: The module holding this family's coalesced block forward (`reduced_at="block"` below), for the family registry.
BLOCK_FORWARDS = "pipelines.flux_blocks"
MODEL_CLASS = "FluxTransformer2DModel"

# Left replicated on purpose (shares of the full-size default config's parameters):
# - time_text_embed.timestep_embedder / text_embedder (0.19%): small MLPs on a [batch, dim] vector,
#   not needed for the budget. (FLUX.1-dev also has a `guidance_embedder` that schnell lacks
#   (`guidance_embeds=False`), so a plan shared by both could not name it anyway.)
# - x_embedder (64 -> 3072) and proj_out (3072 -> 64): 0.003% together.
# - attn.norm_q / norm_k / norm_added_q / norm_added_k: RMSNorm over head_dim, applied per head
#   after the heads are split, so every rank needs the whole (tiny) weight. <0.001%.
# - All LayerNorms here have no parameters (`elementwise_affine=False`).
# - context_embedder (4096 -> 3072): 0.11%, see above.
# - Rowwise biases (`attn.to_out.0`, `to_add_out`, `ff.net.2`, `proj_out` of single blocks): added
#   once after the all-reduce, so they stay whole by construction. 0.003%.
# Everything left replicated: 0.30% of the model.
PLAN = {
    # --- stock diffusers 0.42.1 `FluxTransformer2DModel._tp_plan`; its four double-stream rowwise
    # Linears are PartialRowwiseParallel: reduced in pairs, the same layout and arithmetic ---
    # double-stream (MMDiT) blocks
    "transformer_blocks.*.attn.to_q": "colwise",
    "transformer_blocks.*.attn.to_k": "colwise",
    "transformer_blocks.*.attn.to_v": "colwise",
    "transformer_blocks.*.attn.to_out.0": PartialRowwiseParallel(reduced_at="attn"),
    "transformer_blocks.*.attn.add_q_proj": "colwise",
    "transformer_blocks.*.attn.add_k_proj": "colwise",
    "transformer_blocks.*.attn.add_v_proj": "colwise",
    "transformer_blocks.*.attn.to_add_out": PartialRowwiseParallel(reduced_at="attn"),
    "transformer_blocks.*.ff.net.0.proj": "colwise",
    "transformer_blocks.*.ff.net.2": PartialRowwiseParallel(reduced_at="block"),
    "transformer_blocks.*.ff_context.net.0.proj": "colwise",
    "transformer_blocks.*.ff_context.net.2": PartialRowwiseParallel(reduced_at="block"),
    # single-stream (parallel attention + MLP) blocks
    "single_transformer_blocks.*.attn.to_q": "colwise",
    "single_transformer_blocks.*.attn.to_k": "colwise",
    "single_transformer_blocks.*.attn.to_v": "colwise",
    "single_transformer_blocks.*.proj_mlp": "colwise",
    # input = cat([attn_output (inner_dim), mlp_hidden_states (mlp_hidden_dim)]); blocks set in __init__
    "single_transformer_blocks.*.proj_out": PackedRowwiseParallel(),
    # --- added by neuron_diffusers ---
    # AdaLN modulation: silu(temb) -> 6 x dim (double) / 3 x dim (single) shift/scale/gate, needed
    # whole; all computed right after `time_text_embed` and gathered in one call.
    "transformer_blocks.*.norm1.linear": GatheredColwiseParallel(hoist_from="time_text_embed"),  # 9.05%
    "transformer_blocks.*.norm1_context.linear": GatheredColwiseParallel(hoist_from="time_text_embed"),  # 9.05%
    "single_transformer_blocks.*.norm.linear": GatheredColwiseParallel(hoist_from="time_text_embed"),  # 9.05%
    "norm_out.linear": GatheredColwiseParallel(hoist_from="time_text_embed"),  # -> (scale, shift), 0.16%
}
