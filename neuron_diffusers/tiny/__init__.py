"""Tiny random checkpoints of every supported family, built offline in seconds.

Each family module builds the *complete* stock pipeline (tokenizers included) from a seed and
`save_pretrained`s it in the standard layout, so tests and offline demos exercise exactly the stock
loaders and pipelines that real checkpoints go through.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from .. import families


def __getattr__(name: str):
    """`FAMILIES` (the families with a tiny pipeline: every family whose pipelines run here) and `NAMES` (every
    tiny checkpoint: one per family, then those of further stock classes, `qwenimage_edit`), read from the registry
    at each use, so a family registered later (`families.register`) is among them."""
    if name == "FAMILIES":
        return families.PIPELINE_FAMILIES
    if name == "NAMES":
        return families.TINY_CHECKPOINTS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _family_module(family: str):
    return families.tiny_module(family)


def default_size(family: str) -> tuple[int, int]:
    """A small (height, width) the family's tiny pipeline generates at in well under a second."""
    return _family_module(family).DEFAULT_SIZE


def smallest_call(family: str) -> dict:
    """Size and steps of the quickest generation that still exercises every step kind: two transformer forwards
    (each tiny module's `SMALLEST_CALL`)."""
    height, width = default_size(family)
    return dict(height=height, width=width, **_family_module(family).SMALLEST_CALL)


def build_tiny(family: str, path: str | os.PathLike, seed: int = 0) -> Path:
    """Build `family`'s tiny pipeline into `path`, which must not exist or be empty.

    The build happens in a temporary sibling folder that is renamed into place at the end, so an
    interrupted build never leaves a half-written checkpoint behind.
    """
    module = _family_module(family)
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"Cannot build the tiny '{family}' pipeline into {path}: it exists and is not empty. "
                              "Pick a new folder or delete this one.")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        module.build(staging, seed=seed)
        if path.exists():
            path.rmdir()
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("NEURON_DIFFUSERS_CACHE", Path.home() / ".cache" / "neuron_diffusers"))


def _builder_digest(family: str) -> str:
    """A hash of the code that builds `family`, so the cache never serves a checkpoint of older code."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        if source.stem in (family, "__init__") or source.stem.startswith("_"):
            digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def cached_tiny(family: str, seed: int = 0) -> Path:
    """The tiny checkpoint for (`family`, `seed`) in the cache, built on first use.

    Safe against concurrent builders: each builds into its own staging folder and the first rename
    wins; the others discard theirs.
    """
    _family_module(family)  # an unknown family fails here, before touching the cache
    path = cache_dir() / "tiny" / f"{family}-seed{seed}-{_builder_digest(family)}"
    if path.is_dir() and any(path.iterdir()):
        return path
    try:
        if _in_process_group():
            _build_in_subprocess(family, path, seed)
        else:
            build_tiny(family, path, seed=seed)
    except (FileExistsError, OSError, subprocess.CalledProcessError):
        if not (path.is_dir() and any(path.iterdir())):
            raise
    return path


def _in_process_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _build_in_subprocess(family: str, path: Path, seed: int) -> None:
    """Build in a fresh interpreter: inside a process group, transformers' `save_pretrained` writes weights on
    rank 0 only, so a build by any other rank would be renamed into the cache without its text encoder's weights."""
    command = [sys.executable, "-m", "neuron_diffusers", "tiny", family, str(path), "--seed", str(seed)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Shell users spell checkpoint names with hyphens (`qwenimage-edit`); the registry's names are identifiers.
    parser.add_argument("family", type=lambda name: name.replace("-", "_"),
                        help=f"one of: {', '.join(families.TINY_CHECKPOINTS)} (hyphens for underscores also work)")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> None:
    """`neuron-diffusers tiny FAMILY DIR`: build and print the folder."""
    print(build_tiny(args.family, args.dir, seed=args.seed))
