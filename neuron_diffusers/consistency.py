"""Catch ranks of a TP group that denoise different latents, before they produce a silently wrong image.

Tensor parallelism assumes every rank of the group holds the same activations; ranks that start from different
noise still run without error, and the all-reduces blend their images into a plausible-looking wrong one
(measured: up to 0.99 pixel difference). Comparing a three-number checksum of the latents across the group costs
one tiny all-gather, so it runs at the first and last step by default and every `every` steps on request. With CFG
parallelism the two TP groups of a CFG pair must hold the same latents too (each computes one guidance branch of the
same image), so the pair is compared as well. Under context parallelism the group is the whole image group (TP x
ring x Ulysses ranks): the transformer's output is gathered along the sequence, so each of them holds all latents.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class LatentsDivergedError(RuntimeError):
    """Ranks of one tensor-parallel group (or of one CFG pair) hold different latents."""


def checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(sum, sum of |x|, position-weighted sum) over `tensors`, in float32 on their device.

    The weighted sum tells apart latents that hold the same values in a different order.
    """
    parts = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).float()
        weights = torch.linspace(-1.0, 1.0, flat.numel(), device=flat.device)
        parts.append(torch.stack([flat.sum(), flat.abs().sum(), (flat * weights).sum()]))
    return torch.stack(parts).sum(0)


class LatentAgreement:
    """Compares the latents of every rank of `group` at chosen steps; raises `LatentsDivergedError` on all of them.

    `rtol` is relative to the sum of |latents|: identical latents give identical checksums up to the order of
    float32 additions, while different noise moves them by a large fraction.
    """

    def __init__(self, group, every: int | None = None, rtol: float = 1e-4, cfg_group=None,
                 group_name: str | None = None):
        self.groups = [(group, group_name or "tensor-parallel group")] + (
            [(cfg_group, "CFG pair")] if cfg_group is not None else [])
        self.every = every
        self.rtol = rtol
        self._calls = 0

    def check(self, tensors: list[torch.Tensor], where: str) -> None:
        local = None
        for group, name in self.groups:
            size = dist.get_world_size(group)
            if size == 1:
                continue
            local = checksum(tensors) if local is None else local
            gathered = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(gathered, local, group=group)
            reference = gathered[0]
            scale = self.rtol * reference[1].abs().clamp_min(1.0)
            for index, other in enumerate(gathered[1:], start=1):
                if ((other - reference).abs() > scale).any():
                    raise LatentsDivergedError(
                        f"Latents differ across the {name} at {where}: rank "
                        f"{dist.get_global_rank(group, index)} holds latents with checksum {other.tolist()}, rank "
                        f"{dist.get_global_rank(group, 0)} holds {reference.tolist()}. Every rank of the {name} must "
                        "denoise the same noise, otherwise the image comes out silently wrong. Give every rank the "
                        "same `seed` (`generate` seeds a CPU generator with seed + index) and do not pass per-rank "
                        "`generator` or `latents`."
                    )

    def _due(self, step: int, last: bool) -> bool:
        return step == 0 or last or bool(self.every and step % self.every == 0)

    def step_end(self, pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        """A stock `callback_on_step_end`: checks the latents the step produced."""
        if self._due(step, last=step == pipe.num_timesteps - 1):
            self.check([callback_kwargs["latents"]], f"step {step}")
        return {}

    def pre_hook(self, module, args, kwargs) -> None:
        """A transformer forward pre-hook, for pipelines without step callbacks: checks the call's float inputs."""
        if self._due(self._calls, last=False):
            inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            self.check(inputs, f"transformer call {self._calls}")
        self._calls += 1
