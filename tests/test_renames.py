"""Renamed public names keep working for one release, with a DeprecationWarning naming the new one (issue #33)."""

import pytest

import neuron_diffusers as nd
from neuron_diffusers import runner


def test_tppipeline_is_parallelpipeline_with_a_warning():
    with pytest.warns(DeprecationWarning, match="ParallelPipeline"):
        assert runner.TPPipeline is runner.ParallelPipeline


def test_is_tp_leader_is_is_group_leader_with_a_warning():
    class OneRankMesh:  # a stand-in mesh: rank 0 on every image dimension
        mesh_dim_names = ("dp", "tp")

        def __getitem__(self, name):
            return type("Dim", (), {"get_local_rank": lambda self: 0})()

    with pytest.warns(DeprecationWarning, match="is_group_leader"):
        assert nd.is_tp_leader(OneRankMesh()) is nd.is_group_leader(OneRankMesh()) is True
