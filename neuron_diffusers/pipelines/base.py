"""What the runner must know about a stock pipeline family that it cannot look up: how to encode a prompt on
CPU, which call kwargs carry the embeddings, and whether they may be padded to a static length.

Everything else (latent preparation, the denoising loop, guidance, decoding) stays in the stock pipeline.
Each rank builds the pipeline from only the components its role needs:

- the *encoder* (one rank per TP group): the stock pipeline holding just the text components, on CPU;
- the *denoiser* (every rank): the stock pipeline holding the sharded transformer and the scheduler, plus the
  VAE on the rank that decodes and, with parallel VAE, on the ranks that help it (`helps_decode`: they run the
  same stock decode on their piece and drop the output). A rank without a VAE gets one built on the meta device
  from its config, so the pipeline derives its scale factors exactly as with the real one, and then drops it:
  no VAE weight is read and any code path that would decode there fails loudly instead.
"""

from __future__ import annotations

import copy
import inspect
from typing import TYPE_CHECKING

import diffusers
import torch
import torch.nn.functional as F

from ..media import save_png

if TYPE_CHECKING:  # the checkpoint module looks adapters up through `families`, which imports this one
    from ..checkpoint import Checkpoint
    from ..families import PipelineClass

#: What every rank's pipeline holds around the sharded transformer; every other component is the encoder's.
DENOISER_COMPONENTS = ("transformer", "vae", "scheduler")


