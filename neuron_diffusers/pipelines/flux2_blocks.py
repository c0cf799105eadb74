"""FLUX.2's double-stream block forward for `PartialRowwiseParallel(reduced_at="block")` (`tp_plans/flux2.py`): stock's,
with both feed-forwards computed before either is used, so one all-reduce serves the pair (`parallel/coalesce.py`
installs it; `BLOCK_FORWARDS` in the plan file names this module for the family registry)."""

import torch
from diffusers.models.transformers.transformer_flux2 import Flux2TransformerBlock

from ..compat.privates import Flux2Modulation
from ..parallel.coalesce import CoalescedForward, reduce_in_block


def forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt,
            image_rotary_emb=None, joint_attention_kwargs=None):
    """`Flux2TransformerBlock.forward` (diffusers 0.42.1) with both feed-forwards reduced in one all-reduce."""
    joint_attention_kwargs = joint_attention_kwargs or {}
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = Flux2Modulation.split(temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = Flux2Modulation.split(
        temb_mod_txt, 2
    )
    norm_hidden_states = self.norm1(hidden_states)
    norm_hidden_states = (1 + scale_msa) * norm_hidden_states + shift_msa
    norm_encoder_hidden_states = self.norm1_context(encoder_hidden_states)
    norm_encoder_hidden_states = (1 + c_scale_msa) * norm_encoder_hidden_states + c_shift_msa
    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    attn_output = gate_msa * attn_output
    hidden_states = hidden_states + attn_output
    norm_hidden_states = self.norm2(hidden_states)
    norm_hidden_states = norm_hidden_states * (1 + scale_mlp) + shift_mlp
    ff_output = self.ff(norm_hidden_states)

    context_attn_output = c_gate_msa * context_attn_output
    encoder_hidden_states = encoder_hidden_states + context_attn_output
    norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states)
    norm_encoder_hidden_states = norm_encoder_hidden_states * (1 + c_scale_mlp) + c_shift_mlp
    context_ff_output = self.ff_context(norm_encoder_hidden_states)

    ff_output, context_ff_output = reduce_in_block(self, [ff_output, context_ff_output])

    hidden_states = hidden_states + gate_mlp * ff_output
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp * context_ff_output
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


#: The block class -> its coalesced forward, the partial Linears it reduces together, the stock forward's digest.
FORWARDS = {
    Flux2TransformerBlock: CoalescedForward(forward, ("ff.linear_out", "ff_context.linear_out"), "b5d26783a67cbd6d"),
}
