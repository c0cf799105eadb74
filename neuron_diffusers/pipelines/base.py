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
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import diffusers
import torch
import torch.nn.functional as F

from ..compat import privates
from ..distributed import is_main_process
from ..media import read_png_text, save_png

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # annotations only: `checkpoint` reads this module's helpers
    from ..checkpoint import Checkpoint
    from ..families import PipelineClass

#: What every rank's pipeline holds around the sharded transformer; every other component is the encoder's.
DENOISER_COMPONENTS = ("transformer", "vae", "scheduler")

#: The largest seed: `torch.Generator.manual_seed` takes unsigned 64-bit integers.
MAX_SEED = 2**64 - 1
#: `math.exp` overflows above this: the largest `mu` an exponential timestep shift survives.
_LARGEST_EXPONENT = math.log(sys.float_info.max)


def check_text(text, what: str) -> None:
    """`text` is a string that can be tokenized and written into a PNG text chunk: no lone surrogate (what Python
    makes of bytes that are not UTF-8, or of a JSON escape such as "\\ud800"), no NUL character."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string, got {type(text).__name__} {text!r:.60}.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} holds a lone surrogate {text[error.start]!r} at character {error.start}, which is "
                         "not text (often bytes that are not UTF-8): fix the encoding of the prompt.") from None
    if "\x00" in text:
        raise ValueError(f"{what} holds a NUL character at character {text.index(chr(0))}: remove it (no tokenizer "
                         "needs it, and PNG text chunks cannot hold it).")


def check_seeds(seed, count: int, what: str) -> None:
    """Seeds `seed` .. `seed + count - 1` are all valid generator seeds (0 .. 2**64 - 1)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0 or seed + count - 1 > MAX_SEED:
        last = f" (and seed + {count - 1} for the last of {count} images)" if count > 1 else ""
        raise ValueError(f"{what} must be an integer from 0 to 2**64 - 1{last}, got {seed!r}: a generator seed is an "
                         "unsigned 64-bit number.")


