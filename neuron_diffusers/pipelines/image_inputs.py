"""Image inputs of stock pipelines under TP: one rank VAE-encodes and reads the image with the prompt, the group
gets the result by broadcast, inside the stock call.

Only the TP leader holds a VAE and the text encoder (`base.py`), but image-conditioned pipelines (FLUX.1 Kontext,
img2img and inpainting, FLUX.2 with reference images, Qwen-Image-Edit-Plus, Qwen-Image-2.1 with an image) call
`self.vae.encode` on every rank, and some call `self.encode_prompt(image=...)` with images they resized
themselves. Rather than redo any of that outside the pipeline (which would copy its resizing and latent packing,
one copy per class), for the length of one call:

- `pipe.vae` is a `GroupVAE`. Its `encode` runs the real VAE on one rank and broadcasts the posterior's
  parameters (mean and log-variance); every rank rebuilds the same posterior, so stock `retrieve_latents` runs on
  every rank: `argmax` (Kontext, Edit-Plus, FLUX.2, Qwen-Image-2.1) takes its mean, `sample` (img2img,
  inpainting) draws from it with the rank's own CPU generator, seeded alike on every rank, so the noise drawn
  after it stays equal. Everything else (config, FLUX.2's batch-norm statistics, decode on the leader) is the
  rank's VAE: the real one on the leader, `vae_without_coders` elsewhere.
- For a class whose `encode_prompt` takes the image, `pipe.encode_prompt` runs the leader's CPU encoder on the
  arguments the stock call passes (the condition images it resized) and broadcasts what it returns.

Why one rank encodes rather than every rank: the wall time is the same (the others would encode at the same
moment; the broadcast is a few MB), but every rank would hold the encoder's weights and its activations at the
input's resolution, the per-rank peak TP exists to cut, and equal latents would rest on bitwise-deterministic
convolutions on every device. A broadcast makes them equal by construction. On a CFG pair one rank encodes for
both TP groups (two hops: its TP group, then each rank's partner), so the two branches see the same latents too;
text is shared within each TP group only, since each group's pipeline encodes the prompts in its own order
(`cfg.swap_branches`).

With parallel VAE (`parallel/vae.py`) on for the call, every rank of the image group (TP, or TP x ring x Ulysses)
holds the VAE: all of them run `encode` together, each on a band of the image, and each gets the whole posterior
(equal on every rank by construction: the bands are all-gathered); on a CFG pair the group of CFG rank 0 encodes
and each of its ranks sends the result to its partner.

Every collective sits where the stock code calls `vae.encode` / `encode_prompt`, which every rank reaches in the
same order (the same stock code runs everywhere); a failure on the encoding rank is broadcast and raised on every
rank; and what each rank feeds the VAE is compared across the group first (one 3-number all-gather), so a rank
given another image fails loudly instead of blending.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import diffusers
import torch
import torch.distributed as dist
from PIL import Image
from safetensors import safe_open

from ..compat.vae import posterior_parameters, vae_encode_output
from ..consistency import checksum

#: Call kwargs a stock image-conditioned call takes that `generate` checks and passes on.
IMAGE_KWARGS = ("image", "mask_image", "strength")
_CODERS = ("encoder.", "decoder.")


class ImageInputsDivergedError(RuntimeError):
    """Ranks of a group were given different image inputs for the same request."""


class LeaderFailedError(RuntimeError):
    """The rank that computes for the group failed at a step whose result the other ranks wait for."""


@dataclass(frozen=True)
class Group:
    """The ranks that share one computation: a TP group, and with `pair` (a CFG pair's group) its partner group
    too. The source is the TP leader of CFG rank 0; with `tp_computes`, every rank of CFG rank 0's TP group (the
    computation is itself split over the TP group, and gives each of them the whole result: parallel VAE)."""

    tp: object
    pair: object | None
    device: torch.device
    tp_computes: bool = False

    def _hops(self) -> list:
        """The groups this rank takes part in, in order: its TP group (CFG rank 0 only; none when `tp_computes`),
        then its pair."""
        first = self.pair is None or dist.get_group_rank(self.pair, dist.get_rank()) == 0
        hops = [self.tp] if first and not self.tp_computes else []
        return [g for g in (*hops, self.pair) if g is not None and dist.get_world_size(g) > 1]

    @property
    def is_source(self) -> bool:
        in_pair = self.pair is None or dist.get_group_rank(self.pair, dist.get_rank()) == 0
        return in_pair and (self.tp_computes or dist.get_group_rank(self.tp, dist.get_rank()) == 0)

    def share(self, compute):
        """`compute()` on the source rank(s), its result (a tensor, None, or a tuple of those) on every rank, on
        `device`. The structure (or the source's error) goes first, then each tensor; an exception on the source is
        raised on every rank (elsewhere as `LeaderFailedError` with its message), so no rank waits in a collective
        the source never reaches."""
        result, error, spec = None, None, None
        if self.is_source:
            try:
                result = compute()
                spec = _spec(result)
            except Exception as exc:  # re-raised below, after the others have been told
                error = exc
        box = [(None if error is None else f"{type(error).__name__}: {error}", spec)]
        for group in self._hops():
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group, device=self.device)
        message, (is_tuple, items) = box[0][0], box[0][1] or (False, [])
        if error is not None:
            raise error
        if message is not None:
            raise LeaderFailedError(f"The rank that computes for this group failed: {message}")
        tensors = [None] * len(items)
        if self.is_source:
            tensors = list(result) if is_tuple else [result]
        shared = [None if item is None else self._broadcast(tensor, *item)
                  for tensor, item in zip(tensors, items, strict=True)]
        return tuple(shared) if is_tuple else shared[0]

    def _broadcast(self, tensor: torch.Tensor | None, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        wire = torch.uint8 if dtype == torch.bool else dtype  # gloo broadcasts no bool tensors
        buffer = (tensor.to(self.device, wire).contiguous() if tensor is not None
                  else torch.empty(shape, dtype=wire, device=self.device))
        for group in self._hops():
            dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)
        return buffer.to(dtype)

    def check_agree(self, tensors: list[torch.Tensor], where: str) -> None:
        """Raise `ImageInputsDivergedError` on every rank if ranks hold different `tensors` (compared by the
        checksum `consistency` compares the noise with, one all-gather per group)."""
        local = checksum(tensors)
        for group in (self.tp, self.pair):
            if group is None or dist.get_world_size(group) == 1:
                continue
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, local, group=group)
            scale = 1e-4 * gathered[0][1].abs().clamp_min(1.0)
            differ = [dist.get_global_rank(group, i) for i, other in enumerate(gathered)
                      if ((other - gathered[0]).abs() > scale).any()]
            if differ:
                raise ImageInputsDivergedError(
                    f"The {where} differs across the group: rank(s) {differ} hold other values than rank "
                    f"{dist.get_global_rank(group, 0)}. Every rank must call `generate` with the same images, mask "
                    "and strength (and the same seed): the stock pipeline preprocesses them on every rank."
                )


def _spec(result) -> tuple[bool, list]:
    items = list(result) if isinstance(result, tuple) else [result]
    for item in items:
        if item is not None and not isinstance(item, torch.Tensor):
            raise TypeError(f"can only share tensors and None, got {type(item).__name__}")
    return isinstance(result, tuple), [None if t is None else (tuple(t.shape), t.dtype) for t in items]


class GroupVAE:
    """`pipe.vae` for one call: `encode` computed on the group's source rank(s) and shared; everything else read from
    `vae` (the real model on the leader and, with parallel VAE, on every rank; `vae_without_coders` elsewhere).

    Not an `nn.Module`, so `DiffusionPipeline.device` keeps naming the transformer's device on every rank.
    """

    def __init__(self, vae, group: Group, decodes: bool):
        self._vae, self._group, self._decodes = vae, group, decodes

    def __getattr__(self, name):
        return getattr(self._vae, name)

    @property
    def device(self) -> torch.device:
        return self._group.device

    def encode(self, x: torch.Tensor, return_dict: bool = True):
        self._group.check_agree([x], "image the VAE encodes")
        parameters = self._group.share(lambda: posterior_parameters(self._vae.encode(x)))
        return vae_encode_output(parameters, return_dict)

    def decode(self, *args, **kwargs):
        if not self._decodes:
            raise RuntimeError("Only the TP leader decodes (no parallel VAE); this rank holds no VAE weights.")
        return self._vae.decode(*args, **kwargs)


def vae_without_coders(checkpoint, dtype: torch.dtype) -> torch.nn.Module:
    """The VAE of a rank that neither encodes nor decodes: built on the meta device from its config, with the few
    tensors outside its encoder and decoder read from the checkpoint (FLUX.2 normalises image latents with its
    batch-norm statistics on every rank; the quant convs), so no encoder or decoder weight is read."""
    vae = checkpoint.meta("vae")
    tensors = {}
    for path in sorted((checkpoint.path / "vae").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            tensors.update({key: weights.get_tensor(key) for key in weights.keys() if not key.startswith(_CODERS)})
    vae.load_state_dict(tensors, strict=False, assign=True)
    missing = [name for name, t in (*vae.named_parameters(), *vae.named_buffers())
               if t.is_meta and not name.startswith(_CODERS)]
    if missing:
        raise ValueError(f"{checkpoint.path / 'vae'} lacks {', '.join(missing)}: save or download the checkpoint "
                         "again.")
    # `torch.nn.Module.to`: `ModelMixin.to` warns about casting modules kept in float32, which a shell has none of.
    return torch.nn.Module.to(vae, dtype)


def _call_parameters(class_name: str) -> frozenset[str]:
    cls = getattr(diffusers, class_name, None)
    is_stock = inspect.isclass(cls) and issubclass(cls, diffusers.DiffusionPipeline)
    return frozenset(inspect.signature(cls.__call__).parameters) if is_stock else frozenset()


def reads_image(pipeline_cls) -> bool:
    """Whether the class's `encode_prompt` takes the condition images (its vision-language text encoder reads
    them), so the prompt is encoded inside the call, where the pipeline has resized them."""
    return "image" in inspect.signature(pipeline_cls.encode_prompt).parameters


def takes_image_per_prompt(adapter) -> bool:
    """Whether the class takes a list with one input image (and mask) per prompt, each row encoded with its own
    generator (`PipelineClass.image_per_prompt`: FLUX.1's Kontext, img2img and inpainting), so a batch of prompts with
    their own images is one stock call."""
    return bool(adapter.record is not None and adapter.record.image_per_prompt)


def check_image_kwargs(adapter, image=None, mask_image=None, strength=None, prompts: int = 1) -> dict:
    """The image kwargs of one call, checked before anything runs (every rank raises the same error). Where the
    class takes one image per prompt (`takes_image_per_prompt`), `image` and `mask_image` may each be a list with
    one per prompt (`prompts` of them)."""
    name = adapter.pipeline_class
    given = {k: v for k, v in zip(IMAGE_KWARGS, (image, mask_image, strength), strict=True) if v is not None}
    if not given and adapter.own_class:
        return given
    takes = adapter.call_parameters()
    for kwarg in given:
        if kwarg not in takes:
            kind = "a text-to-image class" if "image" not in takes else "an image-conditioned class"
            other = next((c for c in adapter.family_classes if kwarg in _call_parameters(c)), None)
            hint = (f"load a class that does on the same transformer, e.g. `load_pipeline(model, pipeline_class="
                    f"'{other}')` (the CLI: --pipeline {other})" if other else "no class verified on this model "
                    "takes it (docs/usage.md, Image inputs)")
            raise ValueError(f"{name} is {kind} and takes no `{kwarg}`: {hint}.")
    if image is None and not adapter.own_class:
        raise ValueError(f"{name} edits or follows an input image: pass `image` (the CLI: --image PATH). For "
                         "text-to-image, load the checkpoint's own pipeline class.")
    if "mask_image" in takes and image is not None and mask_image is None:
        raise ValueError(f"{name} repaints the masked part of the image: pass `mask_image` (the CLI: --mask PATH).")
    images = list(image) if isinstance(image, (list, tuple)) else [] if image is None else [image]
    if not all(isinstance(item, Image.Image) for item in images) or (image is not None and not images):
        kinds = sorted({type(item).__name__ for item in images}) or ["an empty list"]
        raise TypeError(f"`image` must be a PIL image or a list of them, got {', '.join(kinds)}: open files with "
                        "`PIL.Image.open(path)` (the CLI does).")
    per_prompt = takes_image_per_prompt(adapter)
    if len(images) > 1 and not per_prompt and not (adapter.record and adapter.record.references):
        raise ValueError(f"{name} takes one input image, got {len(images)}. Several reference images: "
                         "Flux2Pipeline, QwenImageEditPlusPipeline, QwenImage21Pipeline.")
    pairs = _image_mask_pairs(name, image, images, mask_image, prompts if per_prompt else None)
    for number, (picture, mask) in enumerate(pairs):
        if mask is not None and picture.size != mask.size:
            which = f" of prompt {number}" if len(pairs) > 1 else ""
            raise ValueError(f"The mask{which} is {mask.size[0]}x{mask.size[1]} but the image is "
                             f"{picture.size[0]}x{picture.size[1]}: give a mask of the image's size (white repaints).")
    if strength is not None and (isinstance(strength, bool) or not isinstance(strength, (int, float))
                                 or not 0 < strength <= 1):
        raise ValueError(f"`strength` must be a number in (0, 1], got {strength!r}: 1 repaints fully, smaller values "
                         "keep more of the input image.")
    return {k: list(v) if isinstance(v, tuple) else v for k, v in given.items()}


def _image_mask_pairs(name: str, image, images: list, mask_image, prompts: int | None) -> list[tuple]:
    """(image, mask) per prompt where the class takes one per prompt (`prompts`; a list of either must hold one per
    prompt), else the first image with the mask; each mask checked to be an image."""
    masks = list(mask_image) if isinstance(mask_image, (list, tuple)) and prompts else [mask_image]
    if not all(mask is None or isinstance(mask, Image.Image) for mask in masks) or not masks:
        raise TypeError(f"`mask_image` must be a PIL image{' or a list of them, one per prompt' if prompts else ''}, "
                        f"got {type(mask_image).__name__}.")
    if not images:
        return []
    if prompts is None:
        return [(images[0], masks[0])]
    if isinstance(image, (list, tuple)) and len(images) != prompts:
        raise ValueError(f"{name} takes one input image, got {len(images)} for {prompts} prompt(s): give one image "
                         "(for every prompt) or a list with one per prompt. Several reference images: Flux2Pipeline, "
                         "QwenImageEditPlusPipeline, QwenImage21Pipeline.")
    if isinstance(mask_image, (list, tuple)) and len(masks) != prompts:
        raise ValueError(f"Got {len(masks)} masks for {prompts} prompt(s): {name} takes one mask (for every prompt) or "
                         "a list with one per prompt.")
    images = images if isinstance(image, (list, tuple)) else images * prompts
    return list(zip(images, masks if len(masks) == prompts else masks * prompts, strict=True))


def image_rows(adapter, image_kwargs: dict, count: int) -> list[dict]:
    """Each of `count` prompts' own image kwargs (none: []): a list with one image (or mask) per prompt split up
    (`takes_image_per_prompt`), anything else the same for every prompt."""
    if not image_kwargs:
        return []
    split = takes_image_per_prompt(adapter)
    return [{name: value[index] if split and isinstance(value, list) else value
             for name, value in image_kwargs.items()} for index in range(count)]


def call_image_kwargs(rows: list[dict]) -> dict:
    """One stock call's image kwargs for its `rows` (one dict per row, `image_rows`): the row's own for one row, else
    a list with each row's image (and mask) and their one `strength` (a class that takes one image per prompt)."""
    if len(rows) == 1:
        return rows[0]
    merged = {name: [row[name] for row in rows] for name in ("image", "mask_image") if name in rows[0]}
    return merged | ({"strength": rows[0]["strength"]} if "strength" in rows[0] else {})


def batch_image_refusal(adapter, rows: list[dict]) -> str | None:
    """Why one stock call cannot make these `rows` (image kwargs per row; a call of several rows, or one row padded
    to a declared batch size) each as it is made alone (None: it can, or no row has image inputs)."""
    if not any(rows):
        return None
    name = adapter.pipeline_class
    if not takes_image_per_prompt(adapter):
        return (f"{name} takes one set of input images for the whole call (stock gives every prompt of a batch the "
                "same images), so with input images it makes one prompt per call; a batch of input images is one call "
                "on the classes that take one image per prompt (FluxKontextPipeline, FluxImg2ImgPipeline, "
                "FluxInpaintPipeline)")
    sizes = list(dict.fromkeys(f"{row['image'].size[0]}x{row['image'].size[1]}" for row in rows))
    if len(sizes) > 1:
        return (f"the batch's input images differ in size ({', '.join(sizes)}): stock preprocesses a batch's images "
                "into one tensor at one size (FluxKontextPipeline takes the first image's), so only input images of "
                "one size are shown to batch exactly (the job and the server group requests by input size)")
    return None


@contextmanager
def _attribute(obj, name: str, value):
    """`obj.name` is `value` inside the block and what it was after it (an instance attribute set here is
    removed, so a method comes back from the class)."""
    had = name in vars(obj)
    previous = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield value
    finally:
        if had:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)


