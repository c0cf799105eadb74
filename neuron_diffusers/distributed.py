"""Process-group start-up from the torchrun environment, and the device mesh every parallelism shares.

One function, `init_distributed`, serves a plain `python` process (world size 1) and every rank of
`torchrun --nproc_per_node=N [--nnodes=M]` alike, so a script written for N ranks also runs alone.

An *image group* is the set of ranks that makes one image together: a TP group, times the ring and Ulysses ranks
of context parallelism (`parallel/context.py`). A *replica* is the set of ranks that shares one `dp` coordinate:
one image group, or with `cfg=2` a CFG pair of image groups that compute the two branches of true classifier-free
guidance side by side (see `parallel/cfg.py`).

The mesh has dims ("dp", "tp"), ("dp", "cfg", "tp") with `cfg=2`, and all five of `CP_DIMS` (size 1 allowed) when
context parallelism is on. Without it the mesh keeps its two or three dims, so code, saved job metadata and
summaries written for it stay as they are; everything that reads a dimension goes through `dim_size`, which gives
1 for a dimension the mesh does not have.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .topology import Nodes, check_node_local, detect_nodes, split_dims

DEFAULT_TIMEOUT_S = 600.0

#: The dimensions of a mesh with context parallelism.
CP_DIMS = ("dp", "cfg", "tp", "ring", "ulysses")
#: Ulysses innermost, so its all-to-all groups are contiguous runs of ranks (some runtimes, Neuron's among them,
#: accept only contiguous replica groups for all-to-all), then ring, then TP, whose all-reduces tolerate strided
#: groups. diffusers PR #14725 (TP + CP in one config) chose the same for the same reason.
ULYSSES_INNER = ("dp", "cfg", "tp", "ring", "ulysses")
#: TP innermost: TP's all-reduces (two per block) on neighbouring ranks, the usual choice on NVLink GPUs.
TP_INNER = ("dp", "cfg", "ring", "ulysses", "tp")
#: Ring outside TP and Ulysses: when one image spans nodes, its TP and Ulysses groups stay on one node and only the
#: ring's point-to-point K/V passes cross (`topology.py`).
RING_OUTER = ("dp", "cfg", "ring", "tp", "ulysses")
MESH_ORDERS = {"ulysses-inner": ULYSSES_INNER, "tp-inner": TP_INNER, "ring-outer": RING_OUTER}
#: The default order: ulysses-inner, unless that splits a TP or Ulysses group across nodes and ring-outer does not.
AUTO_ORDER = "auto"


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


def mesh_order(order=ULYSSES_INNER) -> tuple[str, ...]:
    """A validated mesh order: a name of `MESH_ORDERS`, or a permutation of `CP_DIMS` with "ring" before "ulysses"."""
    order = MESH_ORDERS.get(order, order) if isinstance(order, str) else tuple(order)
    if isinstance(order, str) or sorted(order) != sorted(CP_DIMS):
        raise ValueError(
            f"Mesh order {order!r} must be one of {sorted(MESH_ORDERS)} or name each of {CP_DIMS} exactly once "
            "(size-1 dimensions are allowed)."
        )
    if order.index("ring") > order.index("ulysses"):
        raise ValueError(
            f"Mesh order {order} puts 'ulysses' before 'ring', but diffusers' ContextParallelConfig slices "
            "mesh['ring', 'ulysses'], which needs 'ring' first. Swap them."
        )
    return order


def check_cp_degrees(world_size: int, *, tp: int, ulysses: int, ring: int, cfg: int = 1) -> None:
    """Reject degrees whose image groups (tp x ulysses x ring ranks, times a CFG pair) cannot tile the world."""
    for name, degree in (("tp", tp), ("ulysses", ulysses), ("ring", ring)):
        if degree < 1:
            raise ValueError(f"--{name} {degree}: a parallel degree is a positive number of ranks.")
    group = cfg * tp * ulysses * ring
    if world_size % group:
        fitting = [d for d in divisors(world_size) if world_size % (cfg * d) == 0]
        raise ValueError(
            f"cfg x tp x ulysses x ring = {cfg} x {tp} x {ulysses} x {ring} = {group} ranks per replica does not "
            f"divide the world size {world_size}: every rank must belong to exactly one image group of the same size. "
            f"Group sizes (tp x ulysses x ring) that fit {world_size} rank(s){' with CFG pairs' if cfg > 1 else ''}: "
            f"{fitting}. Change the degrees, or launch a multiple of {group} ranks."
        )


def init_distributed(tp: int | None = None, *, ulysses: int = 1, ring: int = 1, cfg: int = 1,
                     order=AUTO_ORDER, cross_node: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> DeviceMesh:
    """Join (or start) the process group and return the mesh: ("dp", "tp"), ("dp", "cfg", "tp") for `cfg=2`, and all
    of `CP_DIMS` in `order` when `ulysses` or `ring` is above 1 (context parallelism).

    `tp` defaults to the world size divided by `cfg x ulysses x ring` (one replica); `dp = world // (cfg x tp x
    ulysses x ring)` replicas then run independent work. With `cfg=2` each replica is a pair of image groups that
    computes the cond and uncond branches of true classifier-free guidance at the same time (`load_pipeline(...)
    .generate` does it for you). `order` (context parallelism only) decides which dimension's groups are contiguous
    runs of ranks, see `MESH_ORDERS` ("auto": node-aware, `mesh_layout`). Across torchrun nodes a layout that puts one
    TP or Ulysses group on several nodes is refused before the process group starts, unless `cross_node`.
    `timeout_s` bounds every collective, so a dead rank makes the others fail with an error instead of hanging
    forever. Calling it again returns a mesh over the existing group.
    """
    runtime = detect_runtime()
    tp = max(runtime.world_size // (cfg * ulysses * ring), 1) if tp is None else tp
    check_cfg_degree(cfg, tp, runtime.world_size)
    check_tp_degree(tp, runtime.world_size)
    check_cp_degrees(runtime.world_size, tp=tp, ulysses=ulysses, ring=ring, cfg=cfg)
    nodes = detect_nodes(runtime.world_size)
    names, sizes = mesh_layout(runtime.world_size, tp=tp, ulysses=ulysses, ring=ring, cfg=cfg, order=order,
                               nodes=nodes)
    check_node_local(sizes, names, nodes, cross_node=cross_node)

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
            dist.init_process_group(runtime.backend, timeout=timeout, **_attempt_store(runtime, timeout))
    return init_device_mesh(runtime.device_type, tuple(sizes[name] for name in names), mesh_dim_names=names)


#: Where global rank 0 of each torchrun attempt publishes "<attempt>:<port>" of that attempt's own store, in the agent's
#: store; and the count of attempts so far, the group's restarts.
_ATTEMPT_KEY, _ATTEMPTS_KEY = "neuron_diffusers/attempt", "neuron_diffusers/attempts"
#: How long one try to reach a published attempt store waits: a killed attempt's store refuses at once.
_ATTEMPT_CONNECT_S = 2.0
_group_restarts: int | None = None


def _attempt_store(runtime: Runtime, timeout: timedelta) -> dict:
    """Under torchrun's agent store, a store of this restart attempt's own (keyword arguments of
    `init_process_group`; empty elsewhere, where the env:// default does).

    torch 2.14's workers connect straight to the agent's TCP store, which outlives a group across
    `--max-restarts`: keys a killed attempt left (gloo's peer addresses, a half-entered call of ours) would pair the
    restarted ranks with the dead ones (measured: "Connection refused" at the first new subgroup). A prefix per
    `TORCHELASTIC_RESTART_COUNT` is not enough across nodes: only the agent whose worker failed counts a restart, the
    others restart on the membership change with their count unchanged (measured: node 1 waited for
    `attempt_1` keys while node 0 wrote `attempt_0`). So rank 0 of each attempt serves a fresh store beside the
    agent's, on node 0 where the agent's store is, and publishes its port there; the others connect to it.
    """
    global _group_restarts
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return {}
    host = os.environ["MASTER_ADDR"]
    agent = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), runtime.world_size, is_master=False, timeout=timeout)
    if runtime.rank == 0:
        store = dist.TCPStore(host, 0, runtime.world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        _group_restarts = agent.add(_ATTEMPTS_KEY, 1) - 1
        agent.set(_ATTEMPT_KEY, f"{_group_restarts}:{store.port}")
    else:
        _group_restarts, store = _join_attempt(agent, host, runtime.world_size, timeout)
    return {"store": store, "rank": runtime.rank, "world_size": runtime.world_size}


def _join_attempt(agent, host: str, world_size: int, timeout: timedelta) -> tuple[int, dist.TCPStore]:
    """(attempt, store) that rank 0 of this attempt published. What is published may still be a killed attempt's,
    whose store is gone with its rank 0 (the connection is refused): read again until this attempt's is there."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        if not wait_keys(agent, [_ATTEMPT_KEY], deadline - time.monotonic()):  # polls: a SIGTERM is handled at once
            raise RuntimeError(f"Rank 0 of this torchrun attempt published no store within {timeout}: it failed "
                               "or is stuck before joining (its log says why).")
        attempt, port = agent.get(_ATTEMPT_KEY).decode().split(":")
        try:
            store = dist.TCPStore(host, int(port), world_size, is_master=False,
                                  timeout=timedelta(seconds=_ATTEMPT_CONNECT_S))
        except dist.DistError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
            continue
        store.set_timeout(timeout)
        return int(attempt), store


def group_restarts() -> int:
    """How many times torchrun restarted this process group (0: its first start, or not under torchrun)."""
    if _group_restarts is not None:
        return _group_restarts
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def mesh_layout(world_size: int, *, tp: int, ulysses: int = 1, ring: int = 1, cfg: int = 1, order=AUTO_ORDER,
                nodes: Nodes | None = None) -> tuple[tuple[str, ...], dict[str, int]]:
    """The mesh's dimension names, in order, and their sizes: ("dp", "tp") or ("dp", "cfg", "tp") without context
    parallelism (TP innermost), all of `CP_DIMS` in `order` with it. "auto" takes ulysses-inner where it keeps every
    TP and Ulysses group on one of `nodes` (always, on one node), else ring-outer where that does."""
    sizes = {"dp": world_size // (cfg * tp * ulysses * ring), "cfg": cfg, "tp": tp, "ring": ring, "ulysses": ulysses}
    if ulysses * ring == 1:
        return (("dp", "tp") if cfg == 1 else ("dp", "cfg", "tp")), sizes
    if order != AUTO_ORDER:
        return mesh_order(order), sizes
    nodes = nodes or Nodes(1, world_size)
    local = [candidate for candidate in (ULYSSES_INNER, RING_OUTER) if not split_dims(sizes, candidate, nodes)]
    return (local or [ULYSSES_INNER])[0], sizes


def build_mesh(device_type: str, world_size: int, *, tp: int = 1, ulysses: int = 1, ring: int = 1, cfg: int = 1,
               order=ULYSSES_INNER) -> DeviceMesh:
    """A mesh with all five of `CP_DIMS` in `order` (size 1 allowed); dp takes whatever the others leave."""
    order = mesh_order(order)
    check_cp_degrees(world_size, tp=tp, ulysses=ulysses, ring=ring, cfg=cfg)
    sizes = {"dp": world_size // (cfg * tp * ulysses * ring), "cfg": cfg, "tp": tp, "ring": ring, "ulysses": ulysses}
    return init_device_mesh(device_type, tuple(sizes[name] for name in order), mesh_dim_names=order)


def dim_size(mesh: DeviceMesh, name: str) -> int:
    """The size of the mesh's dimension `name`; 1 for a dimension the mesh does not have."""
    names = mesh.mesh_dim_names or ()
    return mesh.shape[names.index(name)] if name in names else 1


def dim_rank(mesh: DeviceMesh, name: str) -> int:
    """This rank's coordinate along `name`; 0 for a dimension the mesh does not have."""
    return mesh[name].get_local_rank() if name in (mesh.mesh_dim_names or ()) else 0


IMAGE_DIMS = ("tp", "ring", "ulysses")
_IMAGE_GROUPS: dict = {}


def image_group(mesh: DeviceMesh):
    """The process group of this rank's image group: the mesh's "tp", "ring" and "ulysses" dimensions together.

    Without context parallelism that is the TP group. With it, the group is created on first use for this mesh, by
    every rank of the world at once (a collective: call it on all ranks, as `load_pipeline` and the job do), with
    public `new_subgroups_by_enumeration`; its rank 0 is the group's leader (`is_group_leader`).
    """
    names = mesh.mesh_dim_names or ()
    if "ring" not in names and "ulysses" not in names:
        return mesh["tp"].get_group()
    key = (names, tuple(mesh.mesh.flatten().tolist()))
    if key not in _IMAGE_GROUPS:
        inner = [names.index(name) for name in IMAGE_DIMS]
        outer = [i for i in range(len(names)) if i not in inner]
        layout = mesh.mesh.permute(*outer, *inner).reshape(-1, math.prod(mesh.shape[i] for i in inner))
        _IMAGE_GROUPS[key], _ = dist.new_subgroups_by_enumeration(layout.tolist())
    return _IMAGE_GROUPS[key]


def replica_ranks(mesh: DeviceMesh, *, with_cfg: bool) -> list[int]:
    """The global ranks that make this rank's images together: its image group (TP x ring x Ulysses), and with
    `with_cfg` its CFG partner group too. Plain mesh arithmetic: no collective, no process group created."""
    names = mesh.mesh_dim_names or ()
    together = set(IMAGE_DIMS) | ({"cfg"} if with_cfg else set())
    index = tuple(slice(None) if name in together else coordinate
                  for name, coordinate in zip(names, mesh.get_coordinate(), strict=True))
    return mesh.mesh[index].flatten().tolist()


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


def is_group_leader(mesh: DeviceMesh) -> bool:
    """Rank 0 of this process's image group (its TP group; with context parallelism its TP x ring x Ulysses ranks):
    the one that encodes, decodes and saves for the group."""
    return all(dim_rank(mesh, name) == 0 for name in IMAGE_DIMS)


def is_tp_leader(mesh: DeviceMesh) -> bool:
    """Deprecated name of `is_group_leader` (the image group's leader, TP x ring x Ulysses); kept one release."""
    warnings.warn("`is_tp_leader` is now `is_group_leader`: the leader of the whole image group, not only of TP.",
                  DeprecationWarning, stacklevel=2)
    return is_group_leader(mesh)


def cfg_size(mesh: DeviceMesh) -> int:
    """2 on a mesh with CFG pairs, else 1."""
    return dim_size(mesh, "cfg")


def cfg_rank(mesh: DeviceMesh) -> int:
    """Which image group of its CFG pair this rank belongs to (0 without pairs): 0 computes cond, 1 uncond."""
    return dim_rank(mesh, "cfg")


def is_replica_leader(mesh: DeviceMesh) -> bool:
    """The TP leader of CFG rank 0: the one rank of its replica that `generate` returns outputs on."""
    return is_group_leader(mesh) and cfg_rank(mesh) == 0


def broadcast_object_from_replica_leader(obj, mesh: DeviceMesh):
    """The replica leader's `obj` on every rank of its replica: over its image group, then to each CFG partner.

    Two hops over the mesh's own groups, so no group spanning a whole replica has to be created.
    """
    box = [obj]
    group = image_group(mesh)  # every rank: creating it is a collective over the world
    if cfg_rank(mesh) == 0:
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
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


#: Seconds between two looks at the store in `wait_keys`: from the first, growing to the last.
POLL_S = (0.001, 0.02)


def wait_keys(store: dist.Store, keys: list[str], timeout_s: float,
              give_up: Callable[[], bool] = lambda: False) -> bool:
    """Whether every key of `keys` is in `store` within `timeout_s` (and before `give_up()` says to stop waiting, e.g.
    once a peer is known dead). Polls with short sleeps instead of one blocking `store.wait`: Python runs a signal
    handler only between bytecodes, so a SIGTERM (torchrun's, after a peer died) waited out a blocking wait, and
    torchrun SIGKILLs after 30 s (measured: 30.9 s, now 0.6 s); in a sleep it is handled at once."""
    deadline, pause = time.monotonic() + timeout_s, POLL_S[0]
    while not store.check(keys):
        if give_up() or time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 1.5, POLL_S[1])
    return True


#: How long the store's host (rank 0) waits, after leaving together, for the others' last store call.
STORE_LAST_S = 5.0


def leave_together(timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Wait (at most `timeout_s`) until every rank of the world is here, through the store: no collective is in
    flight on any rank afterwards, so tearing the process group down cannot cut a peer off mid-message.

    Returns False when some rank did not come in time (it failed or died): leaving anyway is then right.

    Rank 0 serves the group's store (env://, and under torchrun `_attempt_store`): it leaves only after the others
    said their store calls are over (at most `STORE_LAST_S`), or a peer still polling would read a reset connection
    and print torch's "recvValue failed ... Connection reset by peer" on its way out.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    store, rank, world = default_store(), dist.get_rank(), dist.get_world_size()
    store.set(f"neuron_diffusers/leave/{rank}", "1")
    try:
        together = wait_keys(store, [f"neuron_diffusers/leave/{r}" for r in range(world)], timeout_s)
        if rank:
            store.set(f"neuron_diffusers/left/{rank}", "1")  # this rank's last store call
        elif together:
            wait_keys(store, [f"neuron_diffusers/left/{r}" for r in range(1, world)], STORE_LAST_S)
        return together
    except dist.DistError:  # a peer is gone (its store connection closed)
        return False


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
