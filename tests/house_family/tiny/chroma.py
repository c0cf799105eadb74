"""A tiny random Chroma checkpoint for the stock `ChromaPipeline`, built offline (FLUX.1's tiny T5 and VAE)."""

import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

from neuron_diffusers.tiny import flux
from neuron_diffusers.tiny._tokenizers import t5_tokenizer

DEFAULT_SIZE = (32, 32)
SMALLEST_CALL = {"num_inference_steps": 2}


def build(path, seed: int = 0) -> None:
    tokenizer = t5_tokenizer()
    torch.manual_seed(seed)
    text_encoder = flux._t5(len(tokenizer))
    torch.manual_seed(seed)
    vae = flux._vae()
    torch.manual_seed(seed)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
        approximator_hidden_dim=32, approximator_layers=1)
    ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                   tokenizer=tokenizer, transformer=transformer).save_pretrained(path)
