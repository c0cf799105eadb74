"""VAE internals: the building blocks parallel VAE recognises by class, and the KL posterior rebuilt on ranks without
a VAE (gaps 8 and 10 of `compat/__init__.py`)."""

from __future__ import annotations

import torch
from diffusers.models import attention_processor, downsampling, modeling_outputs
from diffusers.models.autoencoders import autoencoder_kl_qwenimage, autoencoder_kl_qwenimage21, autoencoder_kl_wan
from diffusers.models.autoencoders import vae as vae_module

#: diffusers' VAE building blocks (not exported) that parallel VAE handles, by what they do along the rows
#: (see `parallel/vae_rows.py`): self-attention over a whole frame ("gathered"), convolutions that pad their rows
#: themselves in `forward` ("self_padding_convs": (k - 1) / 2 rows, checked at run time), `Downsample2D`, whose
#: `padding=0` means one zero row below in `forward` then `conv` ("bottom_padded_downsample": reads `use_conv`,
#: `padding`, `conv`), and blocks whose output row depends only on its own input rows ("row_local").
VAE_BLOCKS = {
    "gathered": ((attention_processor, "Attention"), (autoencoder_kl_qwenimage, "QwenImageAttentionBlock"),
                 (autoencoder_kl_qwenimage21, "QwenImage21AttentionBlock"), (autoencoder_kl_wan, "WanAttentionBlock")),
    "self_padding_convs": ((autoencoder_kl_qwenimage, "QwenImageCausalConv3d"),
                           (autoencoder_kl_qwenimage21, "QwenImage21CausalConv3d"),
                           (autoencoder_kl_wan, "WanCausalConv3d")),
    "bottom_padded_downsample": ((downsampling, "Downsample2D"),),
    "row_local": ((autoencoder_kl_qwenimage, "QwenImageRMS_norm"), (autoencoder_kl_qwenimage21, "QwenImage21RMS_norm"),
                  (autoencoder_kl_qwenimage, "QwenImageUpsample"), (autoencoder_kl_qwenimage21, "QwenImage21Upsample"),
                  (autoencoder_kl_qwenimage21, "QwenImage21AvgDown3D"),
                  (autoencoder_kl_qwenimage21, "QwenImage21DupUp3D"),
                  (autoencoder_kl_wan, "WanRMS_norm"), (autoencoder_kl_wan, "WanUpsample"),
                  (autoencoder_kl_wan, "AvgDown3D"), (autoencoder_kl_wan, "DupUp3D")),
}

#: The posterior and output container a KL VAE's `encode` returns (neither exported).
PRIVATE_NAMES = (
    (vae_module, "DiagonalGaussianDistribution"),
    (modeling_outputs, "AutoencoderKLOutput"),
    *(entry for entries in VAE_BLOCKS.values() for entry in entries),
)


def vae_blocks(role: str) -> tuple[type, ...]:
    """The diffusers classes of one role of `VAE_BLOCKS`; a class this release lacks is left out (and refused)."""
    return tuple(getattr(module, name) for module, name in VAE_BLOCKS[role] if hasattr(module, name))


def posterior_parameters(encoded) -> torch.Tensor:
    """The mean and log-variance (`parameters`) of a KL VAE's `encode` output, refused for any other posterior:
    only a diagonal Gaussian can be rebuilt from its parameters on the ranks without a VAE."""
    posterior = encoded.latent_dist if hasattr(encoded, "latent_dist") else encoded[0]
    if type(posterior) is not vae_module.DiagonalGaussianDistribution or posterior.deterministic:
        raise NotImplementedError(
            f"The VAE's `encode` returned a {type(posterior).__name__}, not a (non-deterministic) diagonal Gaussian "
            "posterior: neuron_diffusers can only share KL-VAE encodings across a TP group."
        )
    return posterior.parameters


def vae_encode_output(parameters: torch.Tensor, return_dict: bool = True):
    """What a KL VAE's `encode(x, return_dict)` returns, rebuilt from its posterior's `parameters`."""
    posterior = vae_module.DiagonalGaussianDistribution(parameters)
    return modeling_outputs.AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)
