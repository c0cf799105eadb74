"""Tensor-parallel plan for Wan 2.x (`WanTransformer3DModel`), which diffusers 0.42.1 does not plan.

Reviewed from `plan draft WanTransformer3DModel`, which left both attentions whole: Wan's `norm_q` / `norm_k` are
RMSNorm over `heads x head_dim` (all heads at once), so a plan of Linears alone cannot split the heads. Each of the
40 blocks (Wan2.1-14B: 40 heads of 128, width 5120, FFN 13824) is a self-attention over the video tokens, a
cross-attention to the (512 padded) text tokens and a GELU feed-forward:

- Attention, both kinds: `to_q` / `to_k` / `to_v` colwise (whole heads per rank), `to_out.0` rowwise; the
  processor splits heads with `attn.heads` (`compat/tp_loading.py` sets the local count). The Q/K norms are
  `ShardedRMSNorm()` (`tp_plans/styles.py`, `parallel/sharded_norm.py`): each rank keeps its slice of the norm's
  weight and all-reduces its tokens' sums of squares (`tokens x 1` floats), so the norm sees all heads. The
  alternative, all-gathering Q and K before the norm, would move `tokens x 5120` per norm (738 MiB of bf16 for one
  720p, 81-frame Q of 75,600 tokens, against 0.29 MiB here) for the same number of collectives; leaving attention
  replicated (the draft) holds 5.1 x total/8 per rank at TP=8. The rotary embedding rotates channel pairs within a
  head, so it is unchanged by head sharding. Cost: 4 small all-reduces per block (Q and K norms of both attentions).
- Feed-forward: `ffn.net.0.proj` colwise (an elementwise tanh-GELU follows), `ffn.net.2` rowwise.
- Modulation: Wan computes one `timestep_proj` (`condition_embedder.time_proj`: width -> 6 x width, 1.1% of the
  14B) shared by every block (each adds its own small `scale_shift_table`), so one `GatheredColwiseParallel()`
  all-gather per forward shards it; no hoisting is needed.
- Conditioning MLPs (`time_embedder`, `text_embedder`: Linear, activation, Linear): the usual colwise -> rowwise
  pair, 0.5% together, one all-reduce each (the text one over the 512 text tokens).

Per forward at TP=N: 3 all-reduces per block (two attention outputs, the FFN) plus 4 of `tokens x 1` (the norms),
2 more for the conditioning MLPs, and 1 all-gather. Context parallelism: diffusers' own `_cp_plan` for Wan (split
the video tokens and the rotary tables at the blocks, gather at `proj_out`; the text is not split) composes with this
plan (`compat/context.py`): the norms' all-reduce runs over the TP group, per local token.

Not covered: Wan 2.1 I2V / FLF2V (`added_kv_proj_dim`: `add_k_proj` / `add_v_proj` / `norm_added_k` on the image
context; a plan for them would name those too) and Wan 2.2 TI2V (per-token timesteps), which this plan shards
alike but which are not verified here. Valid TP degrees at full size: 1, 2, 4, 8 (40 heads, FFN 13824 = 2^9 x 27).
"""

from .styles import GatheredColwiseParallel, ShardedRMSNorm

MODEL_CLASS = "WanTransformer3DModel"

# Left replicated on purpose (shares of the full-size default config's parameters):
# - patch_embedding (a Conv3d, 16 -> 5120) and proj_out (5120 -> 64): 0.003% together.
# - every block's scale_shift_table (6 x 5120) and norm2 (the cross-attention LayerNorm, affine), and the model's
#   scale_shift_table: added to or applied over the replicated stream. <0.02%.
# - Rowwise biases (`to_out.0`, `ffn.net.2`, `linear_2`): added once after the all-reduce.
PLAN = {
    # --- self-attention over the video tokens ---
    "blocks.*.attn1.to_q": "colwise",
    "blocks.*.attn1.to_k": "colwise",
    "blocks.*.attn1.to_v": "colwise",
    "blocks.*.attn1.norm_q": ShardedRMSNorm(),  # RMSNorm over all heads: one all-reduce of tokens x 1
    "blocks.*.attn1.norm_k": ShardedRMSNorm(),
    "blocks.*.attn1.to_out.0": "rowwise",
    # --- cross-attention: queries from the video, keys and values from the text ---
    "blocks.*.attn2.to_q": "colwise",
    "blocks.*.attn2.to_k": "colwise",
    "blocks.*.attn2.to_v": "colwise",
    "blocks.*.attn2.norm_q": ShardedRMSNorm(),
    "blocks.*.attn2.norm_k": ShardedRMSNorm(),
    "blocks.*.attn2.to_out.0": "rowwise",
    # --- feed-forward (tanh-GELU between) ---
    "blocks.*.ffn.net.0.proj": "colwise",
    "blocks.*.ffn.net.2": "rowwise",
    # --- model-level ---
    # temb -> the 6 modulation vectors every block adds its own table to: needed whole, gathered once.
    "condition_embedder.time_proj": GatheredColwiseParallel(),
    "condition_embedder.time_embedder.linear_1": "colwise",
    "condition_embedder.time_embedder.linear_2": "rowwise",
    "condition_embedder.text_embedder.linear_1": "colwise",
    "condition_embedder.text_embedder.linear_2": "rowwise",
}