@contextmanager
def shared_image_inputs(pipe, *, vae, encoder, tp_group, pair_group, device: torch.device, decodes: bool,
                        text_encode: bool, vae_splits: bool = False, pad_encoded=None):
    """For one stock call with image inputs: `pipe.vae` shares one rank's encodings over the TP group (and the CFG
    pair, `pair_group`), or with `vae_splits` (parallel VAE on for this call) the TP group's joint encoding over the
    pair; with `text_encode`, `pipe.encode_prompt` shares the TP leader's CPU `encoder`'s result. `decodes`: this
    rank calls `vae.decode` (the leader, and with parallel VAE every rank of the decoding group). `pad_encoded`
    (the adapter's, with the runner's buckets) pads what `encode_prompt` returns, as the text-only path pads.

    Both are instance attributes for the length of the block: `pipe.vae` is swapped as `cfg.py` swaps
    `pipe.transformer`, and `encode_prompt`, a public method the stock call reaches through `self`, is shadowed on
    the instance and removed afterwards (no private name is touched).
    """
    with ExitStack() as stack:
        group = Group(tp_group, pair_group, device, vae_splits)
        stack.enter_context(_attribute(pipe, "vae", GroupVAE(vae, group, decodes)))
        if text_encode:
            text = Group(tp_group, None, device)

            def encode_prompt(*args, **kwargs):
                encoded = text.share(lambda: encoder.encode_prompt(*args, **{**kwargs, "device": torch.device("cpu")}))
                return encoded if pad_encoded is None else pad_encoded(encoded)

            stack.enter_context(_attribute(pipe, "encode_prompt", encode_prompt))
        yield
