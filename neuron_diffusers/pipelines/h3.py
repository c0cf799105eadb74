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

A batch (`generate(batch_size=...)`) packs its requests into one sequence, each its own attention document
(`h3_batch`), and decodes each clip alone.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import diffusers
import torch
from diffusers import ModularPipeline
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TokenRefinerBlock, MiniMaxH3TransformerBlock
from diffusers.modular_pipelines import SequentialPipelineBlocks

from ..media import VideoWithAudio, read_video_text, save_video
from .base import PipelineAdapter, bucket_for
from .h3_batch import DenoisePieces, denoise_batch, denoise_pieces, unstack

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

WORKFLOW = "t2va"
_TEXT_TAG = 1  # `MINIMAX_H3_TEXT_TAG`: the modality tag the padding rows carry (any valid tag would do)


@dataclass
class H3Pipelines:
    """The sub-pipelines a rank holds: everyone denoises; only the decoding rank has a decoder."""

    denoiser: object
    decoder: object | None
    path: str = ""  # the checkpoint's folder, where a batch's pipelines read their configs
    _pieces: DenoisePieces | None = None
    _progress: dict = field(default_factory=dict)

    def set_progress_bar_config(self, **kwargs) -> None:
        self.denoiser.set_progress_bar_config(**kwargs)
        self._progress = kwargs
        if self._pieces is not None:
            self._pieces.loop.set_progress_bar_config(**kwargs)

    def pieces(self) -> DenoisePieces:
        """The denoiser's blocks split around its loop, for batches (`h3_batch`), built on first use."""
        if self._pieces is None:
            self._pieces = denoise_pieces(self.denoiser, self.path)
            self._pieces.loop.set_progress_bar_config(**self._progress)
        return self._pieces


class PackedSequencePadding:
    """Hooks that pad the transformer's packed sequence to `text bucket + other rows`, with the padding masked out.

    A pre-hook on the transformer appends `bucket - num_text_rows` rows (zero hidden state, position 0, text tag,
    timestep index 0: valid table entries, never read) to the layout tensors, and more up to a multiple of
    `multiple` (the context-parallel degree); a pre-hook on every main block hands it the matching key mask.
    `buckets = ()` and `multiple = 1` turn padding off.

    In a `batch` (several requests packed one after another, `h3_batch`), each request's text is padded to the
    bucket of the batch's longest, so a batch's shape depends only on its size and that bucket (what warm-up
    compiles), and the mask is block-diagonal: each request, and the padding, is its own attention document; the
    token refiner's attention gets the same over the texts.
    """

    def __init__(self, transformer: torch.nn.Module):
        self.buckets: tuple[int, ...] = ()
        self.multiple = 1
        self._segments: list[tuple[int, int]] = []  # a batch's (text rows, packed rows) per request, in order
        self._key_mask = self._text_mask = None
        # Torch pre-hooks, compiler-disabled and shared by every block, so the compiled blocks keep one graph.
        self._handles = [transformer.register_forward_pre_hook(self._pad_layout, with_kwargs=True)]
        for module in transformer.modules():
            if isinstance(module, MiniMaxH3TransformerBlock):  # the blocks `compiled_blocks` names
                self._handles.append(module.register_forward_pre_hook(self._mask_keys, with_kwargs=True))
            elif isinstance(module, MiniMaxH3TokenRefinerBlock):  # self-attention over the text alone
                self._handles.append(module.attn.register_forward_pre_hook(self._mask_text, with_kwargs=True))

    @contextmanager
    def batch(self, segments: list[tuple[int, int]]):
        """Within: the transformer's packed sequence is `segments`' requests one after another."""
        self._segments = list(segments)
        try:
            yield
        finally:
            self._segments = []

    @torch.compiler.disable  # layout bookkeeping before the compiled blocks, not part of them
    def _pad_layout(self, module, args, kwargs):
        self._key_mask = self._text_mask = None
        texts = [text for text, _ in self._segments] or [kwargs["text_indices"].numel()]
        if len(texts) == 1 and not self.buckets and self.multiple == 1:
            return None
        rows = kwargs["position_ids"].shape[0]
        if self._segments and (sum(texts) != kwargs["text_indices"].numel()
                               or sum(packed for _, packed in self._segments) != rows):
            raise RuntimeError(f"A MiniMax-H3 batch of {self._segments} (text rows, packed rows) met a packed "
                               f"sequence of {rows} rows with {kwargs['text_indices'].numel()} text rows.")
        extra = len(texts) * bucket_for(self.buckets, max(texts), "MiniMax-H3") - sum(texts) if self.buckets else 0
        extra += -(rows + extra) % self.multiple
        kwargs["position_ids"] = torch.cat([kwargs["position_ids"], kwargs["position_ids"].new_zeros(extra, 3)])
        kwargs["token_tags"] = torch.cat([kwargs["token_tags"], kwargs["token_tags"].new_full((extra,), _TEXT_TAG)])
        kwargs["timestep_indices"] = torch.cat(
            [kwargs["timestep_indices"], kwargs["timestep_indices"].new_zeros(extra)]
        )
        device = kwargs["position_ids"].device
        if len(texts) == 1:
            self._key_mask = (torch.arange(rows + extra, device=device) < rows).view(1, 1, 1, -1)
        else:
            self._key_mask = _documents([packed for _, packed in self._segments] + [extra], device)
            self._text_mask = _documents(texts, device)
        return args, kwargs

    @torch.compiler.disable
    def _mask_keys(self, module, args, kwargs):
        if self._key_mask is None:
            return None
        return args, {**kwargs, "attention_mask": self._key_mask}

    @torch.compiler.disable
    def _mask_text(self, module, args, kwargs):
        if self._text_mask is None:
            return None
        return args, {**kwargs, "attention_mask": self._text_mask}


