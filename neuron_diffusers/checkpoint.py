"""A model the user named, resolved once into a `Checkpoint`: its folder, pipeline index, family and configs.

The user names a checkpoint folder, a Hub id or a tiny family; `resolve` turns that into a local folder, reads
its pipeline index (`model_index.json`, or a modular pipeline's `modular_model_index.json`, where an entry may name
its class only inside its loading spec) and finds the family. Every later step (checks, loading, the job) reads
from that one value instead of going back to the disk, so the CLI path reads each JSON file once. No weights are
read and nothing heavy is imported.

The stock class that runs the folder is the one its index names, or another one asked for (`pipeline_class`):
one FLUX.1 folder also runs FluxKontextPipeline, FluxImg2ImgPipeline and FluxInpaintPipeline. The family is then
found by the class's transformer, and a class built on another transformer than the folder's, or one needing a
component the folder lacks, is refused here, naming what is missing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import diffusers
import torch
from huggingface_hub import snapshot_download

from . import families, tiny
from .distributed import check_heads_divisible
from .families import Family, pipeline_record
from .pipelines.base import required_components, transformer_class_name
from .pipelines.generic import DraftedFamily

INDEX_FILES = ("model_index.json", "modular_model_index.json")


@dataclass
class Checkpoint:
    """A local pipeline folder and what its JSON files say about it."""

    path: Path
    #: What the user named: a tiny family, a folder or a Hub id (recorded with every output).
    source: str
    index: dict
    family: Family
    #: The stock class that runs it: the index's, or the `pipeline_class` asked for (see `with_pipeline_class`).
    pipeline_class: str = ""
    _configs: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.pipeline_class = self.pipeline_class or self.pipeline_class_name

    @property
    def pipeline_class_name(self) -> str:
        """The stock pipeline's `_class_name`, or a modular pipeline's `_blocks_class_name` ("" if it names none)."""
        return pipeline_class_name(self.index)

    @functools.cached_property
    def adapter(self):
        """The family's pipeline adapter, driving `pipeline_class`."""
        return self.family.adapter().for_pipeline(pipeline_record(self.family, self.pipeline_class),
                                                  tuple(p.name for p in self.family.pipelines))

    def with_pipeline_class(self, pipeline_class: str | type) -> Checkpoint:
        """This checkpoint run by another stock class on the same transformer; refused (naming what is missing)
        unless diffusers exports the class, it is built on the folder's transformer class and the folder holds every
        component it requires."""
        cls = stock_pipeline_class(pipeline_class)
        wanted = self.component_class_name("transformer")
        runs = transformer_class_name(cls)
        if runs != wanted:
            raise ValueError(
                f"{cls.__name__} runs a {runs}, but {self.path} holds a {wanted}: neuron_diffusers shards the "
                f"folder's transformer with its plan, so the class must be built on that one. Pick a pipeline class "
                f"built on {wanted}, e.g. {', '.join(p.name for p in self.family.pipelines)}."
            )
        present = set(self.component_names())
        missing = [name for name in required_components(cls) if name not in present]
        if missing:
            raise ValueError(
                f"{cls.__name__} needs the component(s) {', '.join(missing)}, which {self.path} does not have (it "
                f"holds {', '.join(sorted(present))}). Use a checkpoint saved for {cls.__name__}."
            )
        checked = dataclasses.replace(self, pipeline_class=cls.__name__)
        checked.adapter  # noqa: B018  -- an adapter that cannot drive the class refuses it now, not at load
        return checked

    def component_names(self) -> list[str]:
        """The components the index lists: `[library, class, ...]` entries, not config values."""
        return [name for name, entry in self.index.items() if not name.startswith("_") and isinstance(entry, list)]

    def component_class_name(self, name: str) -> str:
        """The diffusers class of component `name`."""
        entry = self.index.get(name)
        if entry is None:
            raise ValueError(f"The pipeline index of {self.path} lists no '{name}' component.")
        if entry[0] != "diffusers":
            raise ValueError(f"The {name} of {self.path} is a {entry[0]}.{entry[1]}, not a diffusers model.")
        # `[library, class]`, or a modular `[library, class, spec]` whose spec may carry the class alone.
        return entry[1] or entry[2]["type_hint"][1]

    def config(self, component: str, file: str = "config.json") -> dict:
        """`component/file` (default `config.json`), read once; a missing or broken file is named in the error."""
        key = f"{component}/{file}"
        if key not in self._configs:
            self._configs[key] = _read_json(self.path / key)
        return self._configs[key]

    def transformer_class(self):
        return getattr(diffusers, self.component_class_name("transformer"))

    @property
    def experts(self) -> tuple[str, ...]:
        """The further denoisers this checkpoint holds, of the ones its adapter names (`adapter.experts`, e.g. Wan
        2.2 A14B's low-noise `transformer_2`) and of the transformer's own class: each is sharded with the
        transformer's plan, never loaded whole (Wan 2.1's index entry `[null, null]` is no expert)."""
        main = self.index.get("transformer")
        return tuple(name for name in self.adapter.experts
                     if name in self.component_names() and main is not None and self.index[name][:2] == main[:2])

    def meta(self, component: str) -> torch.nn.Module:
        """Component `component` built from its config on the meta device: its shapes, none of its weights."""
        model_cls = getattr(diffusers, self.component_class_name(component))
        with torch.device("meta"):
            return model_cls.from_config(self.config(component))

    def check_heads(self, tp: int) -> None:
        """Reject a TP degree that does not divide the transformer's attention heads (or, on a drafted plan, that
        the plan does not split evenly), naming the ones that do."""
        check_heads_divisible(str(self.path), self.config("transformer").get("num_attention_heads"), tp)
        if isinstance(self.family, DraftedFamily) and tp not in self.family.degrees:
            raise ValueError(f"The plan drafted for {self.path}'s {self.family.transformer} splits evenly over "
                             f"{', '.join(map(str, self.family.degrees))} ranks only, not tp={tp}: pick one of those.")

    def check_safetensors(self) -> None:
        """The transformer's weights are safetensors (tensor-parallel loading streams each rank's slice out of them;
        other formats would load whole), and every component's files are complete.

        Each JSON file of every component the index lists must parse, each shard a `.index.json` names must exist,
        and each safetensors header must parse and fit its file (a truncated download fails here). Only headers
        are read, so this costs milliseconds, and it runs on every rank before the process group starts: a broken
        file is named at once, instead of failing on the one rank that loads that component mid-load.
        """
        folder = self.path / "transformer"
        if folder.is_dir() and not any(folder.glob("*.safetensors")):
            raise ValueError(
                f"{folder} has no .safetensors weights: tensor-parallel loading reads each rank's slice straight "
                "from safetensors. Convert the checkpoint (load it and `save_pretrained(..., "
                "safe_serialization=True)`)."
            )
        for name in self.component_names():
            for path in sorted((self.path / name).glob("*.json")):
                content = _read_json(path)
                shards = set(content.get("weight_map", {}).values()) if path.name.endswith(".index.json") else set()
                for shard in sorted(shards):
                    if not (path.parent / shard).is_file():
                        raise ValueError(f"{path} names the shard {shard}, which is missing from {path.parent}. The "
                                         "checkpoint is incomplete; download or save it again.")
            for path in sorted((self.path / name).glob("*.safetensors")):
                _check_safetensors_header(path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read {path}: {error}. The checkpoint is incomplete or damaged; download or save it "
                         "again.") from None


