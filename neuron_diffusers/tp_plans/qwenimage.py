"""Tensor-parallel plan for Qwen-Image (`QwenImageTransformer2DModel`): stock 0.42.1 plan + AdaLN, fewer collectives.

Every one of the 60 blocks carries two AdaLN modulation MLPs, `img_mod` and `txt_mod`, each
`Sequential(SiLU, Linear(3072 -> 6 x 3072))`. Stock leaves them replicated: 33.3% of the model, so
at TP=8 stock holds 15.90 GiB (bf16) per rank against an ideal 4.76 GiB.

We shard their Linears (`img_mod.1`, `txt_mod.1`) and `norm_out.linear` with
`GatheredColwiseParallel(hoist_from="time_text_embed")` (all read `silu(temb)`; see `styles.py`). With
`zero_cond_t`, `txt_mod` and `norm_out` read only the first half of `temb`'s batch
(`first_half_if="zero_cond_t"`). `_modulate`'s chunks, the `modulate_index` row selection and
`AdaLayerNormContinuous` then read the full vectors as usual. All outputs are multiples of
`inner_dim` = heads x head_dim, so they divide like the heads.

Stock all-reduces the image and text streams separately, twice per block (4 x 60 = 240 per
forward). Ours reduces each pair together (`reduced_at="attn"` / `"block"`, see `parallel/coalesce.py`):
120 all-reduces and 1 all-gather per forward.
`txt_in` (3584 -> 3072, 0.05%) stays replicated: sharding it would cost a second collective.

Per rank at TP=8 (bf16): stock 15.90 GiB, ours 4.79 GiB, ideal (total / 8) 4.76 GiB -> 1.008 x ideal.
"""

from .styles import GatheredColwiseParallel, PartialRowwiseParallel

#: The module holding this family's coalesced block forward (`reduced_at="block"` below), for the family registry.
BLOCK_FORWARDS = "pipelines.qwenimage_blocks"
MODEL_CLASS = "QwenImageTransformer2DModel"

# Left replicated on purpose (shares of the full-size default config's parameters):
# - time_text_embed.timestep_embedder (0.05%): a tiny MLP on a [batch, dim] vector.
# - img_in (64 -> 3072) and proj_out (3072 -> 64): 0.002% together.
# - txt_norm (RMSNorm over the 3584-wide text input, before txt_in) and the attention QK-norms
#   (RMSNorm over head_dim, applied per head after the heads are split, so every rank needs the
#   whole weight): <0.001%. The block LayerNorms have no parameters.
# - txt_in (3584 -> 3072): 0.05%, see above.
# - Rowwise biases (`attn.to_out.0`, `to_add_out`, `img_mlp.net.2`, `txt_mlp.net.2`): added once
#   after the all-reduce, so they stay whole by construction. 0.004%.
# Everything left replicated: 0.11% of the model.
PLAN = {
    # --- stock diffusers 0.42.1 `QwenImageTransformer2DModel._tp_plan`; its four rowwise Linears are
    # PartialRowwiseParallel: reduced in pairs, the same layout and arithmetic ---
    # double-stream (MMDiT) blocks
    "transformer_blocks.*.attn.to_q": "colwise",
    "transformer_blocks.*.attn.to_k": "colwise",
    "transformer_blocks.*.attn.to_v": "colwise",
    "transformer_blocks.*.attn.to_out.0": PartialRowwiseParallel(reduced_at="attn"),
    "transformer_blocks.*.attn.add_q_proj": "colwise",
    "transformer_blocks.*.attn.add_k_proj": "colwise",
    "transformer_blocks.*.attn.add_v_proj": "colwise",
    "transformer_blocks.*.attn.to_add_out": PartialRowwiseParallel(reduced_at="attn"),
    "transformer_blocks.*.img_mlp.net.0.proj": "colwise",
    "transformer_blocks.*.img_mlp.net.2": PartialRowwiseParallel(reduced_at="block"),
    "transformer_blocks.*.txt_mlp.net.0.proj": "colwise",
    "transformer_blocks.*.txt_mlp.net.2": PartialRowwiseParallel(reduced_at="block"),
    # --- added by neuron_diffusers ---
    # AdaLN modulation: temb -> 6 x dim shift/scale/gate per stream (`nn.Sequential(SiLU, Linear)`).
    # All computed right after `time_text_embed` and gathered in one call.
    "transformer_blocks.*.img_mod.1": GatheredColwiseParallel(hoist_from="time_text_embed"),  # 16.63%
    "transformer_blocks.*.txt_mod.1": GatheredColwiseParallel(  # 16.63%
        hoist_from="time_text_embed", first_half_if="zero_cond_t"),
    "norm_out.linear": GatheredColwiseParallel(  # temb -> (scale, shift), 0.09%
        hoist_from="time_text_embed", first_half_if="zero_cond_t"),
}