class PipelineAdapter:
    """What every family's adapter declares, with the defaults most share. The runner, the job and `compile` read
    only these and the methods below, whichever kind of pipeline (stock or modular) the adapter drives."""

    pipeline_class: str
    #: Call kwargs that shape both the encoding and the pipeline call (e.g. `max_sequence_length`).
    encode_kwargs: tuple[str, ...] = ()
    #: Static lengths the text is padded to, or `()` when the pipeline fixes the length itself (FLUX) or padding
    #: would change the image (see the subclass).
    buckets: tuple[int, ...] = ()
    #: Whether the pipeline takes a negative prompt (true classifier-free guidance).
    takes_negative_prompt: bool = True
    #: The call kwarg a job's `--guidance` sets (`None`: guidance-distilled, nothing to set).
    guidance_kwarg: str | None = "guidance_scale"
    #: Whether the pipeline itself fixes the text length (FLUX pads to `max_sequence_length`), so no bucket is needed.
    static_text_length: bool = False
    #: Block classes to compile; `None`: all of the transformer's repeated blocks.
    compiled_blocks: tuple[str, ...] | None = None
    #: The file a generation is saved as (`save`).
    output_suffix: str = ".png"
    #: Call kwargs a stock single-process call needs to return what this adapter compares (tools, tests).
    stock_output_kwargs: dict = {"output_type": "latent"}
    #: What the family verified of the class it drives (`for_pipeline`); None: the adapter's own, no image inputs.
    record: PipelineClass | None = None
    #: Every class the family verified on its transformer (`for_pipeline`): what error messages suggest.
    family_classes: tuple[str, ...] = ()

    def for_pipeline(self, record: PipelineClass, family_classes: tuple[str, ...] = ()) -> PipelineAdapter:
        """This adapter driving the stock class `record` names on the family's transformer."""
        if record.name != self.pipeline_class:
            raise ValueError(f"{self.pipeline_class} runs as a modular pipeline; it cannot drive {record.name}.")
        adapter = copy.copy(self)
        adapter.record, adapter.family_classes = record, family_classes
        return adapter

    @property
    def own_class(self) -> bool:
        """Whether it drives the family's own text-to-image class (any other class is loaded for its image inputs)."""
        return type(self).pipeline_class == self.pipeline_class

    @property
    def names_cfg_branches(self) -> bool:
        """Whether its true CFG names the transformer calls' branches, as CFG parallelism needs (`PipelineClass`)."""
        return self.record.named_cfg_branches if self.record is not None else self.own_class

    def call_parameters(self) -> frozenset[str]:
        """The stock call's parameters: image inputs run only on stock classes (a modular pipeline has none here)."""
        return frozenset()

    def load_encoder(self, checkpoint: Checkpoint, torch_dtype: torch.dtype | None):
        """The text components, on CPU, ready for `encode` (only the encoding rank calls this)."""
        raise NotImplementedError

    def load_denoiser(self, checkpoint: Checkpoint, transformer, torch_dtype, device: torch.device, decodes: bool,
                      helps_decode: bool = False):
        """What every rank runs around `transformer`; the decoder only where it `decodes` (and keeps the output) or
        `helps_decode` (parallel VAE: takes part in the leader's decode)."""
        raise NotImplementedError

    def load_stock(self, checkpoint: Checkpoint, **kwargs):
        """The stock pipeline with every component, in one process: what the parallel one must match."""
        raise NotImplementedError

    def save(self, output, path, text: dict[str, str]) -> list:
        """Write one generation (with `text`, its settings, inside the file); returns the files written."""
        return [save_png(output, path, text=text)]

    def encode(self, encoder, prompt: str, negative_prompt: str | None, **encode_kwargs) -> dict[str, torch.Tensor]:
        """The call kwargs that carry the embeddings of `prompt` (and `negative_prompt`), computed on CPU."""
        raise NotImplementedError

    def pad(self, embeds: dict[str, torch.Tensor], buckets: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
        """`embeds` padded to a length bucket (unchanged by default)."""
        return embeds

    def size_multiple(self, checkpoint: Checkpoint) -> int:
        """What height and width must be multiples of."""
        raise NotImplementedError

    def transformer_of(self, pipe) -> torch.nn.Module:
        return pipe.transformer

    def lora_loader(self):
        """The diffusers class whose `load_lora_weights` loads LoRAs into this pipeline (None: it takes none)."""
        return None

    def decoders(self, pipe) -> list[torch.nn.Module]:
        """The modules whose forwards are the decode (none where this rank does not decode)."""
        raise NotImplementedError

    def vae(self, pipe) -> torch.nn.Module | None:
        """The image (video) VAE this rank holds, the one parallel VAE splits; None where it holds none."""
        raise NotImplementedError

    def uses_true_cfg(self, negative_prompt: str | None, call_kwargs: dict) -> bool:
        """Whether a call calls the transformer twice per step (cond, uncond): a negative prompt and a
        `true_cfg_scale` above 1 (guidance-distilled families never do)."""
        return False


class StockPipelineAdapter(PipelineAdapter):
    """One stock `DiffusionPipeline` family. Subclasses set the class attributes and implement `encode`."""

    #: Components only the encoding rank loads.
    text_components: tuple[str, ...]
    #: Light components the encoder needs and the pipeline's `__init__` reads too, so every rank loads them.
    shared_components: tuple[str, ...] = ()
    #: Call kwargs the adapter fixes, whatever the caller passed (see the subclass for why).
    call_overrides: dict = {}

    def for_pipeline(self, record: PipelineClass, family_classes: tuple[str, ...] = ()) -> StockPipelineAdapter:
        """This adapter driving another stock class on the same transformer: what that class requires beyond the
        family's own class and the denoiser's components is loaded with the text encoder, on the encoding rank only
        (Qwen-Image-Edit-Plus's `processor`)."""
        own = required_components(self.pipeline_cls())
        adapter = copy.copy(self)
        adapter.pipeline_class = record.name
        adapter.record, adapter.family_classes = record, family_classes
        adapter.text_components = self.text_components + tuple(
            name for name in required_components(adapter.pipeline_cls())
            if name not in own and name not in DENOISER_COMPONENTS and name not in self.shared_components
        )
        return adapter

    # -- loading -------------------------------------------------------------------------------------------

    def pipeline_cls(self):
        return getattr(diffusers, self.pipeline_class)

    def lora_loader(self):
        """The stock pipeline class itself: each family's pipeline mixes in its `*LoraLoaderMixin`."""
        return self.pipeline_cls()
    def call_parameters(self) -> frozenset[str]:
        return frozenset(inspect.signature(self.pipeline_cls().__call__).parameters)

    def load_encoder(self, checkpoint: Checkpoint, torch_dtype: torch.dtype | None):
        """The stock pipeline with only its text components, on CPU, where the text encoder runs once per prompt."""
        needed = self.text_components + self.shared_components
        skipped = {name: None for name in checkpoint.component_names() if name not in needed}
        return self.pipeline_cls().from_pretrained(checkpoint.path, dtype=torch_dtype, **skipped)

    def load_denoiser(self, checkpoint: Checkpoint, transformer, torch_dtype, device: torch.device, decodes: bool,
                      helps_decode: bool = False):
        """The stock pipeline around `transformer` with no text components; the VAE only where it `decodes` or
        `helps_decode`."""
        kwargs = {name: None for name in self.text_components}
        holds_vae = decodes or helps_decode
        if not holds_vae:
            kwargs["vae"] = checkpoint.meta("vae")
        pipe = self.pipeline_cls().from_pretrained(checkpoint.path, transformer=transformer, dtype=torch_dtype,
                                                   **kwargs)
        if holds_vae:
            pipe.vae.to(device)
        else:
            pipe.register_modules(vae=None)
        return pipe

    def load_stock(self, checkpoint: Checkpoint, **kwargs):
        return self.pipeline_cls().from_pretrained(checkpoint.path, **kwargs)

    def size_multiple(self, checkpoint: Checkpoint) -> int:
        """What height and width must be multiples of: the VAE's downsampling times the 2x2 latent packing."""
        return self.vae_scale_factor(checkpoint.config("vae")) * 2

    def vae_scale_factor(self, vae_config: dict) -> int:
        """As the pipeline's `__init__` computes it (FLUX.1 / FLUX.2: one halving per VAE block after the first)."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

    def decoders(self, pipe) -> list[torch.nn.Module]:
        return [pipe.vae.decoder] if getattr(pipe, "vae", None) is not None else []

    def vae(self, pipe) -> torch.nn.Module | None:
        return getattr(pipe, "vae", None)

    def uses_true_cfg(self, negative_prompt: str | None, call_kwargs: dict) -> bool:
        """The stock rule (`do_true_cfg = true_cfg_scale > 1 and has_neg_prompt`), with the pipeline's own default
        scale when the call does not set one (Qwen-Image: 4.0; Qwen-Image-2.1 and FLUX.1: 1.0)."""
        if negative_prompt is None or not self.takes_negative_prompt:
            return False
        default = inspect.signature(self.pipeline_cls().__call__).parameters["true_cfg_scale"].default
        return call_kwargs.get("true_cfg_scale", default) > 1

    # -- padding -------------------------------------------------------------------------------------------

    def pad(self, embeds: dict[str, torch.Tensor], buckets: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
        """Right-pad every `*prompt_embeds` with zeros to the smallest bucket *longer* than it, and its `*_mask` with
        zeros (masked out).

        Only families whose transformer ignores masked text positions set `buckets`, so padding never changes the
        image (tested), while every prompt of a bucket reuses one compiled graph. Strictly longer, so at least one
        position is always masked: stock pipelines drop an all-ones mask, which would be a second graph per bucket.
        """
        buckets = self.buckets if buckets is None else buckets
        if not buckets:
            return embeds
        padded = dict(embeds)
        for name, value in embeds.items():
            if not name.endswith("prompt_embeds"):
                continue
            mask_name = f"{name}_mask"
            mask = embeds.get(mask_name)
            if mask is None:
                mask = torch.ones(value.shape[:2], dtype=torch.long)
            length = value.shape[1]
            bucket = bucket_for(buckets, length, self.pipeline_class)
            padded[name] = F.pad(value, (0, 0, 0, bucket - length))
            padded[mask_name] = F.pad(mask, (0, bucket - length))
        return padded

    # -- the call ------------------------------------------------------------------------------------------

    def __call__(self, pipe, embeds: dict[str, torch.Tensor], *, generator, decodes: bool, check, buckets=(),
                 helps_decode: bool = False, **kwargs):
        """One stock pipeline call on the embeddings; the image where it `decodes`, else `None`.

        `check` (a `LatentAgreement`) compares the group's latents at the end of the steps it chooses. `buckets` is
        unused: `pad` already padded the embeddings. A rank that `helps_decode` runs the stock decode too (parallel
        VAE: its piece goes to the leader), as a tensor, the cheapest output to drop.
        """
        output_type = kwargs.pop("output_type", "pil")
        if not decodes:
            output_type = "pt" if helps_decode and output_type != "latent" else "latent"
        output = pipe(
            **embeds,
            generator=generator,
            output_type=output_type,
            callback_on_step_end=check.step_end,
            callback_on_step_end_tensor_inputs=["latents"],
            **{**kwargs, **self.call_overrides},
        )
        return output.images[0] if decodes else None


def transformer_class_name(cls: type) -> str:
    """The transformer class a stock pipeline class is built on, from its `__init__` signature ("" if none)."""
    parameter = inspect.signature(cls.__init__).parameters.get("transformer")
    if parameter is None:
        return ""
    annotation = parameter.annotation
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def required_components(cls: type) -> list[str]:
    """The components a stock pipeline class's `__init__` requires (those without a default)."""
    return [name for name, parameter in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and parameter.default is inspect.Parameter.empty
            and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)]


def bucket_for(buckets: tuple[int, ...], length: int, owner: str) -> int:
    """The smallest bucket longer than `length`, so at least one padded position is always masked out."""
    for bucket in buckets:
        if length < bucket:
            return bucket
    raise ValueError(
        f"A prompt encodes to {length} tokens, which needs a length bucket above {length}; the largest of {owner} is "
        f"{buckets[-1]}. Shorten the prompt, or pass larger `buckets` to `load_pipeline`."
    )
