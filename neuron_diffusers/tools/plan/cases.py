"""A tiny random transformer and one real forward call of it: what `plan verify` runs through TP ranks.

A plan is proven by feeding the same call to one process and to N tensor-parallel ranks and comparing the
predictions; a misplaced style usually still runs and gives a plausible but wrong image, so nothing short
of the numbers will do. This module supplies the model and the call, from one of two sources:

- a tiny pipeline family (`tiny.FAMILIES`): its stock pipeline runs once on CPU and the transformer's
  first call is captured, so the inputs are exactly what real inference feeds it;
- `TRANSFORMER_CASES`: a tiny config of a class we ship no tiny pipeline for, and a function building
  its forward inputs. Verifying a plan for a new class means adding one entry here (see
  `docs/authoring.md`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from torch.utils._pytree import tree_map

from ... import families, tiny
from ...checkpoint import resolve

PROMPT = "a red fox in the snow"


@dataclass(frozen=True)
class Case:
    """A tiny checkpoint (`checkpoint/transformer`), one call of its transformer and the single-process output."""

    model_class: str
    checkpoint: Path
    args: tuple
    kwargs: dict
    expected: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class TinyTransformer:
    """A config small enough to run in milliseconds that keeps every module the plan names, and its inputs."""

    config: dict
    inputs: Callable[[torch.Generator], dict]


def _hunyuanvideo_inputs(generator: torch.Generator) -> dict:
    batch, text_len = 2, 12
    mask = torch.ones(batch, text_len, dtype=torch.int64)
    mask[1, 9:] = 0  # the second prompt is padded: the refiner's and the blocks' attention masks are exercised
    return {
        "hidden_states": torch.randn(batch, 4, 2, 8, 8, generator=generator),  # 2 frames of 8x8 latents
        "timestep": torch.tensor([500, 250]),
        "encoder_hidden_states": torch.randn(batch, text_len, 32, generator=generator),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(batch, 24, generator=generator),
        "guidance": torch.tensor([6000.0, 6000.0]),
    }


TRANSFORMER_CASES = {
    # 4 heads (TP 1, 2, 4) of 16 (rotary axes 4 + 6 + 6); mlp_ratio stays at the default 4.0, which the
    # plan's PackedRowwiseParallel([1, 4]) depends on.
    "HunyuanVideoTransformer3DModel": TinyTransformer(
        config={
            "in_channels": 4, "out_channels": 4, "num_attention_heads": 4, "attention_head_dim": 16,
            "num_layers": 2, "num_single_layers": 2, "num_refiner_layers": 2, "text_embed_dim": 32,
            "pooled_projection_dim": 24, "rope_axes_dim": (4, 6, 6),
        },
        inputs=_hunyuanvideo_inputs,
    ),
}


def predictions(output) -> tuple[torch.Tensor, ...]:
    """Every tensor the transformer predicts (H3: video and audio; Z-Image: a list, one tensor per sample), whatever
    container holds them."""
    items = output.to_tuple() if hasattr(output, "to_tuple") else output
    if isinstance(items, torch.Tensor):
        return (items,)
    if not isinstance(items, (tuple, list)):
        return ()
    return tuple(tensor for item in items for tensor in predictions(item))


def _pipeline_families() -> dict[str, str]:
    return {families.get(family).model_class_name: family for family in tiny.FAMILIES}


def verifiable_models() -> list[str]:
    """What `build_case` accepts besides family names: the classes it has a tiny model of."""
    return sorted({*_pipeline_families(), *TRANSFORMER_CASES})


def build_case(model: str, workdir: Path, seed: int = 0) -> Case:
    """The case for `model`: a tiny pipeline family, a registered family's name, or a class name.

    `workdir` receives the checkpoint of a `TRANSFORMER_CASES` model (pipeline families use the tiny
    cache). Raises `ValueError` naming what is accepted when there is no tiny model of `model`.
    """
    class_name = families.get(model).model_class_name if families.is_family(model) else model
    family = model if model in tiny.FAMILIES else _pipeline_families().get(class_name)
    if family is not None:
        return _pipeline_case(family, seed)
    if class_name in TRANSFORMER_CASES:
        return _transformer_case(class_name, workdir, seed)
    raise ValueError(
        f"There is no tiny model of '{model}' to verify a plan on: `plan verify` needs a tiny random instance and "
        f"one forward call. Known: tiny families {', '.join(tiny.FAMILIES)} and classes "
        f"{', '.join(verifiable_models())}. "
        "For another class, add its tiny config and an inputs function to "
        "`neuron_diffusers.tools.plan.cases.TRANSFORMER_CASES` (docs/authoring.md, step 6)."
    )


@contextmanager
def recording_first_call(transformer: torch.nn.Module):
    """Yields a list that receives the (args, kwargs) of `transformer`'s first call inside the block, cloned, so a
    pipeline's later in-place updates of its tensors do not reach the recording."""
    captured = []

    def hook(module, args, kwargs):
        if not captured:
            captured.append(tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x,
                                     (args, dict(kwargs))))

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield captured
    finally:
        handle.remove()


def capture_first_call(pipe, call: dict) -> tuple[tuple, dict]:
    """The (args, kwargs) of the transformer's first call in one real pipeline run: no per-family input recipes."""
    with recording_first_call(pipe.transformer) as captured, torch.no_grad():
        pipe(**call)
    return captured[0]


def reference_call(checkpoint: Path, family: str, seed: int = 0) -> tuple[tuple, dict, tuple[torch.Tensor, ...]]:
    """The transformer's first real call in `family`'s stock single-process pipeline at `checkpoint`, and its
    predictions."""
    resolved = resolve(checkpoint)
    adapter = resolved.adapter
    pipe = adapter.load_stock(resolved)
    call = {"prompt": PROMPT, "generator": torch.Generator().manual_seed(seed), **tiny.smallest_call(family),
            **adapter.stock_output_kwargs}
    args, kwargs = capture_first_call(pipe, call)
    with torch.no_grad():
        return args, kwargs, predictions(pipe.transformer(*args, **kwargs))


def _pipeline_case(family: str, seed: int) -> Case:
    checkpoint = tiny.cached_tiny(family, seed=seed)
    args, kwargs, expected = reference_call(checkpoint, family, seed)
    return Case(families.get(family).model_class_name, checkpoint, args, kwargs, expected)


def _transformer_case(class_name: str, workdir: Path, seed: int) -> Case:
    recipe = TRANSFORMER_CASES[class_name]
    torch.manual_seed(seed)
    model = getattr(diffusers, class_name).from_config(recipe.config).eval()
    model.save_pretrained(workdir / "transformer")
    kwargs = recipe.inputs(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = predictions(model(**kwargs))
    return Case(class_name, workdir, (), kwargs, expected)
