"""Process-group start-up from the torchrun environment, and the ("dp", "tp") device mesh.

One function, `init_distributed`, serves a plain `python` process (world size 1) and every rank of
`torchrun --nproc_per_node=N [--nnodes=M]` alike, so a script written for N ranks also runs alone.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: the torchrun coordinates plus the device/backend picked for them."""

    rank: int
    local_rank: int
    world_size: int
    device_type: str
    backend: str

    @property
    def device(self) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.local_rank)


def _neuron_available() -> bool:
    """TorchNeuron registers the `neuron` device when `torch_neuronx` is imported.

    `find_spec` first, so machines without it never pay for (or fail on) the import.
    """
    if importlib.util.find_spec("torch_neuronx") is None:
        return False
    import torch_neuronx  # noqa: F401  -- registers torch.neuron

    neuron = getattr(torch, "neuron", None)
    return neuron is not None and neuron.device_count() > 0


def detect_runtime() -> Runtime:
    """Read torchrun's environment and choose device/backend: neuron > cuda > cpu (gloo)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if _neuron_available():
        device_type, backend = "neuron", "neuron"
    elif torch.cuda.is_available():
        device_type, backend = "cuda", "nccl"
    else:
        device_type, backend = "cpu", "gloo"
    return Runtime(rank, local_rank, world_size, device_type, backend)


def divisors(n: int) -> list[int]:
    """The degrees that split `n` ranks (or heads) evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp_degree(tp: int, world_size: int) -> None:
    """Reject a TP degree that cannot tile the world, naming the ones that can."""
    if tp < 1 or world_size % tp != 0:
        raise ValueError(
            f"--tp {tp} does not divide the world size {world_size}: every rank must belong to exactly one "
            f"tensor-parallel group of the same size. Valid values for {world_size} rank(s): "
            f"{divisors(world_size)}. Change --tp, or launch a multiple of {tp} ranks."
        )


def init_distributed(tp: int | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> DeviceMesh:
    """Join (or start) the process group and return a 2-D mesh with dims ("dp", "tp").

    `tp` defaults to the world size (one tensor-parallel group); `dp = world // tp` groups then run
    independent work. `timeout_s` bounds every collective, so a dead rank makes the others fail with
    an error instead of hanging forever. Calling it again returns a mesh over the existing group.
    """
    runtime = detect_runtime()
    tp = runtime.world_size if tp is None else tp
    check_tp_degree(tp, runtime.world_size)

    if runtime.device_type != "cpu":
        torch.get_device_module(runtime.device_type).set_device(runtime.local_rank)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if runtime.world_size == 1 and "MASTER_ADDR" not in os.environ:
            # A plain `python` run: an in-memory store, so no port is opened.
            dist.init_process_group(
                runtime.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            dist.init_process_group(runtime.backend, timeout=timeout)
    return init_device_mesh(
        runtime.device_type, (runtime.world_size // tp, tp), mesh_dim_names=("dp", "tp")
    )


def rank() -> int:
    """Global rank; 0 when no process group has been started."""
    return dist.get_rank() if dist.is_initialized() else 0


def is_main_process() -> bool:
    """The one rank that logs, shows progress and writes run-wide files."""
    return rank() == 0


def is_tp_leader(mesh: DeviceMesh) -> bool:
    """Rank 0 of this process's TP group: the one that encodes, decodes and saves for the group."""
    return mesh["tp"].get_local_rank() == 0


def broadcast_from_leader(tensors: dict[str, torch.Tensor] | None, group, device: torch.device) -> dict[str, torch.Tensor]:
    """The group leader's (group rank 0) `tensors`, on `device`, on every rank of `group`.

    Only the leader passes `tensors` (the others pass `None`): names, shapes and dtypes go first as one small
    object, then each tensor in one broadcast on `device`, so the same code serves gloo, NCCL and Neuron.
    """
    leader = dist.get_global_rank(group, 0)
    is_leader = dist.get_rank() == leader
    if is_leader and tensors is None:
        raise ValueError("The group leader must pass the tensors to broadcast.")
    if dist.get_world_size(group) == 1:
        return {name: tensor.to(device) for name, tensor in tensors.items()}
    specs = [[(name, tuple(t.shape), t.dtype) for name, t in tensors.items()] if is_leader else None]
    dist.broadcast_object_list(specs, src=leader, group=group, device=device)
    received = {}
    for name, shape, dtype in specs[0]:
        tensor = tensors[name].to(device).contiguous() if is_leader else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=leader, group=group)
        received[name] = tensor
    return received
