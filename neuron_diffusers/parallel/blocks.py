"""A model's repeated blocks as classes: what `compile` compiles and the step cache hooks, matched with `isinstance`.

diffusers spells a model's blocks by class name (`_repeated_blocks`, an adapter's `compiled_blocks`); matching a
module by comparing its class's name would miss nothing today but also match any same-named class, and it is the
string branch the package avoids. So a name is resolved once to the class it names, then every match is `isinstance`.
"""

from __future__ import annotations

import sys

import torch

#: Block metadata diffusers lacks, pushed in by the family registry (each family's `CACHE_BLOCK_METADATA`, in
#: `tp_plans/<family>.py`; `families.install`): {block class name: (index of `hidden_states` in the block's output,
#: index of `encoder_hidden_states` or None)}. This module never names a family.
_CACHE_METADATA: dict[str, tuple] = {}


def add_cache_metadata(metadata: dict[str, tuple]) -> None:
    """Register block metadata, read at each lookup by `cache_metadata_for`."""
    _CACHE_METADATA.update(metadata)


def cache_metadata_for(model: torch.nn.Module, cls: type) -> tuple | None:
    """The registered cache metadata of block class `cls` of `model` (or of a class it derives from), or None."""
    for name, metadata in _CACHE_METADATA.items():
        types = block_types_of(model, [name])
        if types and issubclass(cls, types):
            return metadata
    return None


def cache_metadata_names() -> dict[str, tuple]:
    """Every registered block class name -> its metadata (for messages and the deprecated `OWN_BLOCK_METADATA`)."""
    return dict(_CACHE_METADATA)


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
