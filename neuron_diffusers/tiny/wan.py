"""A tiny random Wan 2.1 text-to-video checkpoint for the stock `diffusers.WanPipeline`, built offline.

The released structure at toy widths: a UMT5 encoder behind a T5 (SentencePiece) tokenizer (the real one is
`google/umt5-xxl`'s), the causal 3-D `AutoencoderKLWan` (8x spatial, 4x temporal compression as released), the
`WanTransformer3DModel` with its Q/K RMSNorms over all heads, and Wan 2.1's `UniPCMultistepScheduler` in flow mode.
"""

from __future__ import annotations

import os

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from ._tokenizers import t5_tokenizer

# Height and width must be multiples of the VAE's 8x times the 2x2 patch: 32 x 32 gives 2 x 2 tokens per latent frame.
DEFAULT_SIZE = (32, 32)
# The pipeline's (and the release's) clip length: 81 frames, 21 latent frames (the VAE compresses time 4x after the
# first frame); at 32 x 32 that is 84 video tokens, which split evenly for context parallelism of degree 2 and 4.
DEFAULT_NUM_FRAMES = 81
# Two transformer forwards (each with its CFG branch), at the default clip length.
SMALLEST_CALL = {"num_inference_steps": 2, "num_frames": DEFAULT_NUM_FRAMES}

_TEXT_DIM = 32  # the UMT5 width, i.e. the transformer's `text_dim` (4096 released)
_LATENT_CHANNELS = 4  # z_dim (16 released)


def _text_encoder(vocab_size: int) -> UMT5EncoderModel:
    return UMT5EncoderModel(UMT5Config(vocab_size=vocab_size, d_model=_TEXT_DIM, d_kv=8, d_ff=64, num_layers=2,
                                       num_heads=4, relative_attention_num_buckets=8))


def _vae() -> AutoencoderKLWan:
    """Four levels (three spatial halvings, two temporal), as released, at 8 base channels."""
    return AutoencoderKLWan(base_dim=8, z_dim=_LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True],
                            latents_mean=[0.1, -0.2, 0.3, -0.1], latents_std=[1.5, 2.0, 1.2, 2.5])


def _transformer() -> WanTransformer3DModel:
    """2 blocks, 4 heads of 12 (inner 48): TP=2 and 4 hold whole heads, and tp=2 x ulysses=2 one head per rank.

    A head of 12 gives the 3-D rotary embedding 4 temporal and 4 + 4 spatial channels (12 // 6 * 2 each).
    """
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12,
                                 in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, text_dim=_TEXT_DIM,
                                 freq_dim=32, ffn_dim=96, num_layers=2, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)


def build(path: str | os.PathLike, seed: int = 0) -> None:
    """Build the tiny pipeline deterministically from `seed` and save_pretrained it to `path` (safetensors).

    Each random component is built right after reseeding, so one component's shape never shifts another's weights.
    The norms' weights start at one; the Q/K norms' are made random, so that a rank applying the wrong slice of
    them shows in the numbers.
    """
    tokenizer = t5_tokenizer()
    torch.manual_seed(seed)
    text_encoder = _text_encoder(len(tokenizer))
    torch.manual_seed(seed)
    vae = _vae()
    torch.manual_seed(seed)
    transformer = _transformer()
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)  # Q/K norm weights: random, so each rank's slice of them matters
    # Wan 2.1's scheduler: UniPC in flow-matching mode, shift 3 (480p; 5 at 720p).
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                scheduler=scheduler).save_pretrained(path)
