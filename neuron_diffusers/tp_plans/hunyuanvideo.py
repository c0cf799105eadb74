"""Tensor-parallel plan for HunyuanVideo (`HunyuanVideoTransformer3DModel`), which diffusers 0.42.1 does not plan.

The worked example of `docs/authoring.md`, which derives every line below from the model's source.
HunyuanVideo is a FLUX-like MMDiT for video: a token refiner on the text stream, 20 double-stream
blocks (separate image and text weights, joint attention) and 40 single-stream blocks (one
sequence, attention and MLP side by side), 24 heads of 128 (`inner_dim` 3072).

- Attention everywhere: `to_q` / `to_k` / `to_v` (and the text stream's `add_*_proj`) colwise, so
  each rank owns whole heads; `to_out.0` / `to_add_out` rowwise, whose all-reduce makes the stream
  whole again. The QK-norms are RMSNorm over `head_dim`, applied per head, so head sharding leaves
  them alone. The processors split heads with `attn.heads` (HunyuanVideo's own and the refiner's
  stock `AttnProcessor2_0`); `compat/tp_loading.py` sets it to the local head count after sharding.
- MLPs: `ff.net.0.proj` colwise (an elementwise GELU / SiLU follows), `ff.net.2` rowwise.
- Single-stream blocks have no attention output projection: `proj_out` reads
  `cat([attention output (inner_dim), MLP hidden (mlp_ratio x inner_dim)])`, so it is
  `PackedRowwiseParallel([1, 4])` (`mlp_ratio` = 4, the default): each rank holds the
  input columns of its heads *and* of its MLP slice, matching what `to_v` and `proj_mlp` (colwise)
  hand it.
- AdaLN modulation (`norm1.linear`, `norm1_context.linear`, single `norm.linear`, the refiner's
  `norm_out.linear`, `norm_out.linear`: temb -> shift/scale/gate vectors that every rank applies to
  its whole hidden states) is 27% of the model: `GatheredColwiseParallel` shards it and all-gathers
  the small output. Same for the text input projection `context_embedder.proj_in` (4096 -> 3072).
- The conditioning MLPs (timestep and pooled-text embedders, Linear -> SiLU -> Linear) are one more
  colwise -> rowwise pair each.

24 heads: valid TP degrees 1, 2, 3, 4, 6, 8, 12, 24 (every sharded width is a multiple of `inner_dim`).
Per rank at TP=8 (bf16): stock (no plan) 23.88 GiB, ours 3.00 GiB, ideal (total / 8) 2.99 GiB -> 1.006 x ideal.
"""

from diffusers.hooks.tensor_parallel import PackedRowwiseParallel

from .styles import GatheredColwiseParallel

MODEL_CLASS = "HunyuanVideoTransformer3DModel"

# Left replicated on purpose (shares of the full-size default config's parameters):
# - time_text_embed.guidance_embedder (0.08%): None in guidance-free configs (`guidance_embeds=False`),
#   where a rule naming it would match nothing.
# - x_embedder (a Conv3d patch embedding) and proj_out (3072 -> 64): 0.003% together.
# - attn.norm_q / norm_k / norm_added_q / norm_added_k (RMSNorm over head_dim, per head) and the
#   refiner's affine LayerNorms norm1 / norm2 (over the replicated stream): <0.001%.
# - Rowwise biases (`to_out.0`, `to_add_out`, `ff.net.2`, `proj_out`, `linear_2`): added once after
#   the all-reduce, so they stay whole by construction.
# Everything left replicated: 0.09% of the model.
PLAN = {
    # --- double-stream blocks: image and text weights, joint attention over both streams ---
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
    "transformer_blocks.*.norm1.linear": GatheredColwiseParallel(),  # 8.84%
    "transformer_blocks.*.norm1_context.linear": GatheredColwiseParallel(),  # 8.84%
    # --- single-stream blocks: attention (no output projection) and MLP side by side ---
    "single_transformer_blocks.*.attn.to_q": "colwise",
    "single_transformer_blocks.*.attn.to_k": "colwise",
    "single_transformer_blocks.*.attn.to_v": "colwise",
    "single_transformer_blocks.*.proj_mlp": "colwise",
    # input = cat([attention output (inner_dim), MLP hidden (4 x inner_dim)]) -> blocks [1, 4]
    "single_transformer_blocks.*.proj_out": PackedRowwiseParallel([1, 4]),
    "single_transformer_blocks.*.norm.linear": GatheredColwiseParallel(),  # 8.84%
    # --- token refiner: self-attention blocks on the text stream, before the double-stream blocks ---
    "context_embedder.token_refiner.refiner_blocks.*.attn.to_q": "colwise",
    "context_embedder.token_refiner.refiner_blocks.*.attn.to_k": "colwise",
    "context_embedder.token_refiner.refiner_blocks.*.attn.to_v": "colwise",
    "context_embedder.token_refiner.refiner_blocks.*.attn.to_out.0": "rowwise",
    "context_embedder.token_refiner.refiner_blocks.*.ff.net.0.proj": "colwise",
    "context_embedder.token_refiner.refiner_blocks.*.ff.net.2": "rowwise",
    "context_embedder.token_refiner.refiner_blocks.*.norm_out.linear": GatheredColwiseParallel(),  # 0.29%
    # --- model-level ---
    # Text input projection (4096 -> 3072); its output enters the token refiner whole.
    "context_embedder.proj_in": GatheredColwiseParallel(),  # 0.10%
    "norm_out.linear": GatheredColwiseParallel(),  # temb -> (scale, shift), 0.15%
    # Conditioning MLPs (Linear, SiLU, Linear) on one [batch, dim] vector each: the usual pair, whose
    # all-reduce is a few KB. 0.42% together, which left whole would put TP=8 3.6% over total / 8.
    "time_text_embed.timestep_embedder.linear_1": "colwise",
    "time_text_embed.timestep_embedder.linear_2": "rowwise",
    "time_text_embed.text_embedder.linear_1": "colwise",
    "time_text_embed.text_embedder.linear_2": "rowwise",
    "context_embedder.time_text_embed.timestep_embedder.linear_1": "colwise",
    "context_embedder.time_text_embed.timestep_embedder.linear_2": "rowwise",
    "context_embedder.time_text_embed.text_embedder.linear_1": "colwise",
    "context_embedder.time_text_embed.text_embedder.linear_2": "rowwise",
}
