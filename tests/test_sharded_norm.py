"""`ShardedRMSNorm`: an RMSNorm over features split across the TP group (Wan's Q/K norms over all heads) equals one
process at TP=2, for torch's and diffusers' RMSNorm. The control: the same norm taken over each rank's slice alone
(what the all-reduce prevents) moves the output by far more than the tolerance."""

import norm_jobs
import pytest
import torch

from neuron_diffusers.compat.tp_loading import shard_specs
from neuron_diffusers.parallel import sharded_norm
from neuron_diffusers.parallel.rules import expand

TOL = 1e-5


@pytest.fixture(scope="module")
def sharded(rank_pool):
    return rank_pool.run(norm_jobs.sharded_outputs, 2)


def _reference(kind: str) -> torch.Tensor:
    with torch.no_grad():
        return norm_jobs.toy(kind)(norm_jobs.toy_input())


class _PerSliceNorm(torch.nn.Module):
    """`norm` taken over each half of the features alone: each rank's norm without the all-reduce."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        features = norm_jobs.FEATURES
        self.half, self.eps = features // 2, norm.eps or torch.finfo(torch.float32).eps
        self.weight = norm.weight if norm.weight is not None else torch.ones(features)
        bias = getattr(norm, "bias", None)
        self.bias = bias if bias is not None else torch.zeros(features)

    def forward(self, x):
        parts = [x[..., i:i + self.half] for i in (0, self.half)]
        normed = [part * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + self.eps) for part in parts]
        return torch.cat(normed, -1) * self.weight + self.bias


def _per_slice_norm(kind: str) -> torch.Tensor:
    model = norm_jobs.toy(kind)
    for block in model.blocks:
        block.norm_q = _PerSliceNorm(block.norm_q)
    with torch.no_grad():
        return model(norm_jobs.toy_input())


@pytest.mark.parametrize("kind", list(norm_jobs.NORMS))
def test_tp2_equals_one_process(sharded, kind):
    reference = _reference(kind)
    control = (_per_slice_norm(kind) - reference).abs().max().item()
    assert control > 100 * TOL, f"the per-slice control moved the output by only {control}"
    for rank, report in enumerate(sharded):
        diff = (report[kind] - reference).abs().max().item()
        assert diff < TOL, f"rank {rank}: {kind} differs from one process by {diff}"


def test_each_rank_holds_half_the_norm_and_one_all_reduce_per_call(sharded):
    for report in sharded:
        assert report["torch", "weight"] == (norm_jobs.FEATURES // 2,)
        assert report["diffusers_bias", "weight"] == (norm_jobs.FEATURES // 2,)
        # 2 blocks x (rowwise to_out + the norm's sum of squares)
        assert report["torch", "collectives"] == {"all_reduce": 4, "all_gather": 0}


def test_layout_and_refusals():
    model = norm_jobs.toy("diffusers_bias")
    specs = shard_specs(model, norm_jobs.PLAN, 2)
    assert specs["blocks.0.norm_q.weight"].dim == 0 and specs["blocks.1.norm_q.bias"].block_sizes == [16]
    norms = [t for t in expand(model, norm_jobs.PLAN) if isinstance(t.style, norm_jobs.ShardedRMSNorm)]
    with pytest.raises(ValueError, match="its 16 features are not divisible by 3"):
        sharded_norm.shard_specs(norms, 3)
    with pytest.raises(ValueError, match="splits an RMSNorm over one dimension"):
        shard_specs(model, {**norm_jobs.PLAN, "blocks.*.to_out": norm_jobs.ShardedRMSNorm()}, 2)
