"""Tiny random stock pipelines of three classes no family of ours runs, built in code for `test_generic.py`.

Each builds the complete stock pipeline (tokenizers included, offline) at toy widths and `save_pretrained`s it, so
the generic adapter loads it back exactly as it would a real checkpoint. Why these three: SD3 has three text
encoders and pooled embeddings (and a drafted plan with per-block rules: its last block has no text output), Chroma
passes attention masks and pads its T5 text itself, LTX-Video makes video (frames, a 3-D VAE) with a plan that keeps
attention whole; all three use only CLIP / T5 tokenizers, which build offline.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLLTXVideo,
    ChromaPipeline,
    ChromaTransformer2DModel,
    FlowMatchEulerDiscreteScheduler,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from neuron_diffusers.tiny._tokenizers import clip_tokenizer, t5_tokenizer

_TEXT = 32


def _t5(vocab_size: int) -> T5EncoderModel:
    torch.manual_seed(0)
    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=_TEXT, d_kv=8, d_ff=2 * _TEXT, num_layers=1,
                                   num_heads=4, feed_forward_proj="gated-gelu", dropout_rate=0.0))


def _clip(tokenizer, seed: int) -> CLIPTextModelWithProjection:
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=_TEXT // 2, intermediate_size=_TEXT, projection_dim=_TEXT // 2,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id))


def _vae(latent_channels: int, **kwargs) -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=4, **kwargs)


def build_sd3(path) -> None:
    """SD3: CLIP-L + CLIP-G (pooled, 16 + 16) and T5 (sequence, 32), an MMDiT of 2 joint blocks, 4 heads of 8."""
    tokenizers = clip_tokenizer(), clip_tokenizer(), t5_tokenizer(model_max_length=64)
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                        joint_attention_dim=_TEXT, pooled_projection_dim=_TEXT, out_channels=4)
    StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(4, shift_factor=0.0609, scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=_clip(tokenizers[0], 0), tokenizer=tokenizers[0], text_encoder_2=_clip(tokenizers[1], 1),
        tokenizer_2=tokenizers[1], text_encoder_3=_t5(len(tokenizers[2])), tokenizer_3=tokenizers[2],
    ).save_pretrained(path)


def build_chroma(path) -> None:
    """Chroma: T5 with an attention mask, a FLUX-like transformer (1 double + 1 single block, 4 heads of 16) whose
    modulation comes from a small approximator; the pipeline packs 2x2 latent patches itself."""
    tokenizer = t5_tokenizer(model_max_length=64)
    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                           attention_head_dim=16, num_attention_heads=4, joint_attention_dim=_TEXT,
                                           axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
                                           approximator_hidden_dim=32, approximator_layers=1)
    ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                   vae=_vae(4, shift_factor=0.1159, scaling_factor=0.3611),
                   text_encoder=_t5(len(tokenizer)),
                   tokenizer=tokenizer, transformer=transformer).save_pretrained(path)


def build_ltx(path) -> None:
    """LTX-Video: T5 with an attention mask, a video transformer of 1 block (4 heads of 8), a causal 3-D VAE that
    compresses 4x in space and time."""
    tokenizer = t5_tokenizer(model_max_length=64)
    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                             num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
                                             num_layers=1, caption_channels=_TEXT)
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False)
    LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=_t5(len(tokenizer)),
                tokenizer=tokenizer, transformer=transformer).save_pretrained(path)


#: name -> (builder, the stock class, the call that makes it: size, steps, frames).
PIPELINES = {
    "sd3": (build_sd3, StableDiffusion3Pipeline, dict(height=32, width=32, num_inference_steps=2)),
    "chroma": (build_chroma, ChromaPipeline, dict(height=32, width=32, num_inference_steps=2)),
    "ltx": (build_ltx, LTXPipeline, dict(height=32, width=32, num_frames=9, num_inference_steps=2)),
}
