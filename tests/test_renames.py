"""Renamed public names keep working for one release, with a DeprecationWarning naming the new one (issue #33)."""

import re
from pathlib import Path

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


#: The one prefix of the state the package keeps on diffusers objects (an attribute where a hook or a compiled
#: forward reads it: `_nd_tp_mesh`, `_nd_hoist`, `_nd_group_cache`, ...).
PREFIX = "_nd_"
_STATE_NAME = re.compile(r"\b_(?:nd|neuron_diffusers|neurondiffusers|ndiff)_\w+")


def state_names(source: str) -> set[str]:
    """Every attribute-like name with one of the package's prefixes, in code and strings alike."""
    return set(_STATE_NAME.findall(source))


def test_state_on_diffusers_objects_has_one_prefix():
    package = Path(nd.__file__).parent
    names = {name for path in package.rglob("*.py") for name in state_names(path.read_text())}
    assert names and all(name.startswith(PREFIX) for name in names), sorted(names)


def test_prefix_check_sees_a_second_prefix():
    """Control: the old second prefix is found, in a string as in an attribute."""
    assert state_names('HANDLE = "_neuron_diffusers_parallel_vae"; m._nd_hoist = 1') == {
        "_neuron_diffusers_parallel_vae", "_nd_hoist"}
