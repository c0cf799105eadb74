"""Shared fixtures: tiny checkpoints built once per session, and a hermetic model cache."""

import pytest

from neuron_diffusers import tiny

IMAGE_FAMILIES = ("flux", "flux2", "qwenimage", "qwenimage21")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(family)` → folder of that family's tiny pipeline (seed 0), built on first use."""
    built = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(family: str):
        if family not in built:
            built[family] = tiny.build_tiny(family, root / family, seed=0)
        return built[family]

    return get


@pytest.fixture(autouse=True)
def _hermetic_cache(tmp_path_factory, monkeypatch):
    """Embedded tiny models go to a per-session cache, never the user's ~/.cache."""
    monkeypatch.setenv("NEURON_DIFFUSERS_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
