"""Node-aware meshes: TP and Ulysses groups stay on one torchrun node, DP, CFG pairs and ring cross; a layout that
would split a TP or Ulysses group across nodes is refused before anything starts, unless asked for."""

import os

import pytest

from neuron_diffusers.distributed import RING_OUTER, ULYSSES_INNER, init_distributed, mesh_layout
from neuron_diffusers.topology import Nodes, check_node_local, crossing_groups, detect_nodes, groups_of, rank_layout

TWO_NODES = Nodes(2, 8)  # two trn2 / 8-GPU nodes as 16 ranks


def _nodes_of(groups: list[list[int]], nodes: Nodes) -> list[set[int]]:
    return [{nodes.of(rank) for rank in group} for group in groups]


@pytest.mark.parametrize("degrees", [dict(tp=4, ring=2, ulysses=2), dict(tp=8, ring=2), dict(tp=2, ulysses=4),
                                     dict(tp=8), dict(tp=4, cfg=2), dict(tp=8, cfg=2)])
def test_auto_order_keeps_tp_and_ulysses_groups_on_one_node(degrees):
    names, sizes = mesh_layout(16, nodes=TWO_NODES, **degrees)
    layout = rank_layout(sizes, names)
    for name in ("tp", "ulysses"):
        if name in names:
            assert all(len(nodes) == 1 for nodes in _nodes_of(groups_of(layout, names, name), TWO_NODES)), name
    check_node_local(sizes, names, TWO_NODES)  # accepted as is


def test_one_image_across_two_nodes_puts_ring_across_them():
    names, sizes = mesh_layout(16, tp=4, ring=2, ulysses=2, nodes=TWO_NODES)
    assert names == RING_OUTER
    assert crossing_groups(sizes, names, TWO_NODES) == {"ring": 8, "tp": 0, "ulysses": 0}
    # Control: the single-node default order on the same degrees splits every TP group across the two nodes.
    assert crossing_groups(sizes, ULYSSES_INNER, TWO_NODES)["tp"] == 4
    with pytest.raises(ValueError, match=r"tp=4 would put ranks of one tp group on different nodes .*--cross-node"):
        check_node_local(sizes, ULYSSES_INNER, TWO_NODES)
    check_node_local(sizes, ULYSSES_INNER, TWO_NODES, cross_node=True)  # asked for explicitly


def test_one_node_keeps_the_contiguous_ulysses_order():
    assert mesh_layout(8, tp=2, ring=2, ulysses=2, nodes=Nodes(1, 8))[0] == ULYSSES_INNER
    assert mesh_layout(8, tp=2, ring=2, ulysses=2, order="tp-inner", nodes=Nodes(1, 8))[0][-1] == "tp"


def test_tp_wider_than_a_node_is_refused_with_the_reason():
    names, sizes = mesh_layout(16, tp=16, nodes=TWO_NODES)
    with pytest.raises(ValueError, match=r"tp=16 .* \(2 nodes of 8 ranks\).*within 8 ranks"):
        check_node_local(sizes, names, TWO_NODES)
    names, sizes = mesh_layout(16, tp=8, nodes=TWO_NODES)  # control: one TP group per node
    check_node_local(sizes, names, TWO_NODES)
    # A TP degree that does not divide the node straddles it: 12 ranks per node, tp=8.
    names, sizes = mesh_layout(24, tp=8, nodes=Nodes(2, 12))
    with pytest.raises(ValueError, match="tp=8"):
        check_node_local(sizes, names, Nodes(2, 12))


def test_nodes_come_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert detect_nodes(8) == Nodes(2, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 does not divide the world size 8"):
        detect_nodes(8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert detect_nodes(8) == Nodes(1, 8)  # a plain run: one node


def test_generate_refuses_a_tp_group_across_nodes(monkeypatch, generate_refuses):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    generate_refuses(["--model", "flux", "--prompt", "a fox", "--tp", "4"],
                     "tp=4 would put ranks of one tp group on different nodes")


def _real_mesh_groups() -> dict:
    """On 4 pool ranks posing as 2 nodes of 2: the meshes init_distributed builds, and what it refuses."""
    previous = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        mesh = init_distributed(tp=2, ring=2)
        report = {"order": mesh.mesh_dim_names, "tp": mesh["tp"].mesh.tolist(), "ring": mesh["ring"].mesh.tolist()}
        try:
            init_distributed(tp=2, ring=2, order="ulysses-inner")
        except ValueError as error:
            report["refused"] = str(error)
        report["crossing_allowed"] = init_distributed(tp=2, ring=2, order="ulysses-inner",
                                                      cross_node=True)["tp"].mesh.tolist()
        return report
    finally:
        if previous is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = previous


def test_init_distributed_builds_the_node_aware_mesh(rank_pool):
    """The layout arithmetic is the mesh torch builds: each rank's TP group lies on its own node, its ring pair
    crosses; the single-node order is refused there, and runs (crossing) when asked for."""
    for rank, report in enumerate(rank_pool.run(_real_mesh_groups, 4)):
        assert report["order"] == RING_OUTER
        assert {member // 2 for member in report["tp"]} == {rank // 2}, report
        assert len({member // 2 for member in report["ring"]}) == 2, report
        assert "tp=2 would put ranks of one tp group on different nodes" in report["refused"]
        assert len({member // 2 for member in report["crossing_allowed"]}) == 2


def test_plan_report_shows_which_collectives_cross_nodes():
    from neuron_diffusers.tools.plan.layout_report import format_layouts, layouts_report

    report = layouts_report("flux", 16, nodes=4)  # 4 nodes of 4 ranks
    assert report["nodes"] == 4
    for row in report["layouts"]:
        # TP=8 cannot fit a 4-rank node: named, not hidden; everything else keeps TP and Ulysses on a node.
        assert ("split-node" in row["notes"]) == (row["tp"] * row["ulysses"] > 4), row
        if "split-node" not in row["notes"]:
            assert not {"tp", "ulysses"} & set(row["crosses_nodes"]), row
        expected = sum(row["sent_gb"][kind] for name in row["crosses_nodes"]
                       for kind in {"ring": ["ring"], "cfg": ["cfg"], "dp": [], "ulysses": ["all_to_all"],
                                    "tp": ["all_reduce", "all_gather"]}[name])
        assert row["inter_node_gb"] == pytest.approx(expected)
    one_image = [row for row in report["layouts"] if row["dp"] == 1 and row["ring"] > 1 and "split-node" not in
                 row["notes"]]
    assert one_image and all(row["crosses_nodes"] == ["ring"] and row["inter_node_gb"] > 0 for row in one_image)
    assert "x-node" in format_layouts(report) and "split-node:" in format_layouts(report)
    with pytest.raises(ValueError, match="--nodes 3 does not divide --cores 16"):
        layouts_report("flux", 16, nodes=3)
