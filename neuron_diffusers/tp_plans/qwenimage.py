"""Tensor-parallel plan for Qwen-Image (`QwenImageTransformer2DModel`): stock diffusers 0.42.1 plan + AdaLN.

Every one of the 60 blocks carries two AdaLN modulation MLPs, `img_mod` and `txt_mod`, each
`Sequential(SiLU, Linear(3072 -> 6 x 3072))`. Stock leaves them replicated: 33.3% of the model, so
at TP=8 stock holds 15.90 GiB (bf16) per rank against an ideal 4.76 GiB.

We shard their Linears (`img_mod.1`, `txt_mod.1`), `norm_out.linear` and the text input projection
`txt_in` (3584 -> 3072) with `GatheredColwiseParallel`: each rank computes 1/tp of the output
columns and one all-gather rebuilds the exact full output (no reduction, so bit-identical to one
process). `_modulate`'s chunks, the `zero_cond_t` / `modulate_index` row selection and
`AdaLayerNormContinuous` then read the full vectors as usual. All outputs are multiples of
`inner_dim` = heads x head_dim, so they divide like the heads.

Per rank at TP=8 (bf16): stock 15.90 GiB, ours 4.78 GiB, ideal (total / 8) 4.76 GiB -> 1.004 x ideal.
"""

from .styles import GatheredColwiseParallel

MODEL_CLASS = "QwenImageTransformer2DModel"

# Left replicated on purpose (shares of the full-size default config's parameters):
# - time_text_embed.timestep_embedder (0.05%): a tiny MLP on a [batch, dim] vector.
# - img_in (64 -> 3072) and proj_out (3072 -> 64): 0.002% together.
# - txt_norm (RMSNorm over the 3584-wide text input, before txt_in) and the attention QK-norms
#   (RMSNorm over head_dim, applied per head after the heads are split, so every rank needs the
#   whole weight): <0.001%. The block LayerNorms have no parameters.
# - Rowwise biases (`attn.to_out.0`, `to_add_out`, `img_mlp.net.2`, `txt_mlp.net.2`): added once
#   after the all-reduce, so they stay whole by construction. 0.004%.
# Everything left replicated: 0.06% of the model.
PLAN = {
    # --- stock diffusers 0.42.1 `QwenImageTransformer2DModel._tp_plan`, verbatim ---
    # double-stream (MMDiT) blocks
    "transformer_blocks.*.attn.to_q": "colwise",
    "transformer_blocks.*.attn.to_k": "colwise",
    "transformer_blocks.*.attn.to_v": "colwise",
    "transformer_blocks.*.attn.to_out.0": "rowwise",
    "transformer_blocks.*.attn.add_q_proj": "colwise",
    "transformer_blocks.*.attn.add_k_proj": "colwise",
    "transformer_blocks.*.attn.add_v_proj": "colwise",
    "transformer_blocks.*.attn.to_add_out": "rowwise",
    "transformer_blocks.*.img_mlp.net.0.proj": "colwise",
    "transformer_blocks.*.img_mlp.net.2": "rowwise",
    "transformer_blocks.*.txt_mlp.net.0.proj": "colwise",
    "transformer_blocks.*.txt_mlp.net.2": "rowwise",
    # --- added by neuron_diffusers ---
    # AdaLN modulation: temb -> 6 x dim shift/scale/gate per stream (`nn.Sequential(SiLU, Linear)`).
    "transformer_blocks.*.img_mod.1": GatheredColwiseParallel(),  # 16.63%
    "transformer_blocks.*.txt_mod.1": GatheredColwiseParallel(),  # 16.63%
    "norm_out.linear": GatheredColwiseParallel(),  # temb -> (scale, shift), 0.09%
    # Text input projection (3584 -> 3072); its output enters the blocks whole.
    "txt_in": GatheredColwiseParallel(),  # 0.05%
}
