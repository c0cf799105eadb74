"""Qwen-Image's block forward for `PartialRowwiseParallel(reduced_at="block")` (`tp_plans/qwenimage.py`): stock's, with
both MLPs computed before either is used, so one all-reduce serves the pair (`parallel/coalesce.py` installs it;
`BLOCK_FORWARDS` in the plan file names this module for the family registry)."""

import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

from ..parallel.coalesce import CoalescedForward, reduce_in_block


def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
            image_rotary_emb=None, joint_attention_kwargs=None, modulate_index=None):
    """`QwenImageTransformerBlock.forward` (diffusers 0.42.1) with both MLPs reduced in one all-reduce."""
    img_mod_params = self.img_mod(temb)
    if self.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    txt_mod_params = self.txt_mod(temb)
    img_mod1, img_mod2 = img_mod_params.chunk(2, dim=-1)
    txt_mod1, txt_mod2 = txt_mod_params.chunk(2, dim=-1)

    img_normed = self.img_norm1(hidden_states)
    img_modulated, img_gate1 = self._modulate(img_normed, img_mod1, modulate_index)
    txt_normed = self.txt_norm1(encoder_hidden_states)
    txt_modulated, txt_gate1 = self._modulate(txt_normed, txt_mod1)
    joint_attention_kwargs = joint_attention_kwargs or {}
    img_attn_output, txt_attn_output = self.attn(
        hidden_states=img_modulated,
        encoder_hidden_states=txt_modulated,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )
    hidden_states = hidden_states + img_gate1 * img_attn_output
    encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn_output

    img_normed2 = self.img_norm2(hidden_states)
    img_modulated2, img_gate2 = self._modulate(img_normed2, img_mod2, modulate_index)
    img_mlp_output = self.img_mlp(img_modulated2)
    txt_normed2 = self.txt_norm2(encoder_hidden_states)
    txt_modulated2, txt_gate2 = self._modulate(txt_normed2, txt_mod2)
    txt_mlp_output = self.txt_mlp(txt_modulated2)

    img_mlp_output, txt_mlp_output = reduce_in_block(self, [img_mlp_output, txt_mlp_output])

    hidden_states = hidden_states + img_gate2 * img_mlp_output
    encoder_hidden_states = encoder_hidden_states + txt_gate2 * txt_mlp_output
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


#: The block class -> its coalesced forward, the partial Linears it reduces together, the stock forward's digest.
FORWARDS = {
    QwenImageTransformerBlock: CoalescedForward(forward, ("img_mlp.net.2", "txt_mlp.net.2"), "89de238db44a7a47"),
}
