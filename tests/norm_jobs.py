"""Rank jobs of tests/test_sharded_norm.py: a toy attention (colwise Q, an RMSNorm over all heads, rowwise output)
sharded at TP=2 with `ShardedRMSNorm`, against the same toy in one process."""

from __future__ import annotations

import types

import torch
from diffusers.hooks import tensor_parallel
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from rank_cases import one_thread

from neuron_diffusers.distributed import init_distributed
from neuron_diffusers.tp_plans import ShardedRMSNorm

PLAN = {"blocks.*.to_q": "colwise", "blocks.*.norm_q": ShardedRMSNorm(), "blocks.*.to_out": "rowwise"}
WIDTH, FEATURES = 8, 16
NORMS = {
    "torch": lambda: torch.nn.RMSNorm(FEATURES, eps=1e-6),
    "torch_default_eps": lambda: torch.nn.RMSNorm(FEATURES),
    "diffusers_bias": lambda: DiffusersRMSNorm(FEATURES, eps=1e-6, bias=True),
    "diffusers_plain": lambda: DiffusersRMSNorm(FEATURES, eps=1e-6, elementwise_affine=False),
}


class Attention(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.to_q, self.norm_q, self.to_out = torch.nn.Linear(WIDTH, FEATURES), norm, torch.nn.Linear(FEATURES, WIDTH)

    def forward(self, x):
        return self.to_out(self.norm_q(self.to_q(x)))


class Toy(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Attention(NORMS[kind]()) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def toy(kind: str, seed: int = 0) -> Toy:
    """The same random toy in every process (norm weights and biases random too, so their slicing shows)."""
    torch.manual_seed(seed)
    model = Toy(kind)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 1)
    return model


def toy_input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 5, WIDTH)


def sharded_outputs() -> dict:
    """Each toy's output at TP=2 (every rank returns the whole output), the norm modules' local weight widths, and the
    collectives the rules count."""
    from neuron_diffusers.parallel.rules import collectives_per_forward

    report = {}
    with one_thread():
        mesh = init_distributed(tp=2)["tp"]
        for kind in NORMS:
            model = toy(kind)
            report[kind, "collectives"] = collectives_per_forward(model, PLAN)
            tensor_parallel.apply_tensor_parallel(model, types.SimpleNamespace(_mesh=mesh), PLAN)
            norm = model.blocks[0].norm_q
            report[kind, "weight"] = None if norm.weight is None else tuple(norm.weight.to_local().shape)
            with torch.no_grad():
                report[kind] = model(toy_input())
    return report
