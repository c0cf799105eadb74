"""One small adapter per stock pipeline family, found from what a checkpoint's index names.

An adapter knows how to encode a prompt on CPU, which call kwargs carry the embeddings and masks, whether they may
be padded to a static length bucket, and which components each rank needs. It never copies pipeline code.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import pipeline_class_name
from .base import PipelineAdapter, StockPipelineAdapter
from .flux import FluxAdapter
from .flux2 import Flux2Adapter
from .minimax_h3 import MiniMaxH3Adapter
from .qwenimage import QwenImageAdapter
from .qwenimage21 import QwenImage21Adapter

ADAPTERS = {
    adapter.pipeline_class: adapter
    for adapter in (FluxAdapter, Flux2Adapter, QwenImageAdapter, QwenImage21Adapter, MiniMaxH3Adapter)
}


def adapter_for(checkpoint: Path):
    """The adapter for the pipeline family saved at `checkpoint`."""
    name = pipeline_class_name(checkpoint)
    if name not in ADAPTERS:
        raise ValueError(
            f"{checkpoint} holds a {name or 'pipeline without a class name'}, which neuron_diffusers does not run. "
            f"Supported: {', '.join(ADAPTERS)}. A new family needs a TP plan in neuron_diffusers/tp_plans/ and an "
            "adapter in neuron_diffusers/pipelines/."
        )
    return ADAPTERS[name]()


__all__ = ["ADAPTERS", "PipelineAdapter", "StockPipelineAdapter", "adapter_for", "pipeline_class_name"]
