"""Process-group start-up from the torchrun environment, and the ("dp", "tp") or ("dp", "cfg", "tp") device mesh.

One function, `init_distributed`, serves a plain `python` process (world size 1) and every rank of
`torchrun --nproc_per_node=N [--nnodes=M]` alike, so a script written for N ranks also runs alone.

A *replica* is the set of ranks that shares one `dp` coordinate: one TP group, or with `cfg=2` a CFG pair of TP
groups that compute the two branches of true classifier-free guidance side by side (see `parallel/cfg.py`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

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


def check_heads_divisible(model_name: str, num_heads: int | None, tp: int) -> None:
    """Each rank must own whole attention heads; name the TP degrees that work."""
    if num_heads is not None and num_heads % tp != 0:
        raise ValueError(
            f"A tensor-parallel degree of {tp} does not divide the {num_heads} attention heads of {model_name}: "
            f"each rank must own whole heads. Valid degrees for this model: {divisors(num_heads)}."
        )


def check_tp_degree(tp: int, world_size: int) -> None:
    """Reject a TP degree that cannot tile the world, naming the ones that can."""
    if tp < 1 or world_size % tp != 0:
        raise ValueError(
            f"--tp {tp} does not divide the world size {world_size}: every rank must belong to exactly one "
            f"tensor-parallel group of the same size. Valid values for {world_size} rank(s): "
            f"{divisors(world_size)}. Change --tp, or launch a multiple of {tp} ranks."
        )


def check_cfg_degree(cfg: int, tp: int, world_size: int) -> None:
    """Reject a CFG degree other than 1 or 2, or a world that CFG pairs of TP groups cannot tile."""
    if cfg not in (1, 2):
        raise ValueError(
            f"cfg={cfg}: CFG parallelism splits the two branches of classifier-free guidance (cond, uncond), so the "
            "cfg degree is 2 (on) or 1 (off)."
        )
    if cfg > 1 and tp >= 1 and world_size % (cfg * tp) != 0:
        valid = [d for d in divisors(world_size) if world_size % (cfg * d) == 0]
        raise ValueError(
            f"--cfg-parallel with --tp {tp} needs a multiple of {cfg} x {tp} = {cfg * tp} ranks (one TP group per "
            f"guidance branch), but {world_size} rank(s) were launched. "
            + (f"Valid --tp values for {world_size} rank(s): {valid}. " if valid else "")
            + f"Change --tp, or launch a multiple of {cfg * tp} ranks."
        )


def init_distributed(tp: int | None = None, *, cfg: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S) -> DeviceMesh:
    """Join (or start) the process group and return a mesh with dims ("dp", "tp"), or ("dp", "cfg", "tp") for `cfg=2`.

    `tp` defaults to the world size divided by `cfg` (one replica); `dp = world // (cfg * tp)` replicas then run
    independent work. With `cfg=2` each replica is a pair of TP groups that computes the cond and uncond branches
    of true classifier-free guidance at the same time (`load_pipeline(...).generate` does it for you); `cfg=1`
    keeps the 2-D mesh, so code written for it is unchanged. `timeout_s` bounds every collective, so a dead rank
    makes the others fail with an error instead of hanging forever. Calling it again returns a mesh over the
    existing group.
    """
    runtime = detect_runtime()
    tp = max(runtime.world_size // cfg, 1) if tp is None else tp
    check_cfg_degree(cfg, tp, runtime.world_size)
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
    if cfg == 1:
        return init_device_mesh(runtime.device_type, (runtime.world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(
        runtime.device_type, (runtime.world_size // (cfg * tp), cfg, tp), mesh_dim_names=("dp", "cfg", "tp")
    )


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for `mesh`: its own accelerator, or the CPU."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def rank() -> int:
    """Global rank; 0 when no process group has been started."""
    return dist.get_rank() if dist.is_initialized() else 0


def is_main_process() -> bool:
    """The one rank that logs, shows progress and writes run-wide files."""
    return rank() == 0


def is_tp_leader(mesh: DeviceMesh) -> bool:
    """Rank 0 of this process's TP group: the one that encodes, decodes and saves for the group."""
    return mesh["tp"].get_local_rank() == 0


def cfg_size(mesh: DeviceMesh) -> int:
    """2 on a ("dp", "cfg", "tp") mesh with CFG pairs, else 1."""
    return mesh["cfg"].size() if "cfg" in (mesh.mesh_dim_names or ()) else 1


