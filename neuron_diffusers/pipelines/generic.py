"""Any stock pipeline whose transformer the drafter plans: one adapter, read from the class's own signatures.

A checkpoint folder whose pipeline no family runs resolves to a `DraftedFamily` (`drafted.py`): its plan is drafted
from the transformer's module tree on the meta device, and a class whose draft is empty, fails `plan check` or cannot
split at the asked TP degree is refused before any weight is read.

The adapter copies nothing of the pipeline. The stock call gets the prompt strings and runs as in one process; where
the class has an `encode_prompt`, that method is shadowed for the call by one that runs the group leader's CPU
encoder (the only rank holding text encoders) and broadcasts whatever it returns, so every rank's stock code takes the
same embeddings whatever their names or order. A class without `encode_prompt` loads its text encoders on every
rank and each encodes. Noise, the latent agreement check, decode on the leader (parallel VAE where the VAE splits)
and the output (images, or video frames written as MP4) follow the five families.

What cannot be read from a class is data here (`LATENT_PACKING`), not code.
"""

from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..compat import privates
from ..families import Family, PipelineClass
from ..media import VideoWithAudio, read_video_text, save_video
from .base import DENOISER_COMPONENTS, StockPipelineAdapter
from .image_inputs import Group

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

#: Pipelines that pack latent patches themselves (the factor per side) although their transformer's config says
#: `patch_size=1`: the size multiple is the VAE's scale times this. Others: the transformer's `patch_size`.
LATENT_PACKING = {"ChromaPipeline": 2}

#: Frames per second of a video when the class's call has no `frame_rate` / `fps` default.
DEFAULT_FPS = 24


@dataclass(frozen=True)
class DraftedFamily(Family):
    """The family record of one stock pipeline class run on a drafted plan (not in the registry: one per class)."""

    transformer: str = ""
    drafted: dict = field(default_factory=dict, hash=False, compare=False)
    degrees: tuple[int, ...] = ()
    #: The plan is the one `plan draft --all` verified at TP=2 (shipped in the package), not a fresh draft.
    verified: bool = False
    #: Context parallelism: the drafted CP plan verified at tp=2 x ulysses=2 for the class (None: diffusers' own
    #: `_cp_plan`, where that one was verified), whether attention that bypasses diffusers' dispatch is routed
    #: through it (`compat/attention_route.py`, as in the proof), and why the class cannot run it (None: it can).
    context_plan: dict | None = field(default=None, hash=False, compare=False)
    routes_attention: bool = False
    cp_refusal: str | None = None

    @property
    def plan_module(self):
        """The drafted plans where a family's `tp_plans/<name>.py` would be: `PLAN`, `CP_PLAN` and `MODEL_CLASS`."""
        return SimpleNamespace(PLAN=self.drafted, CP_PLAN=self.context_plan, MODEL_CLASS=self.transformer)

    def check_context_parallel(self) -> None:
        if self.cp_refusal is not None:
            raise ValueError(
                f"{self.display_name} cannot run with context parallelism (--ulysses / --ring): no context-parallel "
                f"plan for {self.transformer} matched one process at tp=2 x ulysses=2 in the coverage table "
                f"(docs/coverage.md): {self.cp_refusal}. Run it with tensor parallelism alone (--tp).")

    @property
    def has_tiny(self) -> bool:
        return False


@contextmanager
def _shadowed(obj, name: str, value):
    """`obj.name` is `value` inside the block; the instance attribute is removed after it (the method returns)."""
    setattr(obj, name, value)
    try:
        yield
    finally:
        delattr(obj, name)


@contextmanager
def shared_encoding(pipe, encoder, group, device: torch.device):
    """For one stock call: `pipe.encode_prompt` runs the group leader's CPU `encoder` on the arguments the stock
    call passes and gives every rank of `group` what it returned (tensors and None, broadcast in order); a failure
    on the leader is raised on every rank. Every rank reaches each `encode_prompt` in the same order, since the same
    stock code runs everywhere."""
    text = Group(group, None, device)

    def encode_prompt(*args, **kwargs):
        return text.share(lambda: encoder.encode_prompt(*args, **{**kwargs, "device": torch.device("cpu")}))

    with _shadowed(pipe, "encode_prompt", encode_prompt):
        yield


def _frames_tensor(frames) -> torch.Tensor:
    """A video as the stock call returns it (PIL frames, an (F, H, W, 3) array, an (F, 3, H, W) tensor) as an
    (F, 3, H, W) float tensor in [0, 1]."""
    if isinstance(frames, torch.Tensor):
        return frames.float().cpu()
    if isinstance(frames, np.ndarray):
        return torch.from_numpy(frames).float().permute(0, 3, 1, 2)
    return torch.stack([torch.from_numpy(np.asarray(f.convert("RGB"))).permute(2, 0, 1) for f in frames]) / 255.0


