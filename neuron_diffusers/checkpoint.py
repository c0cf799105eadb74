"""What a saved pipeline folder says about itself, read from its JSON files only (no weights, no imports).

A stock pipeline lists its components in `model_index.json`; a modular one (MiniMax-H3) in
`modular_model_index.json`, where an entry may name its class only inside its loading spec. Every reader of
either goes through here.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import tiny

INDEX_FILES = ("model_index.json", "modular_model_index.json")


def read_index(checkpoint: Path) -> dict:
    """The pipeline index of `checkpoint`: `model_index.json`, else `modular_model_index.json`."""
    for name in INDEX_FILES:
        path = Path(checkpoint) / name
        if path.is_file():
            return json.loads(path.read_text())
    raise FileNotFoundError(
        f"{checkpoint} has neither model_index.json nor modular_model_index.json: point at the folder that a "
        f"pipeline's `save_pretrained` wrote, or name a tiny family ({', '.join(tiny.FAMILIES)})."
    )


def pipeline_class_name(checkpoint: Path) -> str:
    """The stock pipeline's `_class_name`, or a modular pipeline's `_blocks_class_name` ("" if it names none)."""
    index = read_index(checkpoint)
    return index.get("_blocks_class_name", index.get("_class_name", ""))


def component_names(checkpoint: Path) -> list[str]:
    """The components the index lists: `[library, class, ...]` entries, not config values."""
    return [name for name, entry in read_index(checkpoint).items() if not name.startswith("_") and isinstance(entry, list)]


def component_class_name(checkpoint: Path, name: str) -> str:
    """The diffusers class of component `name`."""
    entry = read_index(checkpoint).get(name)
    if entry is None:
        raise ValueError(f"The pipeline index of {checkpoint} lists no '{name}' component.")
    if entry[0] != "diffusers":
        raise ValueError(f"The {name} of {checkpoint} is a {entry[0]}.{entry[1]}, not a diffusers model.")
    # `[library, class]`, or a modular `[library, class, spec]` whose spec may carry the class alone.
    return entry[1] or entry[2]["type_hint"][1]


def read_config(checkpoint: Path, component: str) -> dict:
    """`component/config.json`."""
    return json.loads((Path(checkpoint) / component / "config.json").read_text())
