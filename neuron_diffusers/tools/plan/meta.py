"""A transformer built on the `meta` device from a name or a folder: shapes only, no weight read or allocated.

`plan report`, `plan check` and `bench memory` measure plans on these: a 60 GiB model takes a second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch

from ... import families
from ...families import Family


@dataclass(frozen=True)
class MetaModel:
    #: "FluxTransformer2DModel (default config)" or "... (config of DIR)".
    description: str
    #: The family whose plan is written for the class (None for a class we have no plan for).
    family: Family | None
    module: torch.nn.Module
    #: "default" (a family's or class's default config) or "checkpoint" (a folder's config).
    config: str


def meta_transformer(model: str) -> MetaModel:
    """A family name or a diffusers class name (its full-size default config), or a folder: a pipeline checkpoint
    (its `transformer/config.json`) or a model folder (`config.json`), whose class comes from the config's
    `_class_name`, so classes without a plan of ours work too."""
    if families.is_family(model):
        family = families.get(model)
        cls = family.model_class()
        with torch.device("meta"):
            return MetaModel(f"{cls.__name__} (default config)", family, cls(), "default")
    path = Path(model)
    if path.is_dir():
        folder = path / "transformer" if (path / "transformer" / "config.json").is_file() else path
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} has neither transformer/config.json nor config.json: pass a pipeline "
                                    "folder or a model folder that `save_pretrained` wrote, or name a model class.")
        cls = _model_class(json.loads(config_file.read_text()).get("_class_name"), str(config_file))
        with torch.device("meta"):
            module = cls.from_config(cls.load_config(folder))
        return MetaModel(f"{cls.__name__} (config of {folder})", families.by_model_class(cls.__name__), module,
                         "checkpoint")
    if "/" in model or model.startswith("."):
        raise FileNotFoundError(f"Model folder {model} does not exist.")
    cls = _model_class(model, "the model to check against")
    with torch.device("meta"):
        return MetaModel(f"{model} (default config)", families.by_model_class(model), cls(), "default")


def _model_class(name: str | None, source: str):
    cls = getattr(diffusers, name, None) if name else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        names = ", ".join(f.name for f in families.FAMILIES)
        raise ValueError(f"'{name}' ({source}) is not a diffusers model class. Give a class diffusers exports (e.g. "
                         f"HunyuanVideoTransformer3DModel), a family ({names}) or a checkpoint folder.")
    return cls
