"""Compile each repeated transformer block once, for every declared shape, and never again.

On Neuron every new input shape is a new compilation that takes minutes, so a recompile in a serving loop is a
visible stall. Three things keep the graph count fixed:

- `compile_repeated_blocks` compiles the transformer's repeated blocks (stock `compile_repeated_blocks`
  underneath: every instance of a block class shares one compiled code object) with `fullgraph=True` and
  `dynamic=False`. `dynamic=False` also keeps dynamo's automatic dynamic shapes off for these frames only, so no
  global `torch._dynamo.config` is changed (warm-up raises the recompile limit to the declared shapes, see
  `_allow_graphs`). Every block also receives row-major tensors: stock FLUX.1 single-stream blocks return slices of
  one tensor, so the second block saw different strides than the first and compiled again (likewise Qwen-Image-2.1's
  cached steps).
- The pipeline adapters pad text embeddings to length buckets (see `pipelines/`), and `warmup` runs every declared
  (size, bucket) once up front, so the first real request pays nothing.
- `RecompileGuard` watches for recompiles after warm-up: it warns once per new reason (which input, old and new
  shape, as dynamo words it), or raises.

With a step cache (`parallel/cache.py`) the cache's hooks replace each block's `forward`, and stock compiles
`_call_impl`, hooks and skip decision included (a graph break that `fullgraph=True` refuses). So each block's own
`forward` is compiled with the hooks lifted, and the hooks are put back around it: the decision runs eagerly between
graphs. Warm-up runs with the hooks lifted too, so every graph compiles even where the cache would skip.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from contextlib import nullcontext

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch._dynamo.utils import compilation_time_metrics, counters, guard_failures

from .compat import context as compat_context
from .compat import plans as compat_plans
from .parallel.blocks import block_types_of
from .parallel.cache import group_cache_of


def resolve_backend(backend: str = "auto") -> str:
    """`auto` means `neuron` where TorchNeuron is installed, else `inductor`; any registered backend name passes."""
    if backend != "auto":
        if backend not in torch.compiler.list_backends(exclude_tags=()):
            raise ValueError(
                f"Unknown torch.compile backend '{backend}'. Registered: "
                f"{', '.join(torch.compiler.list_backends(exclude_tags=()))}. "
                "Use 'auto' to pick neuron when TorchNeuron is installed, else inductor."
            )
        return backend
    return "neuron" if importlib.util.find_spec("torch_neuronx") is not None else "inductor"


def _with_row_major_strides(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with the strides of a fresh tensor of its shape (copied only if they differ).

    Not `.contiguous()`: a `[1, n, d]` slice of a longer sequence counts as contiguous (the batch stride of a
    size-1 dimension is ignored) yet keeps the parent's batch stride, and dynamo guards on it.
    """
    if tensor.stride() == _row_major(tensor.shape):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _row_major(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _row_major_inputs(value):
    if isinstance(value, torch.Tensor):
        return _with_row_major_strides(value)
    if isinstance(value, tuple):
        return tuple(_row_major_inputs(item) for item in value)
    return value


@torch.compiler.disable  # one hook serves every block class; compiled, it would guard on (and recompile for) each
def _row_major_block_inputs(module, args, kwargs):
    """Forward pre-hook: a block always receives row-major tensors, so every instance shares one graph.

    Stock models hand some blocks views: FLUX.1's single-stream blocks return slices of one sequence, and
    Qwen-Image-2.1's cached steps slice the prefix off before the first block.
    """
    return _row_major_inputs(args), {name: _row_major_inputs(value) for name, value in kwargs.items()}


def compile_repeated_blocks(pipe_or_transformer, backend: str = "auto", *, blocks: list[str] | None = None,
                            **torch_compile_kwargs):
    """Compile the transformer's repeated blocks in place; returns the transformer.

    Takes a `ParallelPipeline`, a stock pipeline, or the transformer itself. `blocks` names the block classes to compile
    (default: the pipeline adapter's choice, else the model's `_repeated_blocks`). `torch_compile_kwargs` override
    the defaults `fullgraph=True, dynamic=False`. Compile after `load_pipeline`: the TP hooks must be in place first.
    """
    transformer = _transformer_of(pipe_or_transformer)
    experts = getattr(getattr(pipe_or_transformer, "checkpoint", None), "experts", ())
    if experts:
        raise ValueError(f"compile_repeated_blocks compiles one transformer, and this pipeline has a second expert "
                         f"({', '.join(experts)}) that would run eagerly (not supported yet): run it uncompiled.")
    _refuse_any_length(transformer)
    _warn_if_unbucketed(pipe_or_transformer)
    block_classes = compiled_block_classes(transformer, getattr(pipe_or_transformer, "adapter", None), blocks)
    block_types = block_types_of(transformer, block_classes)
    cache = group_cache_of(transformer)
    if cache is not None:
        cache.check_compilable(block_classes)
    options = {"fullgraph": True, "dynamic": False, **torch_compile_kwargs}
    backend = resolve_backend(backend)
    for module in transformer.modules():
        if isinstance(module, block_types):
            # A torch pre-hook, the same compiler-disabled function on every block: one graph serves them all.
            module.register_forward_pre_hook(_row_major_block_inputs, with_kwargs=True)
    if cache is None:
        compat_plans.compile_blocks(transformer, block_classes, backend=backend, **options)
        return transformer
    with cache.suspended():  # each block's own forward, so the re-installed cache hooks stay outside the graphs
        for module in transformer.modules():
            if isinstance(module, block_types):
                module.forward = torch.compile(module.forward, backend=backend, **options)
    return transformer


def compiled_block_classes(transformer: torch.nn.Module, adapter=None, blocks: list[str] | None = None) -> list[str]:
    """The block classes `compile_repeated_blocks` compiles: `blocks`, else the pipeline adapter's choice (it may
    narrow them to those that run at bucketed shapes, MiniMax-H3: not its refiner), else the model's repeated
    blocks."""
    return list(blocks or getattr(adapter, "compiled_blocks", None) or compat_plans.repeated_blocks(transformer))


def _refuse_any_length(transformer: torch.nn.Module) -> None:
    """diffusers' *_anything context-parallel modes gather each rank's length at every attention call (a host sync
    that dynamo cannot put in a graph): refuse before compiling rather than fail inside `fullgraph` tracing."""
    cp = compat_context.context_parallel_config_of(transformer)
    if cp is not None and (cp.ulysses_anything or cp.ring_anything):
        raise ValueError(
            f"{type(transformer).__name__} runs context parallelism in diffusers' "
            f"{'ulysses' if cp.ulysses_anything else 'ring'}_anything mode (any sequence length: each attention call "
            "exchanges the ranks' lengths with a host sync), which does not compile to static graphs. Compile with "
            "the plain mode (sizes whose sequences split evenly, no `cp_any_length` / --cp-any-length; Qwen-Image-2.1 "
            "has none: its joint sequence follows the prompt), or run this one uncompiled."
        )


def _warn_if_unbucketed(pipe) -> None:
    """A `ParallelPipeline` whose text length varies and is not bucketed compiles a new graph for every prompt
    length."""
    adapter = getattr(pipe, "adapter", None)
    if adapter is None or adapter.static_text_length or pipe.buckets:
        return
    warnings.warn(
        f"{adapter.pipeline_class} runs without text-length buckets, so every new prompt length compiles new "
        "graphs. Pass `buckets=` to `load_pipeline` for static shapes (see the adapter in "
        "neuron_diffusers/pipelines/ for what padding changes for this family).",
        stacklevel=3,
    )


def _transformer_of(obj):
    """The transformer of a `ParallelPipeline` (through its adapter), of a stock pipeline, or `obj` itself."""
    if hasattr(obj, "adapter"):
        return obj.adapter.transformer_of(obj.pipe)
    if isinstance(getattr(obj, "transformer", None), torch.nn.Module):
        return obj.transformer
    if isinstance(obj, torch.nn.Module) and hasattr(obj, "compile_repeated_blocks"):
        return obj
    raise TypeError(f"Expected a pipeline or a diffusers transformer, got {type(obj).__name__}.")


def warmup(pipe, sizes: list[tuple[int, int]], buckets: tuple[int, ...] | None = None, *,
           on_recompile: str | None = "warn", **generate_kwargs) -> RecompileGuard | None:
    """Run one generation per (size, text-length bucket, declared batch size), so every graph is compiled before real
    requests.

    `pipe` is a `ParallelPipeline`; `buckets` default to its own. Two denoising steps by default: the first and later
    steps can differ (Qwen-Image-2.1 fills its text KV cache on the first). Every rank of the group must call it,
    like `generate`. Afterwards a `RecompileGuard` watches the transformer (`on_recompile`: "warn", "raise", or
    None for no guard) and is returned.
    """
    generate_kwargs.setdefault("num_inference_steps", 2)
    # Every TP group compiles its own blocks, so each warms up alone: a CFG pair would split the one warm-up prompt.
    generate_kwargs.setdefault("alone", True)
    buckets = pipe.buckets if buckets is None else tuple(buckets)
    batch_sizes = getattr(pipe, "batch_sizes", None) or (1,)  # `load_pipeline(batch_sizes=...)`: static batches
    if {"image", "mask_image", "strength"} & generate_kwargs.keys():
        batch_sizes = batch_sizes[:1]  # image inputs run one image per call
    _allow_graphs(len(sizes) * max(len(buckets), 1) * len(batch_sizes) * GRAPHS_PER_SHAPE)
    declared = pipe.buckets
    cache = group_cache_of(_transformer_of(pipe))
    try:
        # With a step cache: uncached, so no step skips a graph (see the module doc).
        with cache.suspended() if cache is not None else nullcontext():
            for height, width in sizes:
                for bucket in buckets or (None,):
                    # A one-word prompt padded to exactly `bucket`: the shapes of any prompt of that bucket.
                    pipe.buckets = (bucket,) if bucket else ()
                    for rows in batch_sizes:
                        pipe.generate(["warm-up"] * rows, seed=0, height=height, width=width, batch_size=rows,
                                      **generate_kwargs)
    finally:
        pipe.buckets = declared
    return RecompileGuard(_transformer_of(pipe), mode=on_recompile) if on_recompile else None


# A declared shape can need a few graphs per block: MiniMax-H3's first step carries two noise levels and the
# others one; Qwen-Image-2.1 prefills its text KV cache on the first step.
GRAPHS_PER_SHAPE = 4


def _allow_graphs(count: int) -> None:
    """Raise dynamo's per-function graph limit (default 8) to what the declared shapes need.

    The one global dynamo setting this module changes, and only upwards: past the limit dynamo stops compiling
    (or raises under `fullgraph=True`), so declaring more shapes than it allows would break warm-up itself.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, count)


def compile_report() -> dict:
    """What dynamo did in this process so far: graphs, graph breaks, recompiles (with reasons), compile seconds."""
    # Each recompilation checks (and logs a failure for) every graph the function already has, tagged
    # "frame/graph:"; the failure against its first graph ("F/0:") marks one recompilation and says what changed.
    recompiles = [
        reason for failures in guard_failures.values() for reason in failures if re.match(r"\d+/0:", reason)
    ]
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": len(recompiles),
        "recompile_reasons": recompiles,
        "compile_seconds": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 3),
    }


class RecompileGuard(ModelHook):
    """After warm-up, a recompile is a bug: warn once per new reason (`mode="warn"`), or raise (`mode="raise"`).

    A named hook on the transformer (`RECOMPILE_GUARD`, outside the compiled blocks; a later warm-up replaces it):
    after each forward it scans dynamo's guard-failure log, which stays a few entries long when nothing recompiles.
    It reports after the forward that recompiled, with dynamo's own words for what changed (input, expected and
    actual size or stride).
    """

    def __init__(self, transformer: torch.nn.Module, mode: str = "warn"):
        super().__init__()
        if mode not in ("warn", "raise"):
            raise ValueError(f"RecompileGuard mode must be 'warn' or 'raise', got {mode!r}.")
        self.mode = mode
        self._seen = compile_report()["recompiles"]
        self._registry = HookRegistry.check_if_exists_or_initialize(transformer)
        if self._registry.get_hook(RECOMPILE_GUARD) is not None:
            self._registry.remove_hook(RECOMPILE_GUARD)
        self._registry.register_hook(self, RECOMPILE_GUARD)

    def post_forward(self, module, output):
        report = compile_report()
        if report["recompiles"] == self._seen:
            return output
        new = report["recompile_reasons"][self._seen:]
        self._seen = report["recompiles"]
        message = "A compiled block recompiled after warm-up:\n" + "\n".join(f"- {r}" for r in new) + (
            "\nDeclare this shape in `warmup` (image size, or a text length bucket) so it compiles up front."
        )
        if self.mode == "raise":
            raise RuntimeError(message)
        warnings.warn(message, stacklevel=2)
        return output

    def remove(self) -> None:
        if self._registry.get_hook(RECOMPILE_GUARD) is self:
            self._registry.remove_hook(RECOMPILE_GUARD)


RECOMPILE_GUARD = "neuron_diffusers.recompile_guard"
