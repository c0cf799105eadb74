"""Parallel VAE: every rank of a group decodes (and encodes) one piece of each image, with the stock result.

Without it the group's leader decodes alone while the others wait, and it alone holds the decode's activations,
which is what runs out of memory first at 2048x2048. `enable_parallel_vae(vae, group)` installs diffusers
`ModelHook`s on the VAE's own modules (nothing is replaced or copied; `remove()` takes them off again), in one of two
ways chosen by the VAE class:

* rows (`vae_rows.py`): AutoencoderKL (FLUX.1), AutoencoderKLFlux2, AutoencoderKLQwenImage (Qwen-Image, also its
  video frames through the causal cache), AutoencoderKLQwenImage21 and AutoencoderKLWan (Wan's causal 3-D VAE):
  each rank runs the decoder on a band of rows, with halo rows per convolution, whole-image GroupNorm statistics
  and the mid-block attention gathered. Equal to stock within float32 rounding (per-rank peak memory about 1/N of
  one rank's).
* turns (`vae_turns.py`): AutoencoderKLMiniMaxH3, whose ViT decoder attends over a whole clip: the ranks deal out
  the clips and tiles stock decodes one by one. Bit-exact without spatial tiles (time, not memory, is divided).

A decode's image is assembled on the group's rank 0 only (the other ranks get zeros of its shape, to run stock's
post-processing on and drop); an encode's latents reach every rank. Every rank of the group must hold the same VAE
and call `decode` / `encode` with the same input.
"""

from __future__ import annotations

import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook
from torch import nn

from . import vae_turns
from .vae_rows import RowSplit, plan_rows

HOOK_NAME = "neuron_diffusers.parallel_vae"
#: VAE class name -> how its decode and encode are split.
STRATEGIES = {
    "AutoencoderKL": "rows",
    "AutoencoderKLFlux2": "rows",
    "AutoencoderKLQwenImage": "rows",
    "AutoencoderKLQwenImage21": "rows",
    "AutoencoderKLMiniMaxH3": "turns",
    "AutoencoderKLWan": "rows",
}
#: The instance attribute that holds a VAE's handle: on the VAE itself, so a VAE dropped by its pipeline is freed
#: (a module-level table of handles would keep every VAE alive, since each handle refers to its VAE).
HANDLE_ATTRIBUTE = "_nd_parallel_vae"


def check_supported(vae_class_name: str) -> None:
    """Raise before any weight is read if parallel VAE cannot split this VAE class (from its config's name)."""
    if vae_class_name not in STRATEGIES:
        raise ValueError(f"parallel_vae does not support {vae_class_name}: it splits {', '.join(STRATEGIES)} "
                         "exactly. Pass parallel_vae=False (--no-parallel-vae) to decode on the group's leader.")