def cfg_rank(mesh: DeviceMesh) -> int:
    """Which TP group of its CFG pair this rank belongs to (0 without a cfg dimension): 0 computes cond, 1 uncond."""
    return mesh["cfg"].get_local_rank() if cfg_size(mesh) > 1 else 0


def is_replica_leader(mesh: DeviceMesh) -> bool:
    """The TP leader of CFG rank 0: the one rank of its replica that `generate` returns outputs on."""
    return is_tp_leader(mesh) and cfg_rank(mesh) == 0


def broadcast_object_from_replica_leader(obj, mesh: DeviceMesh):
    """The replica leader's `obj` on every rank of its replica: over its TP group, then to each CFG partner.

    Two hops over the mesh's own groups, so no group spanning a whole replica has to be created.
    """
    box = [obj]
    if cfg_rank(mesh) == 0:
        tp_group = mesh["tp"].get_group()
        dist.broadcast_object_list(box, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    if cfg_size(mesh) > 1:
        cfg_group = mesh["cfg"].get_group()
        dist.broadcast_object_list(box, src=dist.get_global_rank(cfg_group, 0), group=cfg_group)
    return box[0]


def broadcast_from_leader(tensors: dict[str, torch.Tensor] | BaseException | None, group,
                          device: torch.device) -> dict[str, torch.Tensor]:
    """The group leader's (group rank 0) `tensors`, on `device`, on every rank of `group`.

    Only the leader passes `tensors` (the others pass `None`): names, shapes and dtypes go first as one small
    object, then each tensor in one broadcast on `device`, so the same code serves gloo, NCCL and Neuron. A leader
    that failed to make them passes its exception (picklable) instead, and every rank raises it: the others would
    otherwise wait for tensors that never come.
    """
    leader = dist.get_global_rank(group, 0)
    is_leader = dist.get_rank() == leader
    if is_leader and tensors is None:
        raise ValueError("The group leader must pass the tensors to broadcast.")
    if dist.get_world_size(group) == 1:
        if isinstance(tensors, BaseException):
            raise tensors
        return {name: tensor.to(device) for name, tensor in tensors.items()}
    failed = isinstance(tensors, BaseException)
    specs = [(tensors if failed else [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()])
             if is_leader else None]
    dist.broadcast_object_list(specs, src=leader, group=group, device=device)
    if isinstance(specs[0], BaseException):
        raise tensors if is_leader else specs[0]
    received = {}
    for name, shape, dtype in specs[0]:
        tensor = tensors[name].to(device).contiguous() if is_leader else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=leader, group=group)
        received[name] = tensor
    return received


def default_store() -> dist.Store:
    """The key-value store the process group was started with (torchrun's TCP store, or the in-memory one).

    Torch has no public accessor: `_get_default_store` (a torch private, stable since torch 1.x) is used here only.
    """
    return dist.distributed_c10d._get_default_store()


def leave_together(timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Wait (at most `timeout_s`) until every rank of the world is here, through the store: no collective is in
    flight on any rank afterwards, so tearing the process group down cannot cut a peer off mid-message.

    Returns False when some rank did not come in time (it failed or died): leaving anyway is then right.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    store = default_store()
    store.set(f"neuron_diffusers/leave/{dist.get_rank()}", "1")
    try:
        store.wait([f"neuron_diffusers/leave/{r}" for r in range(dist.get_world_size())], timedelta(seconds=timeout_s))
    except dist.DistError:  # a peer is gone (timeout, or its store connection closed)
        return False
    return True


def exit_process(code: int) -> NoReturn:
    """End this process with `code` in a fixed order: process group destroyed, logs and streams flushed, then
    `os._exit`.

    Why not a normal exit: at interpreter shutdown a native thread of the process group (gloo's workers) can still
    drop the last reference to a tensor and take the GIL to free its Python object; CPython stops such threads during
    finalization by unwinding them, which aborts the process ("terminate called without an active exception",
    SIGABRT; pytorch/pytorch#190489, #179291). Destroying the group while the interpreter is whole, then leaving
    without finalizing it, leaves no native thread that could run into finalization.
    """
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as error:  # leaving anyway: report it, keep the exit code
        print(f"neuron-diffusers: destroying the process group failed: {error}", file=sys.stderr)
        code = code or 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to flush into
            pass
    os._exit(code)
