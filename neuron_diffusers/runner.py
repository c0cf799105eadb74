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
from .integration import mesh_device


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


def _component_class(checkpoint: Path, name: str):
    import diffusers

    index = json.loads((checkpoint / "model_index.json").read_text())
    if name not in index:
        raise ValueError(f"{checkpoint} has no '{name}' component in model_index.json.")
    library, class_name = index[name]
    if library != "diffusers":
        raise ValueError(f"'{name}' of {checkpoint} is a {library}.{class_name}, not a diffusers model.")
    return getattr(diffusers, class_name)


def check_heads(checkpoint: Path, tp: int) -> None:
    """Reject a TP degree that does not divide the attention heads, naming the valid ones."""
    config = json.loads((checkpoint / "transformer" / "config.json").read_text())
    heads = config.get("num_attention_heads")
    if heads is not None and heads % tp != 0:
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"--tp {tp} does not divide the {heads} attention heads of {checkpoint}: each rank must own whole "
            f"heads. Valid TP degrees for this model: {valid}."
        )


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
    check_heads(checkpoint, tp_mesh.size())
    transformer_cls = _component_class(checkpoint, "transformer")
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