class ParallelVAE:
    """Handle of an installed parallel VAE: `remove()` (or leaving a `with` block) restores the stock VAE.

    While `enabled` is False every call runs stock on each rank (`generate` sets it per call, see `splits`).
    """

    def __init__(self, vae: nn.Module, group, min_pixels: int = 0):
        self.vae, self.group, self.min_pixels = vae, group, min_pixels
        self.strategy = STRATEGIES[type(vae).__name__]
        self.enabled = True
        #: For the turns strategy: which calls this rank computed (`calls_run`), for tests and benchmarks.
        self.turns: vae_turns.TurnState | None = None
        self._hooked: list[nn.Module] = []
        self._wrapped: list[str] = []

    def _hook(self, module: nn.Module, hook: ModelHook):
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK_NAME)
        self._hooked.append(module)

    def _wrap(self, name: str, wrapper):
        if name in vars(self.vae):
            raise ValueError(f"vae.{name} is already replaced on this instance; remove that first.")
        setattr(self.vae, name, wrapper)
        self._wrapped.append(name)

    def splits(self, height: int | None, width: int | None) -> bool:
        """Whether an image of `height` x `width` pixels is worth splitting (at least `min_pixels`; a size left to
        the pipeline's default, 1024 x 1024 or more for every family here, is)."""
        return height is None or width is None or height * width >= self.min_pixels

    def remove(self) -> None:
        self.vae.__dict__.pop(HANDLE_ATTRIBUTE, None)
        for module in self._hooked:
            HookRegistry.check_if_exists_or_initialize(module).remove_hook(HOOK_NAME, recurse=False)
        for name in self._wrapped:
            delattr(self.vae, name)
        self._hooked, self._wrapped = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def enable_parallel_vae(vae: nn.Module, group=None, min_pixels: int = 0) -> ParallelVAE:
    """Split `vae`'s decode and encode over `group` (default: the world) exactly.

    Every rank of `group` must hold the same VAE and call `decode`/`encode` with the same input; the decoded image
    is returned on the group's rank 0 (zeros of its shape elsewhere), the encoded posterior on every rank. All
    checks run before anything is installed, and a failure while installing removes what was installed.
    `min_pixels` is only recorded, for the caller's `handle.splits(height, width)`.
    """
    check_supported(type(vae).__name__)
    if not dist.is_initialized():
        raise RuntimeError("parallel_vae needs the process group to be up (neuron_diffusers.init_distributed).")
    if parallel_vae_of(vae) is not None:
        raise ValueError("This VAE already has parallel_vae installed; remove() its handle first.")
    group = dist.group.WORLD if group is None else group
    handle = ParallelVAE(vae, group, min_pixels)
    if dist.get_world_size(group) == 1:
        return handle

    def is_on() -> bool:
        return handle.enabled

    if handle.strategy == "rows":
        plans = [plan_rows(vae.decoder, RowSplit(group, to_leader=True, is_on=is_on)),
                 plan_rows(vae.encoder, RowSplit(group, to_leader=False, is_on=is_on))]
        steps = [lambda m=m, h=h: handle._hook(m, h) for plan in plans for m, h in plan]
    else:
        mirror = vae_turns.meta_mirror(vae)
        handle.turns = state = vae_turns.TurnState(group, mirror)
        steps = [
            lambda: handle._hook(vae.decoder, vae_turns.TakeTurns(state, mirror.decoder)),
            lambda: handle._hook(vae.encoder, vae_turns.TakeTurns(state, mirror.encoder)),
            lambda: handle._hook(vae.quant_conv, vae_turns.PassStandIns(state, mirror.quant_conv)),
            lambda: handle._wrap("decode", vae_turns.summed_over_group(vae.decode, state, vae_turns.sum_decoded,
                                                                       is_on)),
            lambda: handle._wrap("encode", vae_turns.summed_over_group(vae.encode, state, vae_turns.sum_encoded,
                                                                       is_on)),
        ]
    try:
        for step in steps:
            step()
    except BaseException:
        handle.remove()
        raise
    vae.__dict__[HANDLE_ATTRIBUTE] = handle
    return handle


def parallel_vae_of(vae: nn.Module | None) -> ParallelVAE | None:
    """The handle installed on `vae`, or None. While it is `enabled`, every rank of its group must call
    `vae.encode` / `vae.decode` itself, with the same input: encode gives every rank the whole posterior (equal on
    every rank by construction), decode gives the group's rank 0 the image."""
    return None if vae is None else vae.__dict__.get(HANDLE_ATTRIBUTE)


#: `parallel_vae=None` (the default): the image size, in pixels (height x width), from which each strategy splits a
#: call. Rows: from 1024 x 1024, where the split halves the per-rank peak and cuts each rank's work, while below it
#: the decode is short and its ~60 per-layer collectives cost about what they save (`bench vae`, docs/benchmarks.md).
#: Turns: always, being bit-exact and dividing the decode's time by the ranks.
DEFAULT_MIN_PIXELS = {"rows": 1024 * 1024, "turns": 0}


def resolve_parallel_vae(requested: bool | None, vae_class_name: str, group_size: int) -> int | None:
    """From what image size (pixels) to split the VAE over an image group of `group_size` ranks (TP x ring x
    Ulysses: context-parallel ranks hold the VAE and decode a piece too), or None not to hold it on every rank at all.
    `requested=True`: every size (a VAE class it cannot split is refused, before any weight is read); False: None;
    None: `DEFAULT_MIN_PIXELS` for a class it can split. One rank has nothing to split."""
    if requested:
        check_supported(vae_class_name)
    if group_size == 1 or requested is False or vae_class_name not in STRATEGIES:
        return None
    return 0 if requested else DEFAULT_MIN_PIXELS[STRATEGIES[vae_class_name]]