def check_finite(value, what: str) -> None:
    """No NaN or infinity in `value` (a number, or numbers in lists, tuples and dicts): it would make every pixel NaN,
    a black image, without any error from the pipeline."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} is {value}: it must be a finite number (NaN or infinity turn every pixel into NaN, "
                         "a black image).")
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_finite(item, f"{what}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_finite(item, f"{what}[{key!r}]")


@dataclass(frozen=True)
class SizeLimits:
    """What height and width may be for one checkpoint: multiples of `multiple`; at most `max_side` per side (the
    positions the transformer can place) and `max_pixels` in all (what the pipeline's schedule survives), each with
    the reason in words."""

    multiple: int
    max_side: int | None = None
    side_reason: str = ""
    max_pixels: int | None = None
    pixels_reason: str = ""
    #: The fewest denoising steps the scheduler's schedule survives, and why (see `PipelineAdapter.min_steps`).
    min_steps: int = 1
    steps_reason: str = ""

    def check_steps(self, steps, where: str) -> None:
        """Raise a `ValueError` starting with `where` for a step count this checkpoint's scheduler cannot run."""
        if isinstance(steps, int) and not isinstance(steps, bool) and 0 < steps < self.min_steps:
            raise ValueError(f"{where}: {steps} denoising step(s) cannot run with this model's scheduler: "
                             f"{self.steps_reason}. Use {self.min_steps} steps or more.")

    def check(self, height, width, where: str, pixel_cap: int | None = None) -> None:
        """Raise a `ValueError` starting with `where` for a size this model cannot (or, above `pixel_cap`, should
        not) make."""
        for name, value in (("height", height), ("width", width)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}.")
        multiple = self.multiple
        if height % multiple or width % multiple:
            nearest = [value // multiple * multiple or multiple for value in (height, width)]
            raise ValueError(f"{where}: {height}x{width} is not allowed by this model: height and width must be "
                             f"multiples of {multiple} (e.g. {nearest[0]}x{nearest[1]}).")
        if self.max_side is not None and max(height, width) > self.max_side:
            raise ValueError(f"{where}: {height}x{width} is larger than this model can place: {self.side_reason}, so "
                             f"height and width must be at most {self.max_side}.")
        if self.max_pixels is not None and height * width > self.max_pixels:
            raise ValueError(f"{where}: {height}x{width} is larger than this model's pipeline can run: "
                             f"{self.pixels_reason}, so height x width must be at most {self.max_pixels} pixels.")
        if pixel_cap is not None and height * width > pixel_cap:
            raise ValueError(
                f"{where}: {height}x{width} is {height * width} pixels, above the cap of {pixel_cap} (--max-pixels): "
                "memory and time grow with the square of the pixel count. Raise --max-pixels to make it anyway."
            )


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
    #: Components that are further denoisers of the transformer's class, sharded like it (`Checkpoint.experts`).
    experts: tuple[str, ...] = ()
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
    #: How the text length becomes a multiple of the context-parallel degree (`parallel/context.runner_mode`):
    #: "fixed" (the pipeline pads to `max_sequence_length` itself, no mask), "masked" (padding with masked
    #: positions: buckets rounded to multiples of the degree).
    cp_text: str = "masked"
    #: Whether attention is block-causal (Qwen-Image-2.1): context parallelism is then Ulysses only, and without
    #: buckets the text is not padded at all (diffusers' `ulysses_anything`).
    cp_block_causal: bool = False
    #: Whether one stock call can make several images (`generate(batch_size=...)`, `batching.py`): the stock call
    #: takes a batch of embeddings and a list of generators. None: why not, in words, for the error.
    batch_refusal: str | None = ("this adapter's call makes one image at a time; generate with batch_size=1")
    #: Why its batches cannot run under context parallelism (None: nothing known against it).
    cp_batch_refusal: str | None = None

    #: Whether the stock call gets the prompt strings and encodes them itself (the generic adapter), with the group
    #: leader's encoder answering its `encode_prompt` where `leader_encodes`, else every rank encoding.
    prompt_in_call: bool = False
    leader_encodes: bool = True

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

    def batch_key(self, embeds: dict[str, torch.Tensor]):
        """Which rows may share a stock call (`batching.stack_calls`): rows with equal keys. None for every row by
        default: a shorter text right-padded with masked positions gives its image unchanged."""
        return None

    def pad_encoded(self, encoded, buckets: tuple[int, ...]):
        """What the pipeline's own `encode_prompt` returned inside a call with image inputs (the text encoder reads
        the images), padded like `pad` pads the text-only path's embeddings (unchanged by default)."""
        return encoded

    def size_multiple(self, checkpoint: Checkpoint) -> int:
        """What height and width must be multiples of."""
        raise NotImplementedError

    def size_limits(self, checkpoint: Checkpoint) -> SizeLimits:
        """The sizes this checkpoint can make (read from its configs, no weights)."""
        return SizeLimits(self.size_multiple(checkpoint), *self.max_side(checkpoint), *self.max_pixels(checkpoint),
                          *self.min_steps(checkpoint))

    def min_steps(self, checkpoint: Checkpoint) -> tuple[int, str]:
        """The fewest steps the scheduler survives, and why. A flow-matching schedule stretched to end at
        `shift_terminal` (Qwen-Image's 0.02) divides by the distance of its last sigma from 1, which is 0 with one
        step: the latents would be NaN, found only after the whole call ran."""
        has_config = (checkpoint.path / "scheduler" / "scheduler_config.json").is_file()
        terminal = checkpoint.config("scheduler", "scheduler_config.json").get("shift_terminal") if has_config else None
        if terminal:
            return 2, (f"its sigmas are stretched to end at shift_terminal={terminal:g}, which one step turns into "
                       "0 / 0 (NaN latents)")
        return 1, ""

    def max_side(self, checkpoint: Checkpoint) -> tuple[int | None, str]:
        """The largest height or width whose positions the transformer can encode, and why (None: no table limits
        it; FLUX.1, FLUX.2 and MiniMax-H3 compute their rotary angles for any position)."""
        return None, ""

    def max_pixels(self, checkpoint: Checkpoint) -> tuple[int | None, str]:
        """The largest height x width the pipeline's sequence-length schedule survives, and why (None: no limit)."""
        return None, ""

    #: The `output_type` values a call may pass (empty: the adapter's output has no such option).
    output_types: tuple[str, ...] = ()

    def check_call_kwargs(self, kwargs: dict) -> None:
        """Refuse, before anything runs, call kwargs the pipeline would reject on some ranks only (or not at all):
        unknown names, an unknown `output_type`, NaN or infinite numbers."""
        accepted = self.call_parameters()  # empty for a modular pipeline: it takes any keyword
        unknown = sorted(set(kwargs) - accepted) if accepted else []
        if unknown:
            raise ValueError(f"{self.pipeline_class} takes no {', '.join(map(repr, unknown))}: its call accepts "
                             f"{', '.join(sorted(accepted - {'self', 'kwargs'}))}.")
        if "output_type" in kwargs and kwargs["output_type"] not in self.output_types:
            raise ValueError(f"output_type={kwargs['output_type']!r} is not an output of {self.pipeline_class}: "
                             + (f"choose one of {', '.join(map(repr, self.output_types))}." if self.output_types
                                else "drop it."))
        for name, value in kwargs.items():
            check_finite(value, name)

    def read_settings(self, path) -> dict[str, str] | None:
        """The settings stored inside an output this adapter saved, or None when the file is not a complete output
        (missing, empty, truncated, garbage, or a folder)."""
        return read_png_text(path)

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

    def split_lengths(self, checkpoint: Checkpoint, call_kwargs: dict) -> dict[str, int]:
        """The sequence lengths context parallelism splits at this call that no padding of ours rounds up (so they
        must be multiples of its degree), by name; the runner checks them before a step runs."""
        return {}

    def configure_context_parallel(self, pipe, multiple: int) -> None:
        """Pad what this family pads to multiples of `multiple` (the context-parallel degree) from now on."""


class StockPipelineAdapter(PipelineAdapter):
    """One stock `DiffusionPipeline` family. Subclasses set the class attributes and implement `encode`."""

    #: Components only the encoding rank loads.
    text_components: tuple[str, ...]
    #: Light components the encoder needs and the pipeline's `__init__` reads too, so every rank loads them.
    shared_components: tuple[str, ...] = ()
    #: Call kwargs the adapter fixes, whatever the caller passed (see the subclass for why).
    call_overrides: dict = {}
    #: Stock calls take a batch of embeddings and one generator per image (`randn_tensor` draws each row alone).
    batch_refusal = None

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
        # The experts (`transformer_2`) are sharded and registered by the loader, never loaded whole here.
        kwargs = {name: None for name in (*self.text_components, *checkpoint.experts)}
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

    output_types = ("pil", "np", "pt", "latent")

    def size_multiple(self, checkpoint: Checkpoint) -> int:
        """What height and width must be multiples of: the VAE's downsampling times the 2x2 latent packing."""
        return self.vae_scale_factor(checkpoint.config("vae")) * 2

    def pixels_per_token(self, checkpoint: Checkpoint) -> int:
        """The side of the pixel square one latent token covers (the 2x2 packing included)."""
        return self.size_multiple(checkpoint)

    def dynamic_shift_config(self, checkpoint: Checkpoint):
        """The scheduler's full config (its class fills in the defaults) when it shifts timesteps by `exp(mu)`."""
        scheduler_class = getattr(diffusers, checkpoint.index["scheduler"][1])
        config = scheduler_class.from_config(checkpoint.config("scheduler", "scheduler_config.json")).config
        if not config.get("use_dynamic_shifting") or config.get("time_shift_type", "exponential") != "exponential":
            return None
        return config

    def own_module(self) -> str:
        """The module of the family's own text-to-image class: its image classes (img2img, inpainting, Kontext, edits)
        shift timesteps with a copy of its function (diffusers' "Copied from"), so the limits found there are theirs."""
        return getattr(diffusers, type(self).pipeline_class).__module__

    def shift_mu(self, checkpoint: Checkpoint) -> Callable[[int], float] | None:
        """`mu` as a function of the image's latent tokens, computed by the stock pipeline module's own
        `calculate_shift` from the scheduler's config; None when the scheduler does not shift by `exp(mu)`."""
        config = self.dynamic_shift_config(checkpoint)
        if config is None:
            return None
        calculate_shift = privates.internal(self.own_module(), "calculate_shift")
        names = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
        return lambda tokens: calculate_shift(tokens, *(config[name] for name in names))

    def max_pixels(self, checkpoint: Checkpoint) -> tuple[int | None, str]:
        """Where the timestep shift `exp(mu)` overflows: `mu` grows linearly with the latent tokens, and past that
        point the scheduler fails with `OverflowError: math range error` after the model has loaded."""
        mu = self.shift_mu(checkpoint)
        if mu is None:
            return None, ""
        low, high = 1, 2**48  # the largest token count whose mu is still representable, by bisection
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if mu(middle) <= _LARGEST_EXPONENT else (low, middle - 1)
        side = self.pixels_per_token(checkpoint)
        return low * side * side, (f"its scheduler shifts the timesteps by exp(mu), with mu growing with the latent "
                                   f"tokens ({side}x{side} pixels each), and exp(mu) overflows above {low} tokens")

    def vae_scale_factor(self, vae_config: dict) -> int:
        """As the pipeline's `__init__` computes it (FLUX.1 / FLUX.2: one halving per VAE block after the first)."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

    def decoders(self, pipe) -> list[torch.nn.Module]:
        return [pipe.vae.decoder] if getattr(pipe, "vae", None) is not None else []

    def split_lengths(self, checkpoint: Checkpoint, call_kwargs: dict) -> dict[str, int]:
        """The image tokens (2x2-packed latents: height / multiple x width / multiple) when the call sets the size,
        and a text the pipeline pads to `max_sequence_length` itself (`cp_text = "fixed"`)."""
        lengths = {}
        if "height" in call_kwargs and "width" in call_kwargs:  # else the split check at the first forward speaks
            multiple = self.size_multiple(checkpoint)
            lengths["image tokens"] = (call_kwargs["height"] // multiple) * (call_kwargs["width"] // multiple)
        if self.cp_text == "fixed":
            default = inspect.signature(self.pipeline_cls().__call__).parameters["max_sequence_length"].default
            lengths["text tokens (max_sequence_length)"] = call_kwargs.get("max_sequence_length", default)
        return lengths

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
                mask = torch.ones(value.shape[:2], dtype=torch.long, device=value.device)
            length = value.shape[1]
            bucket = bucket_for(buckets, length, self.pipeline_class)
            padded[name] = F.pad(value, (0, 0, 0, bucket - length))
            padded[mask_name] = F.pad(mask, (0, bucket - length))
        return padded

    # -- the call ------------------------------------------------------------------------------------------

    def __call__(self, pipe, embeds: dict[str, torch.Tensor], *, generator, decodes: bool, check, buckets=(),
                 helps_decode: bool = False, **kwargs):
        """One stock pipeline call on the embeddings; the image where it `decodes`, else `None` (a batch, with a list
        of generators: the list of its images).

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
        if not decodes:
            return None
        return [output.images[i] for i in range(len(generator))] if isinstance(generator, list) else output.images[0]


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
    """The smallest bucket longer than `length`, so at least one padded position is always masked out.

    Past the largest bucket, the next multiple of a quarter of it: whatever stock accepts must run (an input image's
    vision tokens count against Qwen-Image-2.1's text buckets), while the lengths still fall on a few static shapes.
    Each such length is a shape no warm-up saw, so a compiled pipeline compiles one more graph for it (logged once).
    """
    for bucket in buckets:
        if length < bucket:
            return bucket
    step = max(1, buckets[-1] // 4)
    bucket = (length // step + 1) * step
    if (owner, bucket) not in _OVERFLOW_LOGGED:
        _OVERFLOW_LOGGED.add((owner, bucket))
        log = logger.warning if is_main_process() else logger.debug  # rank 0 speaks for the group
        log("%s: an encoding of %d tokens is longer than the largest length bucket (%d); it is padded to "
                       "%d, a static length of its own (a compiled pipeline compiles a graph for it once). Pass larger "
                       "`buckets` to `load_pipeline` to warm it up.", owner, length, buckets[-1], bucket)
    return bucket


#: (pipeline class, overflow length) pairs already logged: one line per new shape, not one per prompt.
_OVERFLOW_LOGGED: set[tuple[str, int]] = set()
