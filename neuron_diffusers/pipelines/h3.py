"""MiniMax-H3 (modular `MiniMaxH3Blocks`, `t2va` workflow): text -> video + stereo audio.

Modular pipelines are made of named blocks, so no call needs intercepting: the `text_encoder` block runs alone on
the encoding rank, every rank runs the `denoise.*` blocks on the broadcast `prompt_embeds` + `text_token_tags`,
and the decoding rank runs the `decode.*` blocks on the latents. Each sub-pipeline loads only its own components.

H3 packs one request (text, video and audio rows) into one sequence that the blocks attend over without a mask,
and a token refiner runs self-attention over the text alone, so padding the text embeddings would change the image.
Instead, `PackedSequencePadding` appends masked rows to the *packed sequence* (as the reference implementation does
with `cu_seqlens`) so that the main blocks run at one shape per text-length bucket: real rows never attend to the
padding, which no output reads. The small token refiner runs at the prompt's own length, so only the main blocks
are compiled (`compiled_blocks`). Under context parallelism the padded total is rounded up to a multiple of the
degree, so plain Ulysses splits it evenly whatever the prompt. H3 is guidance-distilled: no negative prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import diffusers
import torch
from diffusers import ModularPipeline
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
from diffusers.modular_pipelines import SequentialPipelineBlocks

from ..media import VideoWithAudio, read_video_text, save_video
from .base import PipelineAdapter, bucket_for

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

WORKFLOW = "t2va"
_TEXT_TAG = 1  # `MINIMAX_H3_TEXT_TAG`: the modality tag the padding rows carry (any valid tag would do)


@dataclass
class H3Pipelines:
    """The sub-pipelines a rank holds: everyone denoises; only the decoding rank has a decoder."""

    denoiser: object
    decoder: object | None

    def set_progress_bar_config(self, **kwargs) -> None:
        self.denoiser.set_progress_bar_config(**kwargs)


class PackedSequencePadding:
    """Hooks that pad the transformer's packed sequence to `text bucket + other rows`, with the padding masked out.

    A pre-hook on the transformer appends `bucket - num_text_rows` rows (zero hidden state, position 0, text tag,
    timestep index 0: valid table entries, never read) to the layout tensors, and more up to a multiple of
    `multiple` (the context-parallel degree); a pre-hook on every main block hands it the matching key mask.
    `buckets = ()` and `multiple = 1` turn padding off.
    """

    def __init__(self, transformer: torch.nn.Module):
        self.buckets: tuple[int, ...] = ()
        self.multiple = 1
        self._key_mask = None
        # Torch pre-hooks, compiler-disabled and shared by every block, so the compiled blocks keep one graph.
        self._handles = [transformer.register_forward_pre_hook(self._pad_layout, with_kwargs=True)]
        for module in transformer.modules():
            if isinstance(module, MiniMaxH3TransformerBlock):  # the blocks `compiled_blocks` names
                self._handles.append(module.register_forward_pre_hook(self._mask_keys, with_kwargs=True))

    @torch.compiler.disable  # layout bookkeeping before the compiled blocks, not part of them
    def _pad_layout(self, module, args, kwargs):
        self._key_mask = None
        if not self.buckets and self.multiple == 1:
            return None
        text_rows = kwargs["text_indices"].numel()
        extra = bucket_for(self.buckets, text_rows, "MiniMax-H3") - text_rows if self.buckets else 0
        rows = kwargs["position_ids"].shape[0]
        extra += -(rows + extra) % self.multiple
        kwargs["position_ids"] = torch.cat([kwargs["position_ids"], kwargs["position_ids"].new_zeros(extra, 3)])
        kwargs["token_tags"] = torch.cat([kwargs["token_tags"], kwargs["token_tags"].new_full((extra,), _TEXT_TAG)])
        kwargs["timestep_indices"] = torch.cat(
            [kwargs["timestep_indices"], kwargs["timestep_indices"].new_zeros(extra)]
        )
        valid = torch.arange(rows + extra, device=kwargs["position_ids"].device) < rows
        self._key_mask = valid.view(1, 1, 1, -1)
        return args, kwargs

    @torch.compiler.disable
    def _mask_keys(self, module, args, kwargs):
        if self._key_mask is None:
            return None
        return args, {**kwargs, "attention_mask": self._key_mask}


class MiniMaxH3Adapter(PipelineAdapter):
    pipeline_class = "MiniMaxH3Blocks"
    buckets = (64, 128, 256, 512, 1024)  # rows of the packed sequence, see `PackedSequencePadding`
    takes_negative_prompt = False
    guidance_kwarg = None  # guidance-distilled
    #: The main blocks run on the padded packed sequence; the token refiner sees the prompt's own length.
    compiled_blocks = ("MiniMaxH3TransformerBlock",)
    output_suffix = ".mp4"
    stock_output_kwargs = {"output": "videos"}
    batch_refusal = ("MiniMax-H3 packs one request into one sequence (its transformer has no batch dimension), so "
                     "it makes one clip per call; generate with batch_size=1")

    def load_encoder(self, checkpoint: Checkpoint, torch_dtype):
        return _load(_sub_pipeline(checkpoint, "text_encoder"), checkpoint, torch_dtype)

    def load_stock(self, checkpoint: Checkpoint, **kwargs):
        """The whole `t2va` workflow in one process (the modular pipeline prunes its blocks to the workflow)."""
        pipe = ModularPipeline.from_pretrained(str(checkpoint.path), workflow=WORKFLOW)
        return load_every_component(pipe, checkpoint.path, **kwargs)

    def save(self, output: VideoWithAudio, path, text: dict[str, str]) -> list:
        """An MP4 (H.264 + AAC, settings in its metadata) and the untouched audio as a WAV beside it."""
        return save_video(output, path, text=text)

    def read_settings(self, path) -> dict[str, str] | None:
        """The MP4's metadata, when the MP4 and the WAV beside it are both complete."""
        return read_video_text(path, audio=True)

    def load_denoiser(self, checkpoint: Checkpoint, transformer, torch_dtype, device: torch.device, decodes: bool,
                      helps_decode: bool = False):
        denoiser = _sub_pipeline(checkpoint, "denoise")
        denoiser.load_components(names=[n for n in denoiser.pretrained_component_names if n != "transformer"])
        denoiser.update_components(transformer=transformer)
        # The denoise blocks read the VAEs' geometry (latent channels, frame chunking) through pipeline properties
        # that fall back to the released values when no VAE is set; meta-device VAEs answer them exactly with no
        # weights. Plain attributes, not components, so the pipeline's device still comes from the transformer.
        denoiser.vae = checkpoint.meta("vae")
        denoiser.audio_vae = checkpoint.meta("audio_vae")
        denoiser.sequence_padding = PackedSequencePadding(transformer)
        decoder = None
        if decodes or helps_decode:
            # A rank that only helps (parallel VAE) decodes video with the leader; the small audio VAE stays there.
            blocks = "decode" if decodes else "decode.video"
            decoder = _load(_sub_pipeline(checkpoint, blocks), checkpoint, torch_dtype)
            decoder.to(device)
        return H3Pipelines(denoiser, decoder)

    def size_multiple(self, checkpoint: Checkpoint) -> int:
        """The pipeline's `canvas_multiple`: the VAE's spatial compression times the transformer's patch width."""
        compression = math.prod(checkpoint.config("vae")["spatial_downsample_factors"])
        return compression * checkpoint.config("transformer").get("patch_size", (1, 2, 2))[2]

    def lora_loader(self):
        """The modular pipeline stock `load_lora_weights` runs on (`MiniMaxH3LoraLoaderMixin`): LoRAs for `transformer`
        (the `t2va` workflow's one denoiser; `transformer_ref` parts are refused, as stock refuses them here)."""
        return diffusers.MiniMaxH3ModularPipeline

    def transformer_of(self, pipes: H3Pipelines) -> torch.nn.Module:
        return pipes.denoiser.transformer

    def configure_context_parallel(self, pipes: H3Pipelines, multiple: int) -> None:
        pipes.denoiser.sequence_padding.multiple = multiple

    def decoders(self, pipes: H3Pipelines) -> list[torch.nn.Module]:
        """The video and audio decoders' modules (none where this rank does not decode)."""
        if pipes.decoder is None:
            return []
        audio_vae = getattr(pipes.decoder, "audio_vae", None)  # only on the rank that keeps the output
        return [pipes.decoder.vae.decoder] + ([audio_vae.decoder] if audio_vae is not None else [])

    def vae(self, pipes: H3Pipelines) -> torch.nn.Module | None:
        return None if pipes.decoder is None else pipes.decoder.vae

    def encode(self, encoder, prompt: str, negative_prompt: str | None) -> dict[str, torch.Tensor]:
        return encoder(prompt=prompt, output=["prompt_embeds", "text_token_tags"])

    def __call__(self, pipes: H3Pipelines, embeds, *, generator, decodes: bool, check, buckets=(),
                 helps_decode: bool = False, **kwargs):
        """Denoise on every rank (packed sequence padded to `buckets`); decode video and audio on the decoding rank,
        the video also on the ranks that `helps_decode` (parallel VAE), which drop it."""
        pipes.denoiser.sequence_padding.buckets = tuple(buckets)
        handle = pipes.denoiser.transformer.register_forward_pre_hook(check.pre_hook, with_kwargs=True)
        try:
            latents = pipes.denoiser(**embeds, generator=generator, output=["latents", "audio_latents"], **kwargs)
        finally:
            handle.remove()
        check.check([latents["latents"], latents["audio_latents"]], "the last step")
        if not decodes:
            if helps_decode:
                pipes.decoder(latents=latents["latents"], output_type="pt", output=["videos"])
            return None
        decoded = pipes.decoder(**latents, output_type="pt", output=["videos", "audio", "sampling_rate"])
        return VideoWithAudio(
            frames=decoded["videos"][0].float().cpu(),
            fps=float(pipes.denoiser.fps),
            audio=decoded["audio"][0].float().cpu(),
            sampling_rate=int(decoded["sampling_rate"]),
        )


def _sub_pipeline(checkpoint: Checkpoint, prefix: str):
    """The `t2va` blocks named `prefix` or `prefix.*`, as a pipeline bound to `checkpoint` (no weights read yet)."""
    blocks = ModularPipeline.from_pretrained(str(checkpoint.path), workflow=WORKFLOW).blocks.sub_blocks
    chosen = {name: block for name, block in blocks.items() if name == prefix or name.startswith(prefix + ".")}
    return SequentialPipelineBlocks.from_blocks_dict(chosen).init_pipeline(str(checkpoint.path))


def load_every_component(pipe, source, **load_kwargs):
    """`pipe.load_components(**load_kwargs)`, raising for any component that did not load.

    Stock `load_components` only logs a warning for a component that fails, leaving it `None` until a block trips
    over it.
    """
    pipe.load_components(**load_kwargs)
    missing = pipe.null_component_names
    if missing:
        raise RuntimeError(
            f"MiniMax-H3 at {source} did not load {', '.join(missing)}; see the warnings logged above for each failure."
        )
    return pipe


def _load(pipe, checkpoint: Checkpoint, torch_dtype):
    return load_every_component(pipe, checkpoint.path, **({} if torch_dtype is None else {"dtype": torch_dtype}))
