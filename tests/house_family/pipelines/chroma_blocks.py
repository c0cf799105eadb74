"""Chroma's double-stream block forward with both feed-forwards reduced in one all-reduce: what a family from outside
the package adds for `PartialRowwiseParallel(reduced_at="block")`, named by `BLOCK_FORWARDS` in its plan file."""

import torch
from diffusers.models.transformers.transformer_chroma import ChromaTransformerBlock

from neuron_diffusers.parallel.coalesce import CoalescedForward, reduce_in_block


def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, attention_mask=None,
            joint_attention_kwargs=None):
    """`ChromaTransformerBlock.forward` (diffusers 0.42.1) with both feed-forwards computed before either is used."""
    temb_img, temb_txt = temb[:, :6], temb[:, 6:]
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb_img)
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb_txt
    )
    joint_attention_kwargs = joint_attention_kwargs or {}
    if attention_mask is not None:
        attention_mask = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        attention_mask=attention_mask,
        **joint_attention_kwargs,
    )

    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
    norm_hidden_states = self.norm2(hidden_states)
    norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    ff_output = self.ff(norm_hidden_states)

    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states)
    norm_encoder_hidden_states = norm_encoder_hidden_states * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    context_ff_output = self.ff_context(norm_encoder_hidden_states)

    ff_output, context_ff_output = reduce_in_block(self, [ff_output, context_ff_output])

    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff_output
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff_output
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


FORWARDS = {ChromaTransformerBlock: CoalescedForward(forward, ("ff.net.2", "ff_context.net.2"), "c532ef9f179693a1")}
