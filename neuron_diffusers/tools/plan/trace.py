"""How many rows every Linear and attention of a family's transformer sees in one denoising step at a real size.

What a layout costs follows from those row counts, and they come from the pipeline (text padding, VAE and patch
factors, H3's packed text + video + audio sequence, true CFG's second forward, Qwen-Image-2.1's KV cache), not from
the model's widths. So the trace runs the family's *tiny* pipeline (`tiny/`: the released VAE compression, patching
and sequence layout at toy widths) at the requested size for two steps, through the package's own adapter (encoding,
length buckets, H3's packed-sequence padding), with attention itself skipped: `scaled_dot_product_attention` records
its shapes and returns zeros. The second step is the steady state (Qwen-Image-2.1's first step fills its KV cache).
Rows are kept per module pattern (`transformer_blocks.*.attn.to_q`), so they apply to a full-size model's 60 blocks
as to the tiny model's 2. No released weight is read; a trace takes a few seconds.

diffusers splits the sequence where the model's `_cp_plan` says (at the model input for FLUX, at the first block for
Qwen-Image and H3) and gathers it at the output Linears, so a call between the first split and the last gather runs
on its rank's share of the rows (`split`); the lengths the plan splits are recorded too, since the plain Ulysses and
ring modes need each to divide `ulysses x ring`. A model without a plan is assumed to split everything.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ... import tiny
from ...checkpoint import resolve
from ...compat.plans import cp_plan_of
from ...families import Family
from ...parallel import sharded_norm

PROMPT = "a red fox in the snow"
NEGATIVE_PROMPT = "blurry"
#: The guidance scale `--true-cfg` sets: any value above 1 makes the pipeline run both branches.
TRUE_CFG = {"true_cfg_scale": 4.0}
#: `tiny.smallest_call` runs two denoising steps.
STEPS = 2
#: `F.scaled_dot_product_attention`'s leading parameters (a builtin: `inspect` cannot bind it).
_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def module_patterns(model: torch.nn.Module) -> dict[str, str]:
    """Every module's name with its block index, the first index into a ModuleList, replaced by `*`:
    `transformer_blocks.3.ff.net.0.proj` -> `transformer_blocks.*.ff.net.0.proj`."""
    lists = {name for name, module in model.named_modules() if isinstance(module, torch.nn.ModuleList)}
    patterns = {}
    for name, _ in model.named_modules():
        parts = name.split(".")
        for index in range(1, len(parts)):
            if parts[index].isdigit() and ".".join(parts[:index]) in lists:
                parts[index] = "*"
                break
        patterns[name] = ".".join(parts)
    return patterns


@dataclass(frozen=True)
class LinearCall:
    rows: int
    #: A `(batch, rows, features)` input: context parallelism splits it inside the split region.
    sequence: bool
    split: bool


@dataclass(frozen=True)
class AttentionCall:
    batch: int
    query_rows: int
    key_rows: int
    #: A mask or causal attention: diffusers' ring attention would apply it to every rotated key block.
    masked: bool
    split: bool


@dataclass(frozen=True)
class Forward:
    """One transformer forward: the calls of the first module of each pattern, in call order."""

    linears: dict[str, tuple[LinearCall, ...]]
    attention: dict[str, tuple[AttentionCall, ...]]
    #: The sequence lengths the context-parallel plan splits.
    split_lengths: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    #: Whether the model class has a context-parallel plan (if not, the whole forward counts as split).
    has_cp_plan: bool
    #: The forwards of one steady denoising step (two with true CFG: cond, uncond).
    step: tuple[Forward, ...]
    #: Whether any traced step attends with a mask (or causally): diffusers' ring attention would apply the local
    #: mask to every rotated key block, so such a model needs Ulysses, or ring without padding (`ring_anything`).
    masked_attention: bool

    @property
    def forwards_per_step(self) -> int:
        return len(self.step)


class _Unchecked:
    """Stands in for `consistency.LatentAgreement`: one process, no group to compare latents with."""

    def step_end(self, pipe, step, timestep, callback_kwargs) -> dict:
        return {}

    def pre_hook(self, module, args, kwargs) -> None:
        return None

    def check(self, tensors, where) -> None:
        return None


class _Recorder(TorchFunctionMode):
    """Hooks on the tiny transformer plus a torch-function mode: the only way to see (and skip) attention itself,
    which stock processors call as `F.scaled_dot_product_attention` from inside their modules."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.forwards: list[Forward] = []
        self._handles = [transformer.register_forward_pre_hook(self._start),
                         transformer.register_forward_hook(self._finish)]
        self.plan = cp_plan_of(type(transformer))
        self._patterns = module_patterns(transformer)
        self._first = {}  # pattern -> the first module of that pattern (block 0), whose calls are kept
        for name, module in transformer.named_modules():
            self._first.setdefault(self._patterns[name], name)
            if isinstance(module, torch.nn.Linear):
                self._handles.append(module.register_forward_hook(functools.partial(self._linear, name)))
            elif sharded_norm.supports(module):  # a `ShardedRMSNorm` all-reduces one value per row
                self._handles.append(module.register_forward_hook(functools.partial(self._norm, name)))
            elif hasattr(module, "processor"):
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
                self._handles.append(module.register_forward_hook(self._leave))
        for key, entry in (self.plan or {}).items():
            self._watch_split(transformer.get_submodule(key.replace("*", "0")), entry)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    # -- one forward ---------------------------------------------------------------------------------------

    def _start(self, module, args) -> None:
        self._events, self._attention_stack, self._starts, self._ends, self._lengths = [], [], [], [], set()

    def _finish(self, module, args, output) -> None:
        start = min(self._starts, default=0) if self.plan else 0
        end = max(self._ends, default=math.inf) if self.plan else math.inf
        linears, attention = {}, {}
        for position, kind, name, call in self._events:
            pattern, split = self._patterns[name], start <= position <= end
            if self._first[pattern] != name:
                continue
            if kind == "linear":
                linears.setdefault(pattern, []).append(LinearCall(*call, split=split))
            else:
                attention.setdefault(pattern, []).append(AttentionCall(*call, split=split))
        lengths = self._lengths or {call.query_rows for calls in attention.values() for call in calls}
        self.forwards.append(Forward({k: tuple(v) for k, v in linears.items()},
                                     {k: tuple(v) for k, v in attention.items()}, tuple(sorted(lengths))))

    def _linear(self, name, module, args, output) -> None:
        x = args[0]
        self._events.append((len(self._events), "linear", name, (x.numel() // module.in_features, x.ndim >= 3)))

    def _norm(self, name, module, args, output) -> None:
        x = args[0]
        self._events.append((len(self._events), "linear", name, (x.numel() // x.shape[-1], x.ndim >= 3)))

    def _enter(self, name, module, args) -> None:
        self._attention_stack.append(name)

    def _leave(self, module, args, output) -> None:
        self._attention_stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        named = {**dict(zip(_SDPA_ARGUMENTS, args, strict=False)), **kwargs}
        query, key, value = named["query"], named["key"], named["value"]
        if not self._attention_stack:
            raise RuntimeError("scaled_dot_product_attention ran outside an attention module of the transformer: "
                               "the trace cannot say which module's heads it used.")
        masked = named.get("attn_mask") is not None or bool(named.get("is_causal"))
        call = (query.shape[0], query.shape[-2], key.shape[-2], masked)
        self._events.append((len(self._events), "attention", self._attention_stack[-1], call))
        return query.new_zeros((*query.shape[:-1], value.shape[-1]))

    # -- the context-parallel plan -------------------------------------------------------------------------

    def _watch_split(self, module: torch.nn.Module, entry) -> None:
        if hasattr(entry, "gather_dim"):  # a ContextParallelOutput: the sequence is whole again after this module
            self._handles.append(module.register_forward_hook(lambda m, a, o: self._ends.append(len(self._events))))
            return
        inputs = {name: spec for name, spec in entry.items() if not spec.split_output}
        outputs = {index: spec for index, spec in entry.items() if spec.split_output}
        signature = inspect.signature(module.forward)

        def split_inputs(module, args, kwargs):
            self._starts.append(len(self._events))
            bound = signature.bind_partial(*args, **kwargs).arguments
            for name, spec in inputs.items():
                self._record(bound.get(name) if isinstance(name, str) else args[name], spec)

        def split_outputs(module, args, output):
            for index, spec in outputs.items():
                self._record(output[index], spec)

        if inputs:
            self._handles.append(module.register_forward_pre_hook(split_inputs, with_kwargs=True))
        if outputs:
            self._handles.append(module.register_forward_hook(split_outputs))

    def _record(self, value, spec) -> None:
        # diffusers splits only a tensor with `expected_dims` dimensions (Wan's 1-D timestep is left whole; its 2-D
        # per-token one, Wan 2.2 TI2V's, is split).
        expected = getattr(spec, "expected_dims", None)
        if isinstance(value, torch.Tensor) and (expected is None or value.ndim == expected):
            self._lengths.add(value.shape[spec.split_dim])


@functools.lru_cache(maxsize=16)
def trace(family: Family, height: int, width: int, true_cfg: bool = False) -> Trace:
    """Two steps of `family`'s tiny pipeline at `height` x `width` (cached per process); the second is the result.

    `true_cfg` passes a negative prompt and a guidance scale above 1, so families with true classifier-free
    guidance run both branches; a guidance-distilled family refuses it.
    """
    checkpoint = resolve(tiny.cached_tiny(family.name))
    adapter = checkpoint.adapter
    negative, guidance = (NEGATIVE_PROMPT, TRUE_CFG) if true_cfg else (None, {})
    if true_cfg and not adapter.uses_true_cfg(negative, guidance):
        raise ValueError(f"{family.display_name} is guidance-distilled: one forward per step, so there is no second "
                         "branch for a CFG pair to compute. Drop --true-cfg.")
    multiple = adapter.size_multiple(checkpoint)
    if height % multiple or width % multiple:
        raise ValueError(f"--size {width}x{height}: {family.display_name} needs a width and height that are "
                         f"multiples of {multiple} (VAE compression x patch size). Round it to a multiple of "
                         f"{multiple}.")
    transformer = checkpoint.transformer_class().from_pretrained(checkpoint.path, subfolder="transformer")
    encoder = adapter.load_encoder(checkpoint, None)
    pipe = adapter.load_denoiser(checkpoint, transformer, None, torch.device("cpu"), decodes=False)
    pipe.set_progress_bar_config(disable=True)
    call = {**tiny.smallest_call(family.name), "height": height, "width": width, **guidance}
    recorder = _Recorder(transformer)
    try:
        with torch.no_grad():
            embeds = adapter.pad(adapter.encode(encoder, PROMPT, negative), adapter.buckets)
        with torch.no_grad(), recorder:
            adapter(pipe, embeds, generator=torch.Generator().manual_seed(0), decodes=False, check=_Unchecked(),
                    buckets=adapter.buckets, **call)
    finally:
        recorder.close()
    per_step = len(recorder.forwards) // STEPS
    masked = any(call.masked for forward in recorder.forwards
                 for calls in forward.attention.values() for call in calls)
    return Trace(recorder.plan is not None, tuple(recorder.forwards[-per_step:]), masked)
