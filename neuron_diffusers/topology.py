"""Which ranks share a node, and which of a mesh's groups cross nodes: plain arithmetic, no process group.

torchrun numbers ranks node by node (node `GROUP_RANK` holds ranks `GROUP_RANK x LOCAL_WORLD_SIZE` onwards, every
node the same count), and `init_device_mesh` lays ranks out as `arange(world).reshape(shape)` in the mesh's dim
order. So whether a mesh dimension's groups stay on one node follows from the shape and order alone, before any
process group exists. TP (two all-reduces per block) and Ulysses (four all-to-alls per attention) must stay where the
fast links are; data parallelism (nothing per step), CFG pairs (one exchange per step) and ring attention (K/V
passed point to point, overlappable) may cross. Every fact here is checked in tests/test_topology.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

#: The dimensions whose groups must stay on one node unless asked otherwise: their collectives run every block.
NODE_LOCAL_DIMS = ("tp", "ulysses")


@dataclass(frozen=True)
class Nodes:
    """`count` nodes of `ranks_per_node` ranks each, numbered as torchrun numbers them."""

    count: int
    ranks_per_node: int

    def of(self, rank: int) -> int:
        return rank // self.ranks_per_node


def detect_nodes(world_size: int) -> Nodes:
    """The nodes of this job from torchrun's `LOCAL_WORLD_SIZE` (one node when it is unset: a plain `python` run).

    torchrun gives every node the same `--nproc-per-node`, so the world is `count x ranks_per_node`; anything else
    means the environment was not set by torchrun, and is refused rather than guessed.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if local < 1 or world_size % local:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local} does not divide the world size {world_size}: every node must run the same "
            "number of ranks (torchrun's --nproc-per-node). Launch with torchrun, or set LOCAL_WORLD_SIZE to the "
            "ranks per node.")
    return Nodes(world_size // local, local)


def rank_layout(sizes: dict[str, int], order: tuple[str, ...]) -> torch.Tensor:
    """The global rank at each mesh coordinate, as `init_device_mesh` lays them out for dims `order`."""
    shape = tuple(sizes.get(name, 1) for name in order)
    return torch.arange(math.prod(shape)).reshape(shape)


def groups_of(layout: torch.Tensor, order: tuple[str, ...], name: str) -> list[list[int]]:
    """The rank groups along mesh dimension `name` (each group: the ranks that differ only in that coordinate)."""
    index = order.index(name)
    return layout.movedim(index, -1).reshape(-1, layout.shape[index]).tolist()


def crossing_groups(sizes: dict[str, int], order: tuple[str, ...], nodes: Nodes) -> dict[str, int]:
    """For each dimension of size above 1: how many of its groups span more than one node."""
    layout = rank_layout(sizes, order)
    return {name: sum(len({nodes.of(rank) for rank in group}) > 1 for group in groups_of(layout, order, name))
            for name in order if sizes.get(name, 1) > 1}


def split_dims(sizes: dict[str, int], order: tuple[str, ...], nodes: Nodes) -> list[str]:
    """The node-local dimensions (`NODE_LOCAL_DIMS`) whose groups this layout would split across nodes."""
    crossing = crossing_groups(sizes, order, nodes)
    return [name for name in NODE_LOCAL_DIMS if crossing.get(name)]


def check_node_local(sizes: dict[str, int], order: tuple[str, ...], nodes: Nodes, *,
                     cross_node: bool = False) -> None:
    """Refuse a layout that splits a TP or Ulysses group across nodes, unless `cross_node` asks for it."""
    split = split_dims(sizes, order, nodes)
    if not split or cross_node:
        return
    degrees = ", ".join(f"{name}={sizes[name]}" for name in split)
    raise ValueError(
        f"{degrees} would put ranks of one {'/'.join(split)} group on different nodes ({nodes.count} nodes of "
        f"{nodes.ranks_per_node} ranks): those groups run collectives in every block, which then cross the network. "
        f"Keep tp x ulysses within {nodes.ranks_per_node} ranks (a divisor of it), use --ring, --cfg-parallel or "
        "data parallelism across nodes, or pass --cross-node to run it anyway.")
