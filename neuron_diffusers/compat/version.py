"""The version gate: the diffusers releases whose privates `compat` was written against.

The pin is stated once, in pyproject.toml's `dependencies`, and read from there: from the installed package's
metadata, or, in a source tree that was never pip-installed, from the pyproject.toml beside the package. A release
outside it is refused before any private module is imported (`compat/__init__.py` calls `check_diffusers_version`
first), so a renamed private fails with the fix, not deep inside a load.
"""

from __future__ import annotations

import functools
import importlib.metadata
import pathlib

import diffusers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: only an installed package (its metadata) can be read
    tomllib = None

_DISTRIBUTION = "neuron-diffusers"
_PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"


def _diffusers_requirement(requirements: list[str]) -> SpecifierSet:
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name == "diffusers" and requirement.marker is None:
            return requirement.specifier
    raise RuntimeError(f"{_DISTRIBUTION} declares no diffusers dependency: pyproject.toml must pin the diffusers "
                       "series whose private internals `neuron_diffusers.compat` extends.")


@functools.cache
def pinned_diffusers() -> SpecifierSet:
    """The diffusers specifier in pyproject.toml (e.g. `~=0.42.1`), from the installed metadata or the source tree."""
    try:
        requirements = importlib.metadata.requires(_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:  # a source tree that was not pip-installed
        if tomllib is None:
            raise RuntimeError(f"{_DISTRIBUTION} is not installed and Python 3.10 cannot read {_PYPROJECT}: "
                               "`pip install -e .` the source tree.") from None
        with _PYPROJECT.open("rb") as file:
            requirements = tomllib.load(file)["project"]["dependencies"]
    return _diffusers_requirement(requirements)


def check_diffusers_version(version: str | None = None) -> None:
    """Refuse a diffusers release (default: the installed one) outside the pinned series."""
    version = diffusers.__version__ if version is None else version
    pin = pinned_diffusers()
    if not pin.contains(version, prereleases=True):
        raise ImportError(
            f"neuron_diffusers needs diffusers{pin} (found {version}): it extends diffusers' private "
            f"tensor-parallel internals, which differ between releases. Install it with `pip install 'diffusers{pin}'`."
        )
