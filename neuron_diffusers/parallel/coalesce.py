"""Fewer collectives per forward: partial sums reduced together, hoisted modulation gathered once.

Per-collective latency dominates the small collectives of a transformer step (a fixed cost per call
over gloo, NeuronLink or NVLink once the bytes are few), so the number of calls matters as much as
the bytes. This module gives the two plan styles of `tp_plans/styles.py` their forward-time behaviour,
without changing what any rank computes:

- `PartialRowwiseParallel(reduced_at=...)`: rowwise Linears leave their partial sums (DTensor's own
  local result, `bias / tp` included); a forward hook on the module named by `reduced_at` (e.g. a
  dual-stream block's `attn`, which returns both streams) all-reduces all of them in one call. With
  `reduced_at="block"` the block's forward does it: `COALESCED_FORWARDS` holds, per dual-stream block
  class, the family's mirror of stock's forward with the two feed-forwards both computed before either
  is used, so one all-reduce serves both (`CoalescedForward`; each family keeps its own in its files and
  the registry pushes them here). Same operations as stock, in that order.
- `GatheredColwiseParallel(hoist_from=...)`: every AdaLN modulation Linear reads `silu(temb)`, so right
  after the module producing `temb` runs, all of them are computed from the local weight shards and
  all-gathered in one call; each Linear then returns its slice of the result. The results live only
  for the model's forward (cleared when it returns, even on error), so nothing stale can leak.

Everything is installed per instance: hooks (the hoisting one named `HOIST_HOOK` in diffusers' `HookRegistry`),
two attributes (`_nd_tp_mesh` on coalesced blocks, `_nd_hoist` on hoisted Linears), and a swap of the instance's
class to a subclass whose `forward` is ours (one subclass per class, with the same name, so diffusers finds the
repeated blocks and `compile_repeated_blocks` compiles one graph for all of them: an instance-bound `forward`
would cost one graph per block). The transactional `enable_parallelism` (`compat/enable.py`) restores classes,
attributes and hooks on failure.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook
from torch.distributed import _functional_collectives as funcol

from ..compat.version import pinned_diffusers
from ..tp_plans.styles import GatheredColwiseParallel, PartialRowwiseParallel
from .rules import expand_rule

logger = logging.getLogger(__name__)

_BLOCK = "block"


def reduce_together(tensors: list[torch.Tensor], mesh) -> list[torch.Tensor]:
    """All-reduce (sum) several partial sums in one collective; each comes back in its own shape."""
    flat = funcol.all_reduce(torch.cat([t.reshape(-1) for t in tensors]), "sum", mesh)
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]


def gather_columns(local_outputs: list[torch.Tensor], mesh) -> list[torch.Tensor]:
    """All-gather several column-sharded outputs in one collective, each rebuilt as colwise + all-gather would.

    Rank r holds columns `[r * n, (r + 1) * n)` of each output; the result is the full output in rank order,
    bit for bit what `ColwiseParallel(output_layouts=Replicate())` returns.
    """
    tp = mesh.size()
    gathered = funcol.all_gather_single(torch.cat([t.reshape(-1) for t in local_outputs]), 0, mesh).view(tp, -1)
    full, offset = [], 0
    for local in local_outputs:
        part = gathered[:, offset:offset + local.numel()].reshape(tp, *local.shape)
        full.append(part.movedim(0, -2).reshape(*local.shape[:-1], tp * local.shape[-1]))
        offset += local.numel()
    return full


def _local_linear(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    hoisted_local = getattr(linear, "hoisted_local", None)  # a quantized shard (`parallel/quantize.py`)
    if hoisted_local is not None:
        return hoisted_local(x)
    bias = linear.bias.to_local() if linear.bias is not None else None
    return F.linear(x, linear.weight.to_local(), bias)


# --- partial sums reduced together -------------------------------------------------------------------------------


def _reduce_outputs_hook(module, args, output, *, mesh, expected: int):
    # Nothing block-specific may live in the hook's arguments: compiled blocks guard on them, and one
    # differing constant per block would compile one graph per block.
    outputs = output if isinstance(output, tuple) else (output,)
    if len(outputs) != expected:
        raise ValueError(
            f"{type(module).__name__} returned {len(outputs)} outputs, but the tensor-parallel plan leaves {expected} "
            f"partial sums "
            f"there to reduce together. Its attention processor is not the one the plan was written for (FLUX.1's "
            f"IP-Adapter processor returns a third, unsharded output): IP-Adapters are not supported under tensor "
            f"parallelism. Unload it (`pipe.unload_ip_adapter()`), or load the model without a parallel_config."
        )
    reduced = reduce_together(list(outputs), mesh)
    return tuple(reduced) if isinstance(output, tuple) else reduced[0]


def reduce_in_block(block: torch.nn.Module, partial_sums: list[torch.Tensor]) -> list[torch.Tensor]:
    """For a family's coalesced block forward: its partial sums reduced together over the block's TP mesh."""
    return reduce_together(partial_sums, block._nd_tp_mesh)


_SUBCLASSES: dict = {}


def _with_forward(module: torch.nn.Module, forward) -> None:
    """Make `forward` the module's forward through a subclass of its class (same name), shared by all instances."""
    cls = type(module)
    key = (cls, forward)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__,
                                                       "__doc__": forward.__doc__})
    module.__class__ = _SUBCLASSES[key]


