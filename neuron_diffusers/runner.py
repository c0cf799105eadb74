"""Load a stock pipeline with its transformer sharded over the mesh's `tp` dimension, and generate.

The one data path: resolve the checkpoint → read its config (all checks happen here, before any
weight is read) → stream each rank's transformer slice → assemble the stock pipeline → denoise
with the same CPU-seeded noise on every rank of the TP group.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from . import tiny
from .distributed import is_tp_leader, rank
from .integration import check_heads_divisible, mesh_device


def resolve_model(model: str | os.PathLike) -> Path:
    """A local checkpoint folder, or a tiny family name (built into the cache on first use)."""
    if str(model) in tiny.FAMILIES:
        path = tiny.cached_tiny(str(model))
    elif Path(model).is_dir():
        path = Path(model)
    else:
        raise FileNotFoundError(
            f"Model '{model}' is neither a local checkpoint folder nor a tiny family ({', '.join(tiny.FAMILIES)}). "
            "Download the checkpoint first (e.g. `hf download ID --local-dir DIR`) and pass the folder."
        )
    if (path / "modular_model_index.json").is_file():
        raise ValueError(
            f"{path} is a modular pipeline (such as MiniMax-H3), which `generate` cannot run yet: it supports "
            "the FluxPipeline, Flux2Pipeline, QwenImagePipeline and QwenImage21Pipeline families."
        )
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a diffusers pipeline checkpoint: it has no model_index.json. Point --model at the "
            f"folder that `save_pretrained` wrote, or name a tiny family ({', '.join(tiny.FAMILIES)})."
        )
    return path


def transformer_class_name(checkpoint: Path) -> str:
    """The transformer's class name, from `model_index.json` or a modular pipeline's index (H3)."""
    for index_name in ("model_index.json", "modular_model_index.json"):
        index_path = checkpoint / index_name
        if index_path.is_file():
            entry = json.loads(index_path.read_text()).get("transformer")
            if entry is None:
                raise ValueError(f"{index_path} lists no 'transformer' component.")
            if entry[0] != "diffusers":
                raise ValueError(f"The transformer of {checkpoint} is a {entry[0]}.{entry[1]}, not a diffusers model.")
            # `[library, class]`, or a modular `[library, class, spec]` whose spec may carry the class alone.
            return entry[1] or entry[2]["type_hint"][1]
    raise FileNotFoundError(
        f"{checkpoint} has neither model_index.json nor modular_model_index.json: point at the folder that a "
        f"pipeline's `save_pretrained` wrote, or name a tiny family ({', '.join(tiny.FAMILIES)})."
    )


def transformer_class(checkpoint: Path):
    import diffusers

    return getattr(diffusers, transformer_class_name(checkpoint))


def check_heads(checkpoint: Path, tp: int) -> None:
    """Reject a TP degree that does not divide the checkpoint's attention heads, before the process group starts."""
    config = json.loads((checkpoint / "transformer" / "config.json").read_text())
    check_heads_divisible(str(checkpoint), config.get("num_attention_heads"), tp)


@dataclass
class TPPipeline:
    """A stock diffusers pipeline whose transformer is sharded over `mesh["tp"]`."""

    pipe: object
    mesh: DeviceMesh

    def generate(self, prompts: list[str], *, seed: int = 0, **pipeline_kwargs) -> list | None:
        """Images for `prompts` (PIL), on the TP group's leader; `None` on its other ranks.

        The noise of image `i` comes from a CPU generator seeded with `seed + i`, so every rank of
        the TP group draws exactly the same latents whatever its device.
        """
        generators = [torch.Generator("cpu").manual_seed(seed + i) for i in range(len(prompts))]
        with torch.no_grad():
            images = self.pipe(prompt=list(prompts), generator=generators, **pipeline_kwargs).images
        return images if is_tp_leader(self.mesh) else None


def load_pipeline(model: str | os.PathLike, mesh: DeviceMesh, torch_dtype: torch.dtype | None = None) -> TPPipeline:
    """The stock pipeline of `model` with its transformer streamed shard-by-shard over `mesh["tp"]`."""
    from diffusers import DiffusionPipeline, TensorParallelConfig

    checkpoint = resolve_model(model)
    tp_mesh = mesh["tp"]
    # A TP degree that does not divide the heads is rejected by `from_pretrained` itself, before any
    # weight is read (see `integration.check_heads_divisible`).
    transformer_cls = transformer_class(checkpoint)
    parallel = {"parallel_config": TensorParallelConfig(mesh=tp_mesh)} if tp_mesh.size() > 1 else {}
    transformer = transformer_cls.from_pretrained(
        checkpoint, subfolder="transformer", dtype=torch_dtype, **parallel
    )
    device = mesh_device(tp_mesh)
    if not parallel:
        transformer.to(device)
    pipe = DiffusionPipeline.from_pretrained(checkpoint, transformer=transformer, dtype=torch_dtype)
    for name, component in pipe.components.items():
        if name != "transformer" and isinstance(component, torch.nn.Module):
            component.to(device)
    # Per-step bars only where someone reads them; other ranks keep their stdout for real messages.
    pipe.set_progress_bar_config(disable=rank() != 0)
    return TPPipeline(pipe, mesh)
