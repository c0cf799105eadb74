"""MiniMax-H3 (modular `MiniMaxH3Blocks`, `t2va` workflow): text -> video + stereo audio.

Modular pipelines are made of named blocks, so no call needs intercepting: the `text_encoder` block runs alone on
the encoding rank, every rank runs the `denoise.*` blocks on the broadcast `prompt_embeds` + `text_token_tags`,
and the decoding rank runs the `decode.*` blocks on the latents. Each sub-pipeline loads only its own components.

H3 packs one request into one sequence with no text mask, so its embeddings are never padded (padding would add
text the model attends to), and it is guidance-distilled: no negative prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..media import VideoWithAudio
from .base import model_on_meta

WORKFLOW = "t2va"


@dataclass
class H3Pipelines:
    """The sub-pipelines a rank holds: everyone denoises; only the decoding rank has a decoder."""

    denoiser: object
    decoder: object | None

    def set_progress_bar_config(self, **kwargs) -> None:
        self.denoiser.set_progress_bar_config(**kwargs)


class MiniMaxH3Adapter:
    pipeline_class = "MiniMaxH3Blocks"
    encode_kwargs: tuple[str, ...] = ()
    buckets: tuple[int, ...] = ()
    takes_negative_prompt = False

    def load_encoder(self, checkpoint: Path, torch_dtype):
        return _load(_sub_pipeline(checkpoint, "text_encoder"), torch_dtype)

    def load_denoiser(self, checkpoint: Path, transformer, torch_dtype, device: torch.device, decodes: bool):
        denoiser = _sub_pipeline(checkpoint, "denoise")
        denoiser.load_components(names=[n for n in denoiser.pretrained_component_names if n != "transformer"])
        denoiser.update_components(transformer=transformer)
        # The denoise blocks read the VAEs' geometry (latent channels, frame chunking) through pipeline properties
        # that fall back to the released values when no VAE is set; meta-device VAEs answer them exactly with no
        # weights. Plain attributes, not components, so the pipeline's device still comes from the transformer.
        denoiser.vae = model_on_meta(checkpoint, "vae")
        denoiser.audio_vae = model_on_meta(checkpoint, "audio_vae")
        decoder = None
        if decodes:
            decoder = _load(_sub_pipeline(checkpoint, "decode"), torch_dtype)
            decoder.to(device)
        return H3Pipelines(denoiser, decoder)

    def encode(self, encoder, prompt: str, negative_prompt: str | None) -> dict[str, torch.Tensor]:
        return encoder(prompt=prompt, output=["prompt_embeds", "text_token_tags"])

    def pad(self, embeds: dict[str, torch.Tensor], buckets=None) -> dict[str, torch.Tensor]:
        return embeds

    def __call__(self, pipes: H3Pipelines, embeds, *, generator, decodes: bool, check, **kwargs):
        """Denoise on every rank; decode video and audio on the decoding rank only."""
        handle = pipes.denoiser.transformer.register_forward_pre_hook(check.pre_hook, with_kwargs=True)
        try:
            latents = pipes.denoiser(**embeds, generator=generator, output=["latents", "audio_latents"], **kwargs)
        finally:
            handle.remove()
        check.check([latents["latents"], latents["audio_latents"]], "the last step")
        if not decodes:
            return None
        decoded = pipes.decoder(**latents, output_type="pt", output=["videos", "audio", "sampling_rate"])
        return VideoWithAudio(
            frames=decoded["videos"][0].float().cpu(),
            fps=float(pipes.denoiser.fps),
            audio=decoded["audio"][0].float().cpu(),
            sampling_rate=int(decoded["sampling_rate"]),
        )


def _sub_pipeline(checkpoint: Path, prefix: str):
    """The `t2va` blocks named `prefix` or `prefix.*`, as a pipeline bound to `checkpoint` (no weights read yet)."""
    from diffusers import ModularPipeline
    from diffusers.modular_pipelines import SequentialPipelineBlocks

    blocks = ModularPipeline.from_pretrained(str(checkpoint), workflow=WORKFLOW).blocks.sub_blocks
    chosen = {name: block for name, block in blocks.items() if name == prefix or name.startswith(prefix + ".")}
    return SequentialPipelineBlocks.from_blocks_dict(chosen).init_pipeline(str(checkpoint))


def _load(pipe, torch_dtype):
    """Load every component of `pipe`, raising for any that did not load (stock only logs a warning)."""
    pipe.load_components(**({} if torch_dtype is None else {"dtype": torch_dtype}))
    if pipe.null_component_names:
        raise RuntimeError(
            f"MiniMax-H3 components {', '.join(pipe.null_component_names)} did not load; see the warnings above."
        )
    return pipe
