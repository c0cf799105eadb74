"""Compile each repeated transformer block once, for every declared shape, and never again.

On Neuron every new input shape is a new compilation that takes minutes, so a recompile in a serving loop is a
visible stall. Three things keep the graph count fixed:

- `compile_repeated_blocks` compiles the transformer's repeated blocks (stock `compile_repeated_blocks`
  underneath: every instance of a block class shares one compiled code object) with `fullgraph=True` and
  `dynamic=False`. `dynamic=False` also keeps dynamo's automatic dynamic shapes off for these frames only, so no
  global `torch._dynamo.config` is changed. Every block also hands the next one contiguous tensors: stock FLUX.1
  single-stream blocks return slices of one tensor, so the second block saw different strides than the first and
  compiled again.
- The pipeline adapters pad text embeddings to length buckets (see `pipelines/`), and `warmup` runs every declared
  (size, bucket) once up front, so the first real request pays nothing.
- `RecompileGuard` watches for recompiles after warm-up: it warns once per new reason (which input, old and new
  shape, as dynamo words it), or raises.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import warnings

import torch

logger = logging.getLogger(__name__)


def resolve_backend(backend: str = "auto") -> str:
    """`auto` means `neuron` where TorchNeuron is installed, else `inductor`; any registered backend name passes."""
    if backend != "auto":
        if backend not in torch.compiler.list_backends(exclude_tags=()):
            raise ValueError(
                f"Unknown torch.compile backend '{backend}'. Registered: {', '.join(torch.compiler.list_backends(exclude_tags=()))}. "
                "Use 'auto' to pick neuron when TorchNeuron is installed, else inductor."
            )
        return backend
    return "neuron" if importlib.util.find_spec("torch_neuronx") is not None else "inductor"


def _with_row_major_strides(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with the strides of a fresh tensor of its shape (copied only if they differ).

    Not `.contiguous()`: a `[1, n, d]` slice of a longer sequence counts as contiguous (the batch stride of a
    size-1 dimension is ignored) yet keeps the parent's batch stride, and dynamo guards on it.
    """
    return tensor if tensor.stride() == _row_major(tensor.shape) else tensor.clone(memory_format=torch.contiguous_format)


def _row_major(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@torch.compiler.disable  # one hook serves every block class; compiled, it would guard on (and recompile for) each
def _contiguous_outputs(module, args, output):
    """Forward hook: tensors leave a block with row-major strides, so every block of a class sees the same ones."""
    if isinstance(output, torch.Tensor):
        return _with_row_major_strides(output)
    if isinstance(output, tuple):
        return tuple(_with_row_major_strides(item) if isinstance(item, torch.Tensor) else item for item in output)
    return output


def compile_repeated_blocks(pipe_or_transformer, backend: str = "auto", **torch_compile_kwargs):
    """Compile the transformer's repeated blocks in place; returns the transformer.

    Takes a `TPPipeline`, a stock pipeline, or the transformer itself. `torch_compile_kwargs` override the
    defaults `fullgraph=True, dynamic=False`.
    """
    transformer = _transformer_of(pipe_or_transformer)
    block_classes = set(getattr(transformer, "_repeated_blocks", ()) or ())
    for module in transformer.modules():
        if type(module).__name__ in block_classes:
            module.register_forward_hook(_contiguous_outputs)
    options = {"fullgraph": True, "dynamic": False, **torch_compile_kwargs}
    transformer.compile_repeated_blocks(backend=resolve_backend(backend), **options)
    return transformer


def _transformer_of(obj):
    for candidate in (obj, getattr(obj, "pipe", None), getattr(getattr(obj, "pipe", None), "denoiser", None)):
        transformer = getattr(candidate, "transformer", None)
        if isinstance(transformer, torch.nn.Module):
            return transformer
    if isinstance(obj, torch.nn.Module) and hasattr(obj, "compile_repeated_blocks"):
        return obj
    raise TypeError(f"Expected a pipeline or a diffusers transformer, got {type(obj).__name__}.")


def warmup(pipe, sizes: list[tuple[int, int]], buckets: tuple[int, ...] | None = None, **generate_kwargs) -> int:
    """Run one generation per (size, text-length bucket), so every graph is compiled before real requests.

    `pipe` is a `TPPipeline`; `buckets` default to its own. Two denoising steps by default: the first and later
    steps can differ (Qwen-Image-2.1 fills its text KV cache on the first). Returns the number of runs. Every rank
    of the group must call it, like `generate`.
    """
    generate_kwargs.setdefault("num_inference_steps", 2)
    buckets = pipe.buckets if buckets is None else tuple(buckets)
    runs = 0
    for height, width in sizes:
        for bucket in buckets or (None,):
            # A one-token prompt padded to exactly `bucket`: the shapes of any prompt of that bucket.
            sized = dataclasses.replace(pipe, buckets=(bucket,)) if bucket else pipe
            sized.generate(["warm-up"], seed=0, height=height, width=width, **generate_kwargs)
            runs += 1
    return runs


def compile_report() -> dict:
    """What dynamo did in this process so far: graphs, graph breaks, recompiles (with reasons), compile seconds."""
    from torch._dynamo.utils import compilation_time_metrics, counters, guard_failures

    reasons = [reason for failures in guard_failures.values() for reason in failures]
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": len(reasons),
        "recompile_reasons": reasons,
        "compile_seconds": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 3),
    }


class RecompileGuard:
    """After warm-up, a recompile is a bug: warn once per new reason (`mode="warn"`), or raise (`mode="raise"`).

    Installed as a forward hook on the transformer (outside the compiled blocks), so it costs one dict length
    check per forward.
    """

    def __init__(self, transformer: torch.nn.Module, mode: str = "warn"):
        if mode not in ("warn", "raise"):
            raise ValueError(f"RecompileGuard mode must be 'warn' or 'raise', got {mode!r}.")
        self.mode = mode
        self._seen = compile_report()["recompiles"]
        self._handle = transformer.register_forward_hook(self._after_forward)

    def _after_forward(self, module, args, output) -> None:
        report = compile_report()
        if report["recompiles"] == self._seen:
            return
        new = report["recompile_reasons"][self._seen:]
        self._seen = report["recompiles"]
        message = "A compiled block recompiled after warm-up:\n" + "\n".join(f"- {r}" for r in new) + (
            "\nDeclare this shape in `warmup` (image size, or a text length bucket) so it compiles up front."
        )
        if self.mode == "raise":
            raise RuntimeError(message)
        warnings.warn(message, stacklevel=2)

    def remove(self) -> None:
        self._handle.remove()
