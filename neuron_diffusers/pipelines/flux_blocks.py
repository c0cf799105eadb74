"""FLUX.1's double-stream block forward for `PartialRowwiseParallel(reduced_at="block")` (`tp_plans/flux.py`): stock's,
with both feed-forwards computed before either is used, so one all-reduce serves the pair (`parallel/coalesce.py`
installs it; `BLOCK_FORWARDS` in the plan file names this module for the family registry)."""

import torch
from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

from ..parallel.coalesce import CoalescedForward, reduce_in_block


def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
            joint_attention_kwargs=None):
    """`FluxTransformerBlock.forward` (diffusers 0.42.1) with both feed-forwards reduced in one all-reduce."""
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb
    )
    joint_attention_kwargs = joint_attention_kwargs or {}
    attention_outputs = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )
    if len(attention_outputs) == 2:
        attn_output, context_attn_output = attention_outputs
    elif len(attention_outputs) == 3:
        attn_output, context_attn_output, ip_attn_output = attention_outputs

    attn_output = gate_msa.unsqueeze(1) * attn_output
    hidden_states = hidden_states + attn_output
    norm_hidden_states = self.norm2(hidden_states)
    norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    ff_output = self.ff(norm_hidden_states)

    context_attn_output = c_gate_msa.unsqueeze(1) * context_attn_output
    encoder_hidden_states = encoder_hidden_states + context_attn_output
    norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states)
    norm_encoder_hidden_states = norm_encoder_hidden_states * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    context_ff_output = self.ff_context(norm_encoder_hidden_states)

    ff_output, context_ff_output = reduce_in_block(self, [ff_output, context_ff_output])

    ff_output = gate_mlp.unsqueeze(1) * ff_output
    hidden_states = hidden_states + ff_output
    if len(attention_outputs) == 3:
        hidden_states = hidden_states + ip_attn_output
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff_output
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


#: The block class -> its coalesced forward, the partial Linears it reduces together, the stock forward's digest.
FORWARDS = {FluxTransformerBlock: CoalescedForward(forward, ("ff.net.2", "ff_context.net.2"), "0b184cbe172708b6")}