def _documents(lengths: list[int], device) -> torch.Tensor:
    """A block-diagonal attention mask, `(1, 1, rows, rows)`: each run of `lengths` rows attends only within itself
    (a padding run too, so no row is left without a key: its softmax would be NaN, and 0 x NaN is NaN)."""
    document = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    return (document[:, None] == document[None, :]).view(1, 1, document.numel(), -1)


class MiniMaxH3Adapter(PipelineAdapter):
    pipeline_class = "MiniMaxH3Blocks"
    buckets = (64, 128, 256, 512, 1024)  # rows of the packed sequence, see `PackedSequencePadding`
    takes_negative_prompt = False
    guidance_kwarg = None  # guidance-distilled
    #: The main blocks run on the padded packed sequence; the token refiner sees the prompt's own length.
    compiled_blocks = ("MiniMaxH3TransformerBlock",)
    output_suffix = ".mp4"
    stock_output_kwargs = {"output": "videos"}
    #: A batch packs its requests into one sequence, each its own attention document (`h3_batch`).
    batch_refusal = None
    cp_batch_refusal = ("MiniMax-H3 packs a batch into one sequence with a block-diagonal attention mask, which "
                        "is not verified under context parallelism")
    #: `output_type="latent"`: the denoised latents (video and audio), undecoded; omitted: the decoded clip.
    output_types = ("latent",)

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
        return H3Pipelines(denoiser, decoder, str(checkpoint.path))

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
                 helps_decode: bool = False, output_type: str | None = None, **kwargs):
        """Denoise on every rank (packed sequence padded to `buckets`); decode video and audio on the decoding rank,
        the video also on the ranks that `helps_decode` (parallel VAE), which drop it. With a list of generators, a
        batch (`h3_batch`): the list of its outputs. `output_type="latent"`: the denoised `latents` and
        `audio_latents` (a dict), undecoded."""
        pipes.denoiser.sequence_padding.buckets = tuple(buckets)
        handle = pipes.denoiser.transformer.register_forward_pre_hook(check.pre_hook, with_kwargs=True)
        try:
            if isinstance(generator, list):
                made = denoise_batch(pipes.pieces(), pipes.denoiser.sequence_padding, unstack(embeds, len(generator)),
                                     generator, kwargs)
            else:
                made = [pipes.denoiser(**embeds, generator=generator, output=["latents", "audio_latents"], **kwargs)]
        finally:
            handle.remove()
        check.check([one[name] for one in made for name in ("latents", "audio_latents")], "the last step")
        outputs = [self._output(pipes, one, decodes, helps_decode and output_type != "latent", output_type)
                   for one in made]
        return outputs if isinstance(generator, list) else outputs[0]

    def _output(self, pipes: H3Pipelines, latents: dict, decodes: bool, helps_decode: bool, output_type):
        """One request's output from its denoised latents (None where this rank keeps none)."""
        if not decodes:
            if helps_decode:
                pipes.decoder(latents=latents["latents"], output_type="pt", output=["videos"])
            return None
        if output_type == "latent":
            return latents
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
