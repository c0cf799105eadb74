"""Parallel VAE by turns (MiniMax-H3): the ranks deal out the clips and tiles that stock already decodes one by one.

MiniMax-H3's decoder is a ViT with full attention over a clip, so its rows cannot be split with halos. But stock
`AutoencoderKLMiniMaxH3.decode` / `encode` already run `vae.decoder` / `vae.encoder` (then `vae.quant_conv` when
encoding) once per temporal clip and spatial tile, and blend the overlaps linearly. Each rank computes every N-th
of those calls and stands zeros in for the others; one sum over the group at the end of `decode` / `encode` then
gives the stock blend, since a blend is linear in its tiles. With no spatial tiles every blended element is one
product plus an exact zero, so the sum is bit-exact; where four tiles meet, it is exact within float32 rounding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers.hooks import ModelHook
from torch import nn


class TurnState:
    """Whose turn each decoder (encoder) call is during one `decode` (`encode`), and which outputs are stand-ins."""

    def __init__(self, group, mirror: nn.Module):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.mirror = mirror  # the VAE on the meta device: the shape and dtype of a call nobody here computes
        self.active = False
        self.turn = 0
        self.calls_run = 0
        self.stand_ins: list[torch.Tensor] = []

    def begin(self):
        self.active, self.turn, self.stand_ins = True, 0, []

    def end(self):
        self.active, self.stand_ins = False, []

    def is_stand_in(self, tensor) -> bool:
        return any(tensor is stand_in for stand_in in self.stand_ins)

    def stand_in(self, mirror_module: nn.Module, args, kwargs, device) -> torch.Tensor:
        meta_args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        with torch.no_grad():
            shape = mirror_module(*meta_args, **kwargs)
        zeros = torch.zeros(shape.shape, dtype=shape.dtype, device=device)
        self.stand_ins.append(zeros)
        return zeros


class TakeTurns(ModelHook):
    """On the decoder (encoder): compute every N-th call here, zeros for the others (other ranks compute them)."""

    def __init__(self, state: TurnState, mirror_module: nn.Module):
        super().__init__()
        self.state, self.mirror_module = state, mirror_module

    def new_forward(self, module, *args, **kwargs):
        state = self.state
        if not state.active:
            return self.fn_ref.original_forward(*args, **kwargs)
        mine = state.turn % state.world_size == state.rank
        state.turn += 1
        if mine:
            state.calls_run += 1
            return self.fn_ref.original_forward(*args, **kwargs)
        return state.stand_in(self.mirror_module, args, kwargs, args[0].device)


class PassStandIns(ModelHook):
    """On a module applied right after a turn (`quant_conv`): a stand-in stays zeros, or its bias would be summed
    once per rank."""

    def __init__(self, state: TurnState, mirror_module: nn.Module):
        super().__init__()
        self.state, self.mirror_module = state, mirror_module

    def new_forward(self, module, *args, **kwargs):
        if self.state.active and self.state.is_stand_in(args[0]):
            return self.state.stand_in(self.mirror_module, args, kwargs, args[0].device)
        return self.fn_ref.original_forward(*args, **kwargs)


def meta_mirror(vae: nn.Module) -> nn.Module:
    """`vae` rebuilt from its config on the meta device, in its dtypes: it answers output shapes, holding nothing."""
    with torch.device("meta"):
        mirror = type(vae).from_config(vae.config)
    for mirrored, real in zip(mirror.parameters(), vae.parameters(), strict=True):
        mirrored.data = mirrored.data.to(real.dtype)
    return mirror


def summed_over_group(method, state: TurnState, reduce, is_on):
    """`vae.decode` / `vae.encode`, taking turns inside and summing the per-rank partial results at the end (while
    `is_on()`; else stock)."""

    def call(*args, **kwargs):
        if not is_on():
            return method(*args, **kwargs)
        state.begin()
        try:
            result = method(*args, **kwargs)
        finally:
            state.end()
        return reduce(result, state.group)

    call.__wrapped__ = method
    return call


def _summed(tensor: torch.Tensor, group, to_leader: bool) -> torch.Tensor:
    """The sum over `group` (on its rank 0 only, `to_leader`), on a contiguous tensor: a sliced result is a view
    the collective cannot write through. Off the leader, `to_leader` leaves this rank's partial sum."""
    tensor = tensor.contiguous()
    if to_leader:
        dist.reduce(tensor, group_dst=0, group=group)
    else:
        dist.all_reduce(tensor, group=group)
    return tensor


def sum_decoded(result, group):
    """Decode: the video is summed on the group's leader, the only rank that keeps it."""
    if isinstance(result, tuple):
        return (_summed(result[0], group, to_leader=True),) + result[1:]
    result.sample = _summed(result.sample, group, to_leader=True)
    return result


def sum_encoded(result, group):
    """Encode: the posterior's moments are summed on every rank, which all denoise from them."""
    posterior = result[0] if isinstance(result, tuple) else result.latent_dist
    summed = type(posterior)(_summed(posterior.parameters, group, to_leader=False),
                             deterministic=posterior.deterministic)
    if isinstance(result, tuple):
        return (summed,) + result[1:]
    result.latent_dist = summed
    return result
