"""The bodies of `POST /v1/images/generations` and `/v1/images/edits` and their checks: every refusal happens here,
on rank 0, before the request queues, with the same rules (and the same messages) as a `.jsonl` line of the
`generate` job.

A body becomes the job's own `Request`s (one per image, seeds `seed .. seed + n - 1`), so an image the server makes
is the image the job makes for the same settings and input images, and carries the same text chunks (settings key
included: an uploaded image counts by the sha256 of its bytes, as an input file of the job does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from dataclasses import dataclass
from typing import Annotated, Literal

import PIL.Image
from pydantic import BaseModel, ConfigDict, Field

from ..checkpoint import Checkpoint
from ..job import Request, batch_key, build_requests, call_kwargs, output_key, settings_text
from ..launch import check_guidance
from ..media import InputImage
from ..pipelines.base import MAX_SEED, SizeLimits
from ..pipelines.image_inputs import check_image_kwargs
from ..runner import check_context_parallel_call
from .replica import open_image

#: The most images one request may ask for (OpenAI's own limit for `n`).
MAX_IMAGES = 10
#: Longer prompts are refused before any tokenizer sees them (each family's buckets cap the tokens anyway).
MAX_PROMPT_CHARS = 20_000

#: The most LoRAs one request may combine.
MAX_LORAS = 8
#: The most bytes one uploaded image (or mask) may have.
MAX_UPLOAD_BYTES = 32 * 1024 * 1024

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class LoraChoice(BaseModel):
    """One of the server's `--lora NAME=SOURCE[:SCALE]` by name, with its weight (default: the server's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=200)
    scale: FiniteFloat | None = None


class ImageRequest(BaseModel):
    """OpenAI's image-generation fields, plus the pipeline settings a diffusion model needs. Unknown fields and
    values of the wrong JSON type are refused (strict): a typo must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    #: Accepted because OpenAI's clients send it; the server serves the one model it was started with.
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    size: str | None = Field(None, pattern=r"^[0-9]{1,6}x[0-9]{1,6}$", description="WIDTHxHEIGHT, e.g. 1024x768")
    response_format: Literal["b64_json", "url"] = "b64_json"
    user: str | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: FiniteFloat | None = None
    true_cfg_scale: FiniteFloat | None = None
    #: Extension: LoRAs to apply, among the ones the server offers (fused per request, group-consistently).
    loras: list[LoraChoice] = Field(default_factory=list, max_length=MAX_LORAS)


class EditRequest(ImageRequest):
    """The text fields of OpenAI's `POST /v1/images/edits` form (its `image` and `mask` are files), plus img2img /
    inpainting `strength`."""

    strength: FiniteFloat | None = None


@dataclass(frozen=True)
class Upload:
    """One uploaded file of an edits form: the name the client gave it and its bytes."""

    name: str
    data: bytes


@dataclass(frozen=True)
class ServeConfig:
    """What the server checks requests against (all of it known before the process group starts)."""

    checkpoint: Checkpoint
    limits: SizeLimits
    default_size: tuple[int, int]  # (height, width)
    default_steps: int
    max_steps: int
    max_pixels: int
    tp: int
    replicas: int
    cfg: int
    dtype: str
    #: With `--compile`: the warmed (height, width) sizes, the only ones served (no request may recompile).
    sizes: tuple[tuple[int, int], ...] | None = None
    ulysses: int = 1
    ring: int = 1
    #: Context parallelism with static splits: a size whose image tokens do not split is refused.
    cp_split: bool = False
    #: `--lora NAME=SOURCE[:SCALE]`: name -> {"source", "scale", "sha256"} (read and checked at start).
    loras: dict = dataclasses.field(default_factory=dict)
    #: `--cache` as given (recorded with every image, and in its settings key) and `--plan`'s name.
    cache: str | None = None
    plan: str = "default"
    #: The checked `launch.LaunchSpec` every rank loads from (None in a config built by hand).
    launch: object = dataclasses.field(default=None, repr=False, compare=False)
    #: `--max-batch`: the most images one stock call makes for compatible queued requests (1: one request a call).
    max_batch: int = 1
    def check_split(self, height: int, width: int, where: str) -> None:
        """Under context parallelism without *_anything modes: refuse a size whose tokens `generate` could not split
        (the message names sizes nearby that do)."""
        if self.cp_split:
            try:
                check_context_parallel_call(self.checkpoint.adapter, self.checkpoint,
                                            {"height": height, "width": width}, self.ulysses * self.ring)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None


@dataclass(frozen=True)
class Work:
    """One accepted request: the job's `Request` per image and what a replica needs to make them."""

    requests: list[Request]
    response_format: str
    #: The PNG text chunks of each image, made on rank 0 and written by the replica's leader.
    texts: list[dict]
    #: The stock pipeline call's kwargs (size, steps, guidance, strength), the same for every image of the request.
    kwargs: dict
    #: The input images' and the mask's bytes (decoded again on every rank of the replica).
    images: tuple[bytes, ...] = ()
    mask: bytes | None = None
    #: The LoRAs to fuse for it, `(source, scale)` (none: the base weights).
    loras: tuple[tuple[str, float], ...] = ()
    #: Requests with equal keys may share one batched stock call (`--max-batch`); None: made alone.
    batch_key: tuple | None = None

    def task(self) -> dict:
        """What travels to the replica: the arguments of one `generate` call, the same on every rank."""
        first = self.requests[0]
        return {"prompts": [r.prompt for r in self.requests], "seed": first.seed,
                "negative_prompt": first.negative_prompt, "kwargs": self.kwargs, "texts": self.texts,
                "images": self.images, "mask": self.mask, "loras": self.loras}