def stock_class(cls: type) -> type:
    """The class a module had before `_with_forward` (a model already sharded still names its stock blocks)."""
    while cls in _SUBCLASSES.values():
        cls = cls.__base__
    return cls


_stock_class = stock_class


class CoalescedForward(NamedTuple):
    """A family's mirror of one stock block forward, with feed-forwards computed before either is used so that one
    all-reduce (`reduce_in_block`) serves the partial Linears it names (relative to the block); `digest` is the
    `source_digest` of the pinned stock forward it mirrors: a diffusers release that changes it is refused, not
    mixed."""

    forward: Callable
    linears: tuple[str, ...]
    digest: str


#: Block class -> its coalesced forward, pushed in by the family registry (each family's `BLOCK_FORWARDS` module;
#: `families.install`): this module names no family. Looked up by class (`forward_for`), subclasses included.
COALESCED_FORWARDS: dict[type, CoalescedForward] = {}


def register_forward(block_class: type, entry: CoalescedForward) -> None:
    COALESCED_FORWARDS[block_class] = entry


def forward_for(block_class: type) -> CoalescedForward | None:
    """The registered coalesced forward of `block_class` (its stock class, or a class it derives from), or None."""
    return next((COALESCED_FORWARDS[base] for base in stock_class(block_class).__mro__
                 if base in COALESCED_FORWARDS), None)


def source_digest(function) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


# --- hoisted modulation ------------------------------------------------------------------------------------------


@dataclass
class HoistedOutput:
    """What one hoisted Linear needs: its output for the current forward, computed early (None outside a forward),
    the input it was computed from (to check the plan's declaration in eager mode), and names for messages."""

    mesh: object
    name: str
    source: str
    first_half: bool
    output: torch.Tensor | None = None
    input: torch.Tensor | None = None
    warned: bool = False


class HoistModulation(ModelHook):
    """On the `temb` module: right after it runs, every hoisted Linear's local output, then one all-gather for all.

    A named diffusers hook (`HOIST_HOOK`): the module runs outside the compiled blocks, once per forward.
    """

    def __init__(self, linears: list[torch.nn.Linear], mesh):
        super().__init__()
        self.linears, self.mesh = linears, mesh

    def post_forward(self, module, output):
        activated = F.silu(output)
        inputs = []
        for linear in self.linears:
            x = activated.to(getattr(linear, "compute_dtype", linear.weight.dtype))  # quantized: the model's
            inputs.append(x.chunk(2, dim=0)[0] if linear._nd_hoist.first_half else x)
        local = [_local_linear(linear, x) for linear, x in zip(self.linears, inputs, strict=True)]
        for linear, x, full in zip(self.linears, inputs, gather_columns(local, self.mesh), strict=True):
            linear._nd_hoist.output, linear._nd_hoist.input = full, x
        return output


HOIST_HOOK = "neuron_diffusers.hoist_modulation"


def _hoisted_forward(self, input: torch.Tensor) -> torch.Tensor:
    """Return this Linear's slice of the hoisted all-gather (checked against the real input when not compiling)."""
    hoist = self._nd_hoist
    if hoist.output is None:
        raise RuntimeError(
            f"{hoist.name} is hoisted (GatheredColwiseParallel(hoist_from='{hoist.source}')): its output is computed "
            f"when '{hoist.source}' runs inside the model's forward, so it cannot be called on its own. Call the "
            "whole model, or plan it with GatheredColwiseParallel() (no hoist_from)."
        )
    if not torch.compiler.is_compiling() and not _same_values(input, hoist.input):
        if not hoist.warned:
            logger.warning(
                "%s's input is not silu(%s output) as its plan declares: computing it with its own all-gather "
                "instead (correct, one more collective per call). Fix the plan's hoist_from/first_half_if.",
                hoist.name, hoist.source,
            )
            hoist.warned = True
        return gather_columns([_local_linear(self, input)], hoist.mesh)[0]
    return hoist.output


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and values, NaN equal to NaN: NaN weights make both inputs NaN in the same places, which is the
    latent check's to report (`NonFiniteLatentsError`), not a plan mistake."""
    if torch.equal(a, b):  # shape included
        return True
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _clear_hoisted(module, args, output, *, linears: list):
    for linear in linears:
        linear._nd_hoist.output = linear._nd_hoist.input = None


# --- plan reading and installation -------------------------------------------------------------------------------


