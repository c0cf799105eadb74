"""A model's repeated blocks as classes: what `compile` compiles and the step cache hooks, matched with `isinstance`.

diffusers spells a model's blocks by class name (`_repeated_blocks`, an adapter's `compiled_blocks`); matching a
module by comparing its class's name would miss nothing today but also match any same-named class, and it is the
string branch the package avoids. So a name is resolved once to the class it names, then every match is `isinstance`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

#: Where the cache finds block metadata diffusers lacks: callables returning {block class name: (index of
#: `hidden_states` in the block's output, index of `encoder_hidden_states` or None)}. The family registry adds one
#: (each family's `CACHE_BLOCK_METADATA`, in `tp_plans/<family>.py`); this module never names a family.
_CACHE_METADATA_SOURCES: list[Callable[[], dict[str, tuple]]] = []


def add_cache_metadata_source(source: Callable[[], dict[str, tuple]]) -> None:
    """Register `source`, read (lazily, at each lookup) by `cache_metadata_for`."""
    if source not in _CACHE_METADATA_SOURCES:
        _CACHE_METADATA_SOURCES.append(source)


def cache_metadata_for(model: torch.nn.Module, cls: type) -> tuple | None:
    """The registered cache metadata of block class `cls` of `model` (or of a class it derives from), or None."""
    for source in _CACHE_METADATA_SOURCES:
        for name, metadata in source().items():
            types = block_types_of(model, [name])
            if types and issubclass(cls, types):
                return metadata
    return None


def cache_metadata_names() -> dict[str, tuple]:
    """Every registered block class name -> its metadata (for messages and the deprecated `OWN_BLOCK_METADATA`)."""
    return {name: metadata for source in _CACHE_METADATA_SOURCES for name, metadata in source().items()}


def block_types_of(model: torch.nn.Module, names) -> tuple[type, ...]:
    """The classes `names` name (diffusers' `_repeated_blocks` spelling: class names, or the classes themselves), so
    blocks are matched with `isinstance` (a block swapped to a subclass, as `coalesce` does, still matches).

    A name is looked up, not compared, in the modules defining the classes in `model`'s tree (where diffusers
    defines a model's blocks); a name that none defines matches nothing, as stock `compile_repeated_blocks` skips it.
    """
    namespaces = dict.fromkeys(sys.modules.get(base.__module__) for module in model.modules()
                               for base in type(module).__mro__)
    found = []
    for name in names:
        if isinstance(name, type):
            found.append(name)
            continue
        cls = next((getattr(space, name) for space in namespaces if isinstance(getattr(space, name, None), type)), None)
        if cls is not None:
            found.append(cls)
    return tuple(found)
