"""RMSNorm over a column-sharded feature dimension (`tp_plans.styles.ShardedRMSNorm`): one all-reduce per call.

Several DiTs normalize Q and K over all heads at once (Wan, SkyReels-V2, ChronoEdit, LTX-Video: `RMSNorm(heads x
head_dim)` right after `to_q` / `to_k`). Once `to_q` is colwise, each rank holds its heads' slice of those features;
the norm needs the mean square over all of them. Here each rank sums its slice's squares (in float32), one
all-reduce over the TP group adds the ranks' sums (`tokens x 1`), and the rank scales its slice by its slice of the
weight: the same numbers as one process, up to the summation order.

API (what a plan, the loader and a drafter use):
- `supports(module)`: whether a norm module can take the style (`torch.nn.RMSNorm`, diffusers' `RMSNorm`).
- `shard_specs(targets, tp)`: the loader's layout of each norm's weight (and bias): split along its only dim, like
  the colwise Linear's output in front of it, so each rank streams only its slice.
- `ShardedNormStyle(partition)`: the `torch.distributed.tensor.parallel` style `parallelize_module` applies: it
  shards the weight (unless a streaming load already did) and swaps the module's class for a subclass, of the same
  name, whose forward is `sharded_forward` (one class for all instances, so compiled repeated blocks share a graph).
- `rms_norm(module, x, mesh)`: the arithmetic alone, each class's own mirrored, for a caller holding a slice.
"""

from __future__ import annotations

import torch
from diffusers.hooks.tensor_parallel import TPShardSpec
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

#: The norm classes whose arithmetic `rms_norm` mirrors.
NORM_CLASSES = (torch.nn.RMSNorm, DiffusersRMSNorm)
_SUBCLASSES: dict[type, type] = {}


def supports(module: torch.nn.Module) -> bool:
    """Whether `module` is an RMSNorm over one (last) dimension that `ShardedRMSNorm` can split."""
    return isinstance(module, NORM_CLASSES) and len(_normalized_shape(module)) == 1


def _normalized_shape(module: torch.nn.Module) -> tuple:
    shape = module.normalized_shape if isinstance(module, torch.nn.RMSNorm) else module.dim
    return tuple(shape)


def _local(param):
    return param.to_local() if isinstance(param, DTensor) else param


def _global_mean_square(x: torch.Tensor, mesh) -> torch.Tensor:
    """The mean of `x**2` over the last dimension of the whole (all ranks') feature vector, in float32."""
    local = x.float().pow(2).sum(-1, keepdim=True)
    total = funcol.all_reduce(local, "sum", mesh)
    return total / (x.shape[-1] * mesh.size())


def rms_norm(module: torch.nn.Module, x: torch.Tensor, mesh) -> torch.Tensor:
    """`module(x_whole)`'s slice for this rank, from this rank's slice `x` of the features (one all-reduce).

    Mirrors each class's own dtypes: torch's normalizes in float32 and casts back before the weight (ATen's
    `rms_norm`); diffusers' multiplies the input by the float32 scale and casts to a half-precision weight's dtype.
    """
    weight, bias = _local(module.weight), _local(getattr(module, "bias", None))
    mean_square = _global_mean_square(x, mesh)
    if isinstance(module, torch.nn.RMSNorm):
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        out = (x.float() * torch.rsqrt(mean_square + eps)).type_as(x)
        return out * weight if weight is not None else out
    out = x * torch.rsqrt(mean_square + module.eps)
    if weight is None:
        return out.to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        out = out.to(weight.dtype)
    out = out * weight
    return out + bias if bias is not None else out


def sharded_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of a sharded norm: its input is this rank's slice of the features (see `rms_norm`)."""
    return rms_norm(self, hidden_states, self._nd_tp_mesh)


def shard_specs(targets, tp: int) -> dict[str, TPShardSpec]:
    """Each norm's weight and bias split along dim 0 (one block), as the loader streams them; a width that `tp`
    does not divide is refused before any weight is read."""
    specs = {}
    for target in targets:
        (width,) = _normalized_shape(target.module)
        if width % tp:
            raise ValueError(
                f"Cannot shard '{target.name}' across {tp} tensor-parallel ranks: its {width} features are not "
                f"divisible by {tp}. Use a degree that divides the attention heads and {width}."
            )
        for name in ("weight", "bias"):
            if getattr(target.module, name, None) is not None:
                specs[f"{target.name}.{name}"] = TPShardSpec(0, [width])
    return specs


class ShardedNormStyle(ParallelStyle):
    """`parallelize_module`'s style for a `ShardedRMSNorm` rule; `partition=False` keeps the shards a streaming
    load placed."""

    def __init__(self, partition: bool = True):
        super().__init__()
        self.partition = partition

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        if not supports(module):
            names = ", ".join(c.__name__ for c in NORM_CLASSES)
            raise ValueError(f"ShardedRMSNorm applies to an RMSNorm over one dimension ({names}), not "
                             f"{type(module).__name__}. Point the rule at the Q/K norm module.")
        for name, param in list(module.named_parameters(recurse=False)):
            if self.partition and not isinstance(param, DTensor):
                sharded = distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
                module.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
        module._nd_tp_mesh = device_mesh
        cls = type(module)
        if cls not in _SUBCLASSES.values():
            if cls not in _SUBCLASSES:
                _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": sharded_forward, "__module__": __name__,
                                                               "__doc__": sharded_forward.__doc__})
            module.__class__ = _SUBCLASSES[cls]
        return module