class GenericAdapter(StockPipelineAdapter):
    """One stock pipeline class on a drafted plan; every attribute is read from the class in `for_pipeline`."""

    pipeline_class = ""
    prompt_in_call = True
    batch_refusal = ("a drafted pipeline encodes its prompt inside the call, one image a call; generate with "
                     "batch_size=1")
    #: Whether the class has an `encode_prompt` (then only the leader holds text encoders); set per class.
    leader_encodes = True
    video = False
    fps = DEFAULT_FPS

    def for_pipeline(self, record: PipelineClass, family_classes: tuple[str, ...] = ()) -> GenericAdapter:
        adapter = copy.copy(self)
        adapter.pipeline_class, adapter.record, adapter.family_classes = record.name, record, family_classes
        cls = adapter.pipeline_cls()
        call = inspect.signature(cls.__call__).parameters
        adapter.leader_encodes = callable(getattr(cls, "encode_prompt", None))
        components = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
        adapter.text_components = tuple(n for n in components if n not in DENOISER_COMPONENTS
                                        ) if adapter.leader_encodes else ()
        adapter.takes_negative_prompt = "negative_prompt" in call
        adapter.guidance_kwarg = "guidance_scale" if "guidance_scale" in call else None
        adapter.video = "num_frames" in call
        adapter.output_suffix = ".mp4" if adapter.video else ".png"
        rate = next((call[n].default for n in ("frame_rate", "fps") if n in call), None)
        adapter.fps = rate if isinstance(rate, (int, float)) and rate > 0 else DEFAULT_FPS
        return adapter

    @property
    def own_class(self) -> bool:
        """A class that takes no input image is its checkpoint's text-to-image class."""
        return "image" not in self.call_parameters()

    def load_encoder(self, checkpoint: Checkpoint, torch_dtype: torch.dtype | None):
        return super().load_encoder(checkpoint, torch_dtype) if self.leader_encodes else None

    def check_call_kwargs(self, kwargs: dict) -> None:
        many = sorted(name for name in kwargs if name.startswith("num_") and name.endswith("_per_prompt"))
        if many:
            raise ValueError(f"`generate` does not take `{many[0]}`: repeat the prompt; each image gets its own seed "
                             "(seed + index).")
        super().check_call_kwargs(kwargs)

    def uses_true_cfg(self, negative_prompt: str | None, call_kwargs: dict) -> bool:
        """Never split over a CFG pair: whether a class calls its transformer once per branch under named
        `cache_context`s is not known, so a pair runs such requests as two data-parallel groups."""
        return False

    def vae_scale_factor(self, vae_config: dict) -> int:
        """The VAE's spatial compression: its own `spatial_compression_ratio` where it has one (video VAEs), else one
        halving per block after the first."""
        ratio = vae_config.get("spatial_compression_ratio")
        return ratio if ratio else super().vae_scale_factor(vae_config)

    def size_multiple(self, checkpoint: Checkpoint) -> int:
        """The VAE's scale times the latent patch (the transformer's `patch_size`, or `LATENT_PACKING`)."""
        vae = checkpoint.meta("vae")
        scale = getattr(vae, "spatial_compression_ratio", None) or self.vae_scale_factor(checkpoint.config("vae"))
        patch = checkpoint.config("transformer").get("patch_size") or 1
        patch = LATENT_PACKING.get(self.pipeline_class, patch if isinstance(patch, int) else max(patch))
        return int(scale) * patch

    def own_module(self) -> str:
        return self.pipeline_cls().__module__

    def shift_mu(self, checkpoint: Checkpoint):
        """`mu` where the class's module has a `calculate_shift` the compat layer lists; else no pixel limit."""
        if (self.own_module(), "calculate_shift") not in privates.LAZY_PRIVATE_NAMES:
            return None
        return super().shift_mu(checkpoint)

    def __call__(self, pipe, embeds: dict, *, generator, decodes: bool, check, buckets=(),
                 helps_decode: bool = False, **kwargs):
        """One stock call on the prompt strings; the image (or the video's frames) where it `decodes`."""
        output_type = kwargs.pop("output_type", "pil")
        if not decodes:
            output_type = "pt" if helps_decode and output_type != "latent" else "latent"
        output = pipe(**embeds, generator=generator, output_type=output_type, callback_on_step_end=check.step_end,
                      callback_on_step_end_tensor_inputs=["latents"], **kwargs)
        made = output.frames if self.video else output.images
        return made[0] if decodes else None

    def save(self, output, path, text: dict[str, str]) -> list:
        if not self.video:
            return super().save(output, path, text)
        return save_video(VideoWithAudio(_frames_tensor(output), float(self.fps)), path, text=text)

    def read_settings(self, path) -> dict[str, str] | None:
        return read_video_text(path, audio=False) if self.video else super().read_settings(path)