def _read_upload(upload: Upload, what: str) -> tuple[PIL.Image.Image, InputImage]:
    """An uploaded file decoded whole (refused clearly if it is not an image), and its record for the outputs."""
    if len(upload.data) > MAX_UPLOAD_BYTES:
        raise ValueError(f"{what} {upload.name!r} has {len(upload.data)} bytes, above this server's limit of "
                         f"{MAX_UPLOAD_BYTES}: send a smaller file.")
    try:
        image = open_image(upload.data)
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as error:
        raise ValueError(f"{what} {upload.name!r} is not an image PIL can read ({error}): send a PNG, JPEG or WebP "
                         "file.") from None
    return image, InputImage(upload.name, hashlib.sha256(upload.data).hexdigest(), *image.size)


def plan_work(body: ImageRequest, config: ServeConfig, images: tuple[Upload, ...] = (),
              mask: Upload | None = None) -> Work:
    """Check `body` (and an edit's uploaded `images` and `mask`) against the model and the server's limits; raise a
    `ValueError` saying what and how to fix."""
    adapter = config.checkpoint.adapter
    height, width = config.default_size
    if body.size is not None:
        width, height = (int(side) for side in body.size.split("x"))
    if config.sizes is not None and (height, width) not in config.sizes:
        allowed = ", ".join(f"{w}x{h}" for h, w in config.sizes)
        raise ValueError(f"size {width}x{height} is not served: the model was compiled for {allowed} only (a new "
                         "size would recompile it mid-request). Ask for one of those, or restart the server with "
                         "--sizes including it.")
    config.check_split(height, width, f"size {width}x{height}")
    steps = config.default_steps if body.num_inference_steps is None else body.num_inference_steps
    if steps > config.max_steps:
        raise ValueError(f"num_inference_steps {steps} is above this server's limit of {config.max_steps} "
                         "(--max-steps).")
    entry = {"prompt": body.prompt, "height": height, "width": width, "steps": steps, "_where": "request"}
    if body.negative_prompt is not None:
        entry["negative_prompt"] = body.negative_prompt
    entry.update(_guidance(body, adapter))
    seed = secrets.randbelow(2**32) if body.seed is None else body.seed
    requests = build_requests([entry] * body.n, seed=seed, height=height, width=width, steps=steps, guidance=None,
                              negative_prompt=None, limits=config.limits, adapter=adapter,
                              max_pixels=config.max_pixels)
    if images and config.sizes is not None:
        raise ValueError("this server is compiled (--compile) for text-to-image at its --sizes only: an input image "
                         "would change the compiled shapes mid-request. Serve edits from a server without --compile.")
    decoded = [_read_upload(upload, "image") for upload in images]
    mask_image, mask_record = _read_upload(mask, "mask") if mask is not None else (None, None)
    strength = getattr(body, "strength", None)
    try:
        pictures = [image for image, _ in decoded]
        check_image_kwargs(adapter, (pictures[0] if len(pictures) == 1 else pictures) or None, mask_image, strength)
    except (TypeError, ValueError) as error:
        hint = "" if images else " (Over HTTP: send the image to POST /v1/images/edits.)"
        raise ValueError(f"{error}{hint}") from None
    requests = [dataclasses.replace(r, images=tuple(record for _, record in decoded), mask=mask_record,
                                    strength=strength) for r in requests]
    cfg = 2 if config.cfg > 1 and adapter.uses_true_cfg(requests[0].negative_prompt,
                                                         call_kwargs(requests[0], adapter)) else 1
    loras = _loras(body.loras, config)
    texts = [settings_text(r, model=config.checkpoint.source, pipeline=config.checkpoint.pipeline_class, tp=config.tp,
                           dp=config.replicas, cfg=cfg, dtype=config.dtype, loras=loras,
                           key=output_key(r, config.checkpoint, config.dtype, config.cache, loras,
                                          getattr(config.launch, "quantize", None)),
                           cache=config.cache, ulysses=config.ulysses, ring=config.ring, plan=config.plan)
             for r in requests]
    kwargs = call_kwargs(requests[0], adapter) | ({} if strength is None else {"strength": strength})
    chosen = tuple((lora["source"], lora["scale"]) for lora in loras)
    # The job's rule (`job.batch_key`: size, steps, guidance, CFG pairing, negative prompt or none, the kind and size
    # of image inputs), plus the LoRA set, which the job fixes for all its requests.
    key = batch_key((requests[0], cfg > 1), adapter)
    return Work(requests, body.response_format, texts, kwargs, tuple(upload.data for upload in images),
                None if mask is None else mask.data, chosen, None if key is None else (key, chosen))