def check_plan(model: torch.nn.Module, plan: dict, *, whole_plan: bool = True) -> None:
    """Reject coalescing rules this module cannot honour, before any weight is read.

    `whole_plan=False` checks each rule on its own (for a lint that reports rule by rule): it skips the check that a
    block forward's reduced Linears are exactly the plan's, which only a whole plan can pass.
    """
    block_rules: dict[type, set[str]] = {}
    for pattern, style in plan.items():
        if isinstance(style, PartialRowwiseParallel):
            if "*" not in pattern:
                raise ValueError(
                    f"Tensor-parallel plan rule '{pattern}': PartialRowwiseParallel reduces within a block, so its "
                    "rule "
                    "must name a Linear inside a ModuleList of blocks ('blocks.*.path'). Use 'rowwise' here."
                )
            for target in expand_rule(model, pattern)[:1]:
                block, path = target.block, target.path
                if style.reduced_at == _BLOCK:
                    block_rules.setdefault(_stock_class(type(block)), set()).add(path)
                elif not path.startswith(style.reduced_at + "."):
                    raise ValueError(
                        f"Tensor-parallel plan rule '{pattern}': "
                        f"PartialRowwiseParallel(reduced_at='{style.reduced_at}') "
                        f"must name a Linear inside '{style.reduced_at}', whose outputs get reduced. Point reduced_at "
                        "at a module around the Linear that returns its (partial) output."
                    )
                else:
                    block.get_submodule(style.reduced_at)
        elif isinstance(style, GatheredColwiseParallel) and style.hoist_from is not None:
            try:
                model.get_submodule(style.hoist_from)
            except AttributeError:
                raise ValueError(
                    f"Tensor-parallel plan rule '{pattern}': hoist_from='{style.hoist_from}' is not a module of "
                    f"{type(model).__name__}. Name the module whose output `temb` this Linear reads as silu(temb)."
                ) from None
            if style.first_half_if is not None and not hasattr(model.config, style.first_half_if):
                raise ValueError(
                    f"Tensor-parallel plan rule '{pattern}': first_half_if='{style.first_half_if}' is not a config "
                    f"field of {type(model).__name__}."
                )
    for block_cls, paths in block_rules.items() if whole_plan else ():
        known = forward_for(block_cls)
        if known is None or set(known.linears) != paths:
            supported = {cls.__name__: list(entry.linears) for cls, entry in COALESCED_FORWARDS.items()}
            raise ValueError(
                f"Tensor-parallel plan reduces {sorted(paths)} of {block_cls.__name__} in the block "
                f"(PartialRowwiseParallel(reduced_at='block')), but neuron_diffusers has no coalesced forward for "
                "that: "
                f"supported blocks and their Linears: {supported}. Use 'rowwise' for these Linears."
            )
        if source_digest(block_cls.forward) != known.digest:
            raise ValueError(
                f"This diffusers' {block_cls.__name__}.forward differs from the diffusers 0.42.1 one that "
                f"neuron_diffusers' coalesced forward mirrors, so reducing {sorted(paths)} together could compute "
                f"something else. Install diffusers{pinned_diffusers()}, or use 'rowwise' for these Linears."
            )


def install(model: torch.nn.Module, plan: dict, mesh) -> None:
    """Give the plan's coalescing styles their forward-time behaviour on a just-sharded `model`."""
    groups: dict[tuple[str, str], list] = {}  # (block name, reduced_at) -> [block, partial Linear count]
    hoisted: dict[str, list] = {}
    for pattern, style in plan.items():
        if isinstance(style, PartialRowwiseParallel):
            for target in expand_rule(model, pattern):
                groups.setdefault((target.block_name, style.reduced_at), [target.block, 0])[1] += 1
        elif isinstance(style, GatheredColwiseParallel) and style.hoist_from is not None:
            first_half = bool(style.first_half_if and getattr(model.config, style.first_half_if))
            for target in expand_rule(model, pattern):
                hoisted.setdefault(style.hoist_from, []).append((target.module, first_half, target.name))

    for (_, reduced_at), (block, count) in groups.items():
        if reduced_at == _BLOCK:
            block._nd_tp_mesh = mesh
            _with_forward(block, forward_for(type(block)).forward)
        else:
            # A plain torch hook, the same function for every block: it runs inside the compiled blocks, where one
            # shared hook keeps one graph for all of them.
            hook = functools.partial(_reduce_outputs_hook, mesh=mesh, expected=count)
            block.get_submodule(reduced_at).register_forward_hook(hook)

    every_hoisted = []
    for source, entries in hoisted.items():
        for linear, first_half, name in entries:
            _with_forward(linear, _hoisted_forward)
            linear._nd_hoist = HoistedOutput(mesh, name, source, first_half)
            every_hoisted.append(linear)
        registry = HookRegistry.check_if_exists_or_initialize(model.get_submodule(source))
        registry.register_hook(HoistModulation([linear for linear, _, _ in entries], mesh), HOIST_HOOK)
    if every_hoisted:
        # A plain torch hook: `always_call` clears the outputs even when the forward raises, which a diffusers
        # `post_forward` would not.
        model.register_forward_hook(functools.partial(_clear_hoisted, linears=every_hoisted), always_call=True)
