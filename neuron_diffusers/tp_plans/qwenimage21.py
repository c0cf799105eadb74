"""Tensor-parallel plans for Qwen-Image-2.1 (`QwenImage21Transformer2DModel`): stock by default, `LEAN_PLAN` by name.

2.1's blocks hold no modulation of their own: one shared `modulation` (`Sequential(SiLU,
Linear(4096 -> 4 x 4096))`) computes every block's scales and gates once per forward. Stock leaves
it, `norm_out`, the text projection `txt_in` and the timestep MLP replicated: 1.9% of the model,
which at TP=8 is 13% over the ideal per-rank size (1.88 GiB bf16 per rank against 1.66 GiB).

Here memory and speed trade. A block is single-stream and sequential (attention, then MLP), so stock's
two all-reduces per block cannot be coalesced, and sharding anything more costs collectives: the
modulation needs one all-gather, the text projection one all-reduce. 0.19 GiB per rank is 0.8% of a
24 GiB core, while two more collectives made a step 1.10-1.23x stock's (`bench collectives --depth
full`, CPU). So `PLAN`, the default, is stock's; `LEAN_PLAN` (`load_pipeline(..., plan="lean")`,
`generate --plan lean`) holds 1.69 GiB per rank for 64 + 1 all-reduces and 1 all-gather per forward:

- `modulation.1` and `norm_out.linear` use `GatheredColwiseParallel(hoist_from="time_text_embed")`
  (both read `silu(temb)`; see `styles.py`); the blocks' `chunk`s and `_select_modulation_rows` read
  them as usual.
- `txt_in` is `text_norm -> in_layer -> GELU(tanh) -> out_layer` (4096 -> 4096 -> 4096): an MLP, so
  the usual colwise/rowwise pair. `text_norm` acts on the replicated input, the GELU is elementwise
  on the column shard, and `out_layer`'s all-reduce hands the blocks the whole text stream.

All sharded dimensions are multiples of `inner_dim` = heads x head_dim, so they divide like the heads.

Per rank at TP=8 (bf16): `PLAN` 1.88 GiB (64 all-reduces), `LEAN_PLAN` 1.69 GiB (65 all-reduces,
1 all-gather), ideal (total / 8) 1.66 GiB.
"""

from ..compat.privates import ContextParallelInput, ContextParallelOutput
from .styles import GatheredColwiseParallel

MODEL_CLASS = "QwenImage21Transformer2DModel"
#: Step-cache metadata diffusers 0.42.1 lacks for this block class: it returns its `hidden_states` alone (index 0,
#: no separate `encoder_hidden_states`). FirstBlockCache and MagCache read it (`parallel/cache.py`).
CACHE_BLOCK_METADATA = {"QwenImage21TransformerBlock": (0, None)}

# Stock diffusers 0.42.1 `QwenImage21Transformer2DModel._tp_plan`, verbatim: the fewest collectives.
PLAN = {
    "transformer_blocks.*.attn.to_q": "colwise",
    "transformer_blocks.*.attn.to_k": "colwise",
    "transformer_blocks.*.attn.to_v": "colwise",
    "transformer_blocks.*.attn.to_out.0": "rowwise",
    "transformer_blocks.*.img_mlp.proj": "colwise",
    "transformer_blocks.*.img_mlp.gate_layer": "colwise",
    "transformer_blocks.*.img_mlp.out": "rowwise",
}

# Left replicated by LEAN_PLAN on purpose (shares of the full-size default config's parameters):
# - time_text_embed.timestep_embedder (0.25%): an MLP on a [batch + 1, dim] vector; the budget is
#   met without it.
# - img_in (64 -> 4096) and proj_out (4096 -> 64): 0.007% together.
# - txt_in.text_norm (RMSNorm over the replicated 4096-wide text input) and the attention QK-norms
#   (RMSNorm over head_dim, applied per head after the heads are split, so every rank needs the
#   whole weight): <0.001%. The block LayerNorms have no parameters, and 2.1 has no biases.
# Everything left replicated: 0.26% of the model.
LEAN_PLAN = {
    **PLAN,
    # Shared AdaLN modulation: temb -> [mod1.scale, mod1.gate, mod2.scale, mod2.gate], needed whole.
    # Both computed right after `time_text_embed` and gathered in one call.
    "modulation.1": GatheredColwiseParallel(hoist_from="time_text_embed"),  # 0.94%
    "norm_out.linear": GatheredColwiseParallel(hoist_from="time_text_embed"),  # temb -> scale, 0.24%
    # Text projection MLP: colwise in, rowwise out (all-reduce back to the whole text stream).
    "txt_in.in_layer": "colwise",  # 0.24%
    "txt_in.out_layer": "rowwise",  # 0.24%
}

# Context parallelism: diffusers 0.42.1 ships no `_cp_plan` for 2.1, so this one is registered as the class default.
# Which inputs are split along the sequence where, and where the output is gathered; Ulysses only, with the
# block-causal hooks of `pipelines/qwenimage21_context.py` (which explains the split), named here for the registry.
CP_QUIRKS = "pipelines.qwenimage21_context"
_ROWS = ContextParallelInput(split_dim=0, expected_dims=1)
CP_PLAN = {
    "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
    "transformer_blocks.*": {"rotary_emb": ContextParallelInput(split_dim=0, expected_dims=2),
                             "target_token_mask": _ROWS},
    "norm_out": {"target_token_mask": _ROWS},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}