def _loras(choices: list[LoraChoice], config: ServeConfig) -> list[dict]:
    """The records (source, scale, sha256: what the job's outputs record) of the LoRAs a request chose."""
    records = []
    for choice in choices:
        if choice.name not in config.loras:
            offered = ", ".join(sorted(config.loras)) or "none (start it with --lora NAME=SOURCE[:SCALE])"
            raise ValueError(f"unknown LoRA {choice.name!r}: this server offers {offered}.")
        record = config.loras[choice.name]
        records.append({**record, "scale": record["scale"] if choice.scale is None else choice.scale})
    return records


def _guidance(body: ImageRequest, adapter) -> dict:
    """The job's per-line `guidance` / `true_cfg_scale` for this body, accepted by the job's own rule
    (`launch.check_guidance`, the body's field names in its messages): `guidance_scale` is the job's `--guidance`,
    whatever the family's `guidance_kwarg` is (FLUX.1: guidance_scale; Qwen-Image: true_cfg_scale), and
    `true_cfg_scale` its `--true-cfg-scale` (FLUX.1's true CFG; where guidance_scale already sets it, Qwen-Image,
    another name for guidance_scale)."""
    guidance, true_cfg = check_guidance(adapter, {"negative_prompt": body.negative_prompt,
                                                  "guidance_scale": body.guidance_scale,
                                                  "true_cfg_scale": body.true_cfg_scale}, where="request: ")
    entry = {}
    if guidance is not None:
        entry["guidance"] = guidance
    if true_cfg is not None:
        entry["true_cfg_scale"] = true_cfg
    return entry
