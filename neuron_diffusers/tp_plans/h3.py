"""Tensor-parallel plan for MiniMax-H3 (`MiniMaxH3Transformer3DModel`), which diffusers 0.42.1 does not plan.

H3 runs one stack of 50 self-attention blocks (plus 2 plain "token refiner" blocks on the text
stream) over a single packed video + audio + text sequence. Each block is Megatron-style:

- attention: `to_q` / `to_k` / `to_v` colwise (whole heads per rank: 56 heads of 128, and
  `heads x head_dim` = 7168 is wider than `hidden_size` = 5376), `to_out.0` rowwise. The QK-norms
  are RMSNorm over `head_dim` and the rotary embedding rotates channels within each head, so both
  act per head and are unchanged by head sharding. (The stock processor's
  `unflatten(-1, (attn.heads, -1))` needs `attn.heads` set to the local head count once sharded;
  `compat/tp_loading.py` does that.)
- feed-forward: diffusers `FeedForward(activation_fn="swiglu")`, i.e. `net.0` = `SwiGLU` whose
  `proj` (5376 -> 2 x 14336) is `chunk(2)`ed into value and gate halves, then `net.2` (14336 -> 5376).
  `PackedColwiseParallel([1, 1])` gives each rank the matching slices of both halves; `net.2` rowwise.
- AdaLN: `adaln_proj.linear` (2688 -> 6 x 3 x 5376: six parameters for each of three modalities)
  is 39% of the model. `GatheredColwiseParallel(hoist_from="time_embedder")`: every block's
  projection and `norm_out.linear` read `silu(temb)` of the one shared `temb` (see `styles.py`), and
  one all-gather per forward rebuilds all 51 tables, which the blocks then `view`, `chunk` and index
  per row as usual. The text input projection
  `context_embedder` (5120 -> 5376, 0.08%) stays replicated: sharding it would cost a second
  collective. Per forward: 2 all-reduces per block (50 + 2 refiner blocks) and 1 all-gather.

Full size: 56 heads, ffn 14336, hidden 5376 and the AdaLN widths all divide by 8.
Per rank at TP=8 (bf16): stock (nothing sharded) 61.70 GiB, ours 7.79 GiB, ideal (total / 8)
7.71 GiB -> 1.010 x ideal.
"""

from diffusers.hooks.tensor_parallel import PackedColwiseParallel

from .styles import GatheredColwiseParallel

MODEL_CLASS = "MiniMaxH3Transformer3DModel"
#: Step-cache metadata diffusers 0.42.1 lacks for this block class: it returns its `hidden_states` alone (index 0,
#: no separate `encoder_hidden_states`). FirstBlockCache and MagCache read it (`parallel/cache.py`).
CACHE_BLOCK_METADATA = {"MiniMaxH3TransformerBlock": (0, None)}

# Left replicated on purpose (shares of the full-size default config's parameters):
# - time_embedder (256 -> 5376 -> 2688, float32 in the checkpoint): 0.05%, a tiny MLP on one
#   [num_timesteps, dim] vector.
# - proj_in / audio_proj_in / proj_out / audio_proj_out (float32 patch projections and output
#   heads, 96- and 32-wide on the patch side): 0.004% together.
# - norm1 / norm2 / token_refiner.final_norm / norm_out.norm: RMSNorm over the replicated residual
#   stream; attn.norm_q / norm_k: RMSNorm over head_dim (see above). 0.002% together.
# - context_embedder (5120 -> 5376): 0.08%, see above.
# - Biases of the gathered Linears are sharded with them; the blocks have no other biases.
# Everything left replicated: 0.13% of the model.
PLAN = {
    # --- transformer blocks ---
    "transformer_blocks.*.attn.to_q": "colwise",
    "transformer_blocks.*.attn.to_k": "colwise",
    "transformer_blocks.*.attn.to_v": "colwise",
    "transformer_blocks.*.attn.to_out.0": "rowwise",
    # SwiGLU value+gate are equal halves of one Linear → blocks=[1,1]
    "transformer_blocks.*.ff.net.0.proj": PackedColwiseParallel([1, 1]),
    "transformer_blocks.*.ff.net.2": "rowwise",
    # AdaLN modulation table: temb -> 6 params x 3 modalities x hidden, needed whole.
    # All computed right after `time_embedder` and gathered in one call.
    "transformer_blocks.*.adaln_proj.linear": GatheredColwiseParallel(hoist_from="time_embedder"),  # 39.27%
    # --- token refiner blocks (text stream; no AdaLN) ---
    "token_refiner.refiner_blocks.*.attn.to_q": "colwise",
    "token_refiner.refiner_blocks.*.attn.to_k": "colwise",
    "token_refiner.refiner_blocks.*.attn.to_v": "colwise",
    "token_refiner.refiner_blocks.*.attn.to_out.0": "rowwise",
    "token_refiner.refiner_blocks.*.ff.net.0.proj": PackedColwiseParallel([1, 1]),
    "token_refiner.refiner_blocks.*.ff.net.2": "rowwise",
    # --- model-level ---
    "norm_out.linear": GatheredColwiseParallel(hoist_from="time_embedder"),  # temb -> (shift, scale), 0.05%
}