def _check_safetensors_header(path: Path) -> None:
    """The file starts with a safetensors header (8-byte length, then JSON) whose tensors all lie inside the file."""
    size = path.stat().st_size
    why = None
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if size < 8 or length > size - 8:
            why = f"it has {size} bytes, too few for the {length}-byte header its first 8 bytes announce"
        else:
            try:
                header = json.loads(file.read(length))
                ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
                if 8 + length + max(ends, default=0) > size:
                    why = f"its tensors need {8 + length + max(ends)} bytes but it has {size}: it is truncated"
            except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
                why = f"its header is not a safetensors header ({type(error).__name__}: {error})"
    if why:
        raise ValueError(f"{path} is not a complete safetensors file: {why}. The checkpoint is incomplete or damaged; "
                         "download or save it again.")


def pipeline_class_name(index: dict) -> str:
    return index.get("_blocks_class_name", index.get("_class_name", ""))


def stock_pipeline_class(pipeline_class: str | type) -> type:
    """The stock diffusers pipeline class named (or given), refused unless diffusers exports it."""
    name = pipeline_class if isinstance(pipeline_class, str) else getattr(pipeline_class, "__name__", "")
    cls = getattr(diffusers, name, None) if name else None
    given_other = not isinstance(pipeline_class, str) and cls is not pipeline_class
    if given_other or not (inspect.isclass(cls) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise ValueError(
            f"`pipeline_class={pipeline_class!r}` is not a stock diffusers pipeline class: pass a class diffusers "
            "exports, or its name, e.g. 'FluxKontextPipeline'."
        )
    return cls


def read_index(folder: Path) -> dict:
    """The pipeline index of `folder`: `model_index.json`, else `modular_model_index.json`."""
    for name in INDEX_FILES:
        path = Path(folder) / name
        if path.is_file():
            return _read_json(path)
    raise FileNotFoundError(
        f"{folder} has neither model_index.json nor modular_model_index.json: point at the folder that a "
        f"pipeline's `save_pretrained` wrote, or name a tiny family ({', '.join(families.PIPELINE_FAMILIES)})."
    )


def resolve(model: str | os.PathLike | Checkpoint, pipeline_class: str | type | None = None) -> Checkpoint:
    """A tiny family name (built into the cache on first use), a local folder, or a Hub id (owner/name) resolved
    into a `Checkpoint`, run by `pipeline_class` (default: the class its index names); a folder whose pipeline no
    family runs, or a class that cannot run it, is refused here, before any weight is read."""
    checkpoint = model if isinstance(model, Checkpoint) else _resolve(model)
    if pipeline_class is None:
        return checkpoint
    return checkpoint.with_pipeline_class(pipeline_class)


def _resolve(model: str | os.PathLike) -> Checkpoint:
    source = str(model)
    if source in families.TINY_CHECKPOINTS:
        path = tiny.cached_tiny(source)
    elif Path(model).is_dir():
        path = Path(model)
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        path = _hub_snapshot(source)
    else:
        raise FileNotFoundError(
            f"Model '{model}' is neither a local checkpoint folder, a Hub id (owner/name) nor a tiny family "
            f"({', '.join(families.TINY_CHECKPOINTS)}). Pass a folder that `save_pretrained` or `hf download` wrote."
        )
    index = read_index(path)
    name = pipeline_class_name(index)
    family = families.by_pipeline_class(name)
    if family is None:  # another stock class on a transformer we plan (a FLUX.1 Kontext folder): found by it
        family = _family_of_transformer(index, name)
    if family is None:  # any other stock pipeline on a diffusers transformer: a plan drafted from its module tree
        family = _drafted(path, index, name)
    checkpoint = Checkpoint(path, source, index, family)
    return checkpoint if name == family.adapter.pipeline_class else checkpoint.with_pipeline_class(name)


def _family_of_transformer(index: dict, class_name: str) -> Family | None:
    """The family whose transformer the folder holds, if a stock class it names is built on it."""
    entry = index.get("transformer")
    cls = getattr(diffusers, class_name, None)
    if not (isinstance(entry, list) and len(entry) > 1 and inspect.isclass(cls)
            and issubclass(cls, diffusers.DiffusionPipeline) and transformer_class_name(cls) == entry[1]):
        return None
    family = families.by_model_class(entry[1])
    return family if family is not None and family.adapter is not None else None


def _drafted(path: Path, index: dict, name: str) -> Family:
    """The drafted family of a stock pipeline whose `transformer` is a diffusers model, or a `ValueError` (nothing
    read but JSON)."""
    cls = getattr(diffusers, name, None)
    entry = index.get("transformer")
    if not (inspect.isclass(cls) and issubclass(cls, diffusers.DiffusionPipeline) and isinstance(entry, list)
            and len(entry) > 1 and entry[0] == "diffusers" and transformer_class_name(cls) == entry[1]):
        supported = ", ".join(p.name for f in families.FAMILIES if f.adapter is not None for p in f.pipelines)
        raise ValueError(
            f"{path} holds a {name or 'pipeline without a class name'}, which neuron_diffusers does not run: it "
            "splits a stock diffusers pipeline's `transformer` (a diffusers model), and this one has none. "
            f"Supported: {supported} (hand-planned), and any other stock class with a diffusers `transformer` on a "
            "drafted plan. A new family needs a TP plan, an adapter and a record in neuron_diffusers/families.py "
            "(docs/architecture.md, \"Where does it go\")."
        )
    config = _read_json(path / "transformer" / "config.json")  # a missing or broken config is named here
    return _draft_once(cls, str(path / "transformer"), json.dumps(config, sort_keys=True))


#: Drafts the family of a stock class on a transformer folder (`pipelines/drafted.py`, set by the runner at import:
#: the drafter's plan tools read checkpoints, so this module cannot import it).
_drafter = None


def set_drafter(drafter) -> None:
    global _drafter
    _drafter = drafter


@functools.lru_cache(maxsize=8)
def _draft_once(cls: type, folder: str, config_text: str) -> Family:
    """Drafted once per class and transformer config in a process (`resolve` runs in each step that needs it)."""
    del config_text  # part of the cache key only: a folder saved again with another config drafts again
    if _drafter is None:
        raise RuntimeError("No plan drafter is set: import neuron_diffusers (its runner sets it) before resolving.")
    return _drafter(cls, folder)


def _hub_snapshot(repo_id: str) -> Path:
    """The Hub checkpoint's local snapshot (downloaded once into the Hugging Face cache, which every rank shares)."""
    try:
        return Path(snapshot_download(repo_id))
    except Exception as error:  # offline, gated, misspelt: all mean "no local copy to load"
        raise FileNotFoundError(
            f"Model '{repo_id}' is not a local folder and could not be fetched from the Hub "
            f"({type(error).__name__}: {error}). Download it first (`hf download {repo_id} --local-dir DIR`) and "
            "pass the folder."
        ) from error
