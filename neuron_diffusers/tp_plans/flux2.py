"""Tensor-parallel plan for FLUX.2 (`Flux2Transformer2DModel`): stock diffusers 0.42.1 plan + AdaLN.

FLUX.2's blocks hold no modulation of their own: three shared `Flux2Modulation` Linears compute
every block's shift/scale/gate once per forward (`double_stream_modulation_img` / `_txt`:
6144 -> 2 x 3 x 6144, `single_stream_modulation`: 6144 -> 3 x 6144). Stock leaves them, `norm_out`
and the input projections replicated: 2.5% of the model, which at TP=8 is still 18% over the ideal
per-rank size (8.83 GiB bf16 per rank against 7.50 GiB).

We shard the three shared modulations and `norm_out.linear` with
`GatheredColwiseParallel(hoist_from="time_guidance_embed")` (all read `silu(temb)`; see `styles.py`),
which `Flux2Modulation.split`, the KV-cache modulation blending and `AdaLayerNormContinuous` then read
as usual. All outputs are multiples of `inner_dim` = heads x head_dim, so they divide like the heads.

Double-stream pairs are reduced together (`reduced_at="attn"` / `"block"`, see `parallel/coalesce.py`):
8 x 2 + 48 = 64 all-reduces and 1 all-gather per forward, against stock's 80.
`context_embedder` (15360 -> 6144, 0.29%) stays replicated: sharding it would cost a second
collective per forward.

Per rank at TP=8 (bf16): stock 8.83 GiB, ours 7.79 GiB, ideal (total / 8) 7.50 GiB -> 1.038 x ideal.
"""

from diffusers.hooks.tensor_parallel import PackedColwiseParallel, PackedRowwiseParallel

from .styles import GatheredColwiseParallel, PartialRowwiseParallel

#: The module holding this family's coalesced block forward (`reduced_at="block"` below), for the family registry.
BLOCK_FORWARDS = "pipelines.flux2_blocks"
MODEL_CLASS = "Flux2Transformer2DModel"

# Left replicated on purpose (shares of the full-size default config's parameters):
# - time_guidance_embed.timestep_embedder / guidance_embedder (0.24%): MLPs on a [batch, dim]
#   vector. `guidance_embedder` is None in guidance-free variants (`guidance_embeds=False`), so a
#   plan naming it would not resolve there; the timestep one is left with it rather than split the pair.
# - x_embedder (128 -> 6144) and proj_out (6144 -> 128): 0.005% together.
# - attn.norm_q / norm_k / norm_added_q / norm_added_k: RMSNorm over head_dim, applied per head
#   after the heads are split, so every rank needs the whole (tiny) weight. <0.001%.
# - context_embedder (15360 -> 6144): 0.29%, see above.
# - All LayerNorms here have no parameters (`elementwise_affine=False`), and FLUX.2 has no biases.
# Everything left replicated: 0.54% of the model.
PLAN = {
    # --- stock diffusers 0.42.1 `Flux2Transformer2DModel._tp_plan`; its four double-stream rowwise
    # Linears are PartialRowwiseParallel: reduced in pairs, the same layout and arithmetic ---
    # double-stream (cross-attention + FFN) blocks
    "transformer_blocks.*.attn.to_q": "colwise",
    "transformer_blocks.*.attn.to_k": "colwise",
    "transformer_blocks.*.attn.to_v": "colwise",
    "transformer_blocks.*.attn.to_out.0": PartialRowwiseParallel(reduced_at="attn"),
    "transformer_blocks.*.attn.add_q_proj": "colwise",
    "transformer_blocks.*.attn.add_k_proj": "colwise",
    "transformer_blocks.*.attn.add_v_proj": "colwise",
    "transformer_blocks.*.attn.to_add_out": PartialRowwiseParallel(reduced_at="attn"),
    # SwiGLU gate+linear are equal halves → blocks=[1,1]
    "transformer_blocks.*.ff.linear_in": PackedColwiseParallel([1, 1]),
    "transformer_blocks.*.ff.linear_out": PartialRowwiseParallel(reduced_at="block"),
    "transformer_blocks.*.ff_context.linear_in": PackedColwiseParallel([1, 1]),
    "transformer_blocks.*.ff_context.linear_out": PartialRowwiseParallel(reduced_at="block"),
    # single-stream: block structure stored on the Linear by Flux2ParallelSelfAttention.__init__
    "single_transformer_blocks.*.attn.to_qkv_mlp_proj": PackedColwiseParallel(),
    "single_transformer_blocks.*.attn.to_out": PackedRowwiseParallel(),
    # --- added by neuron_diffusers ---
    # Shared AdaLN modulation: silu(temb) -> shift/scale/gate for every block, needed whole; all
    # computed right after `time_guidance_embed` and gathered in one call.
    "double_stream_modulation_img.linear": GatheredColwiseParallel(hoist_from="time_guidance_embed"),  # 0.70%
    "double_stream_modulation_txt.linear": GatheredColwiseParallel(hoist_from="time_guidance_embed"),  # 0.70%
    "single_stream_modulation.linear": GatheredColwiseParallel(hoist_from="time_guidance_embed"),  # 0.35%
    "norm_out.linear": GatheredColwiseParallel(hoist_from="time_guidance_embed"),  # -> (scale, shift), 0.23%
}
