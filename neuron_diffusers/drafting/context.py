"""Context-parallel plans drafted from one traced forward of a tiny instance, in diffusers' `_cp_plan` format.

Where the sequence enters the block lists is where it is split, and where the blocks' output leaves through the
last module after them that returns the token sequence (`proj_out`; a nested one such as a `ModuleDict`'s final
layer; else the last block itself, where the model slices or reshapes the tokens right after it) is where it is
gathered. One forward in one process shows both: the inputs of each block list's first two blocks, the last block's
output, and the modules called after it.
An input that every block of a list receives as the same tensor (rotary embeddings, cross-attention text) is split
at every block (`blocks.*`), so each block gets the matching slice; an input that flows from block to block (the
hidden states) is split once, at the first block of the first list; a later list that only takes the split sequence
on gets an empty rule, so that its attention is routed too (`_flow_marker`). Which sequence inputs to split is not
always readable from the structure (cross-attention text may stay whole; joint attention must split it), so the drafter
writes the few candidates the trace allows and the numbers choose (`proof.verify_cp`): the first that equals one
process at tp=2 x ulysses=2 is the draft.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

import torch

from ..compat.attention_route import needs_route
from ..compat.privates import ContextParallelInput, ContextParallelOutput

#: Parameter names that carry the text sequence (cross- or joint-attention states, their masks and positions).
_TEXT = re.compile(r"encoder|text|txt|context|caption|cap_|prompt")


@dataclass
class BlockCall:
    """What one block received: its parameters by name."""

    path: str
    inputs: dict


@dataclass
class Trace:
    """One forward's view of where the sequence flows: block lists in call order, their first two blocks' inputs,
    the top-level modules called after the blocks and what they returned."""

    lists: list[str] = field(default_factory=list)
    calls: dict = field(default_factory=dict)  # (list, index) -> BlockCall
    after_blocks: list[tuple[str, object]] = field(default_factory=list)
    last_block: tuple[str, object] | None = None


def _block_lists(model: torch.nn.Module) -> list[str]:
    """Top-level ModuleLists whose blocks hold attention (a module with a `processor`)."""
    return [name for name, child in model.named_children() if isinstance(child, torch.nn.ModuleList) and len(child)
            and any(hasattr(m, "processor") for m in child[0].modules())]


def trace(model: torch.nn.Module, kwargs: dict, args: tuple = ()) -> Trace:
    """Run `model(*args, **kwargs)` once, recording block inputs, the last block's output and the modules (top-level
    or nested, e.g. in a `ModuleDict`) called after the blocks."""
    result, handles = Trace(), []
    lists = _block_lists(model)

    def block_hook(name, index):
        def hook(module, a, kw):
            if name not in result.lists:
                result.lists.append(name)
            if index < 2:
                bound = inspect.signature(module.forward).bind_partial(*a, **kw).arguments
                result.calls.setdefault((name, index), BlockCall(f"{name}.{index}", dict(bound)))
            result.after_blocks.clear()  # only what is called after the last block counts
        return hook

    def output_hook(name):
        def hook(module, a, output):
            if name.count(".") == 1 and name.split(".")[0] in lists:
                result.last_block = (name, output)
                result.after_blocks.clear()
            else:
                result.after_blocks.append((name, output))
        return hook

    for name in lists:
        blocks = getattr(model, name)
        for index in sorted({0, 1, len(blocks) - 1} & set(range(len(blocks)))):
            handles.append(blocks[index].register_forward_pre_hook(block_hook(name, index), with_kwargs=True))
        handles.append(blocks[-1].register_forward_hook(output_hook(f"{name}.{len(blocks) - 1}")))
    for name, child in model.named_modules():
        if name and name.split(".")[0] not in lists:
            handles.append(child.register_forward_hook(output_hook(name)))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return result


def _seq_dim(tensor: torch.Tensor, lengths: set[int]) -> int | None:
    """The first dim after the batch dim (or dim 0 of a 2-D table) whose size is a sequence length. A 2-D float
    `[batch, n]` is a per-sample vector (time or pooled embedding), whatever `n` is; masks and ids are not float."""
    start = 1 if tensor.dim() >= 3 or (tensor.dim() == 2 and tensor.shape[0] not in lengths) else 0
    if tensor.dim() == 2 and start == 1 and tensor.is_floating_point():
        return None
    return next((d for d in range(start, tensor.dim()) if tensor.shape[d] in lengths), None)


def _split_entry(value, lengths: set[int]):
    """A `ContextParallelInput` (or a list of them, for a tuple) for a value with a sequence dim, else None."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2:
        dim = _seq_dim(value, lengths)
        return None if dim is None else ContextParallelInput(split_dim=dim, expected_dims=value.dim())
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        entries = [_split_entry(v, lengths) for v in value]
        return entries if all(entries) else None
    return None


def _lengths(trace_: Trace, with_text: bool) -> set[int]:
    first = trace_.calls[trace_.lists[0], 0].inputs
    hidden = first.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        hidden = next(v for v in first.values() if isinstance(v, torch.Tensor) and v.dim() == 3)
    lengths = {hidden.shape[1]}
    text = next((v for k, v in first.items() if _TEXT.search(k) and isinstance(v, torch.Tensor) and v.dim() == 3),
                None)
    if text is not None and with_text:
        lengths |= {text.shape[1], text.shape[1] + hidden.shape[1]}
    return lengths


def _list_rules(trace_: Trace, name: str, lengths: set[int], with_text: bool, full: set[int]) -> dict:
    """Split rules for one block list: shared inputs at `name.*`, the flowing ones (first list only) at `name.0`."""
    first = trace_.calls[name, 0].inputs
    second = trace_.calls.get((name, 1))
    rules: dict[str, dict] = {}
    for param, value in first.items():
        if not with_text and _TEXT.search(param):
            continue
        entry = _split_entry(value, lengths)
        if entry is None:
            continue
        shared = second is not None and second.inputs.get(param) is value
        if shared:
            rules.setdefault(f"{name}.*", {})[param] = entry
        elif name == trace_.lists[0] or id(value) in full:
            rules.setdefault(f"{name}.0", {})[param] = entry
        else:
            continue
        full.add(id(value))
    return rules or _flow_marker(trace_, name, lengths)


def _flow_marker(trace_: Trace, name: str, lengths: set[int]) -> dict:
    """`{name.0: {}}` for a later list with nothing of its own to split whose blocks take a sequence of a split
    length (AuraFlow's single blocks take its joint blocks' concatenated output, already split): the empty rule
    splits nothing, but names the list as one that sees split sequences, so its attention is routed through
    diffusers' dispatch too (`compat/attention_route.py` routes the lists a plan names). A list fed a sequence of
    another length (Latte's temporal blocks attend over frames, per split position) stays local."""
    hidden = _hidden_name(trace_, name)
    if name == trace_.lists[0] or hidden is None or trace_.calls[name, 0].inputs[hidden].shape[1] not in lengths:
        return {}
    return {f"{name}.0": {}}


def _output_rule(trace_: Trace, with_text: bool) -> dict | None:
    """Where to gather: the last module after the blocks that returns `[batch, tokens, features]` (top-level first,
    then nested), else the last block's own output (every tensor of it, so only where the text is split too)."""
    lengths = {trace_.calls[name, 0].inputs[hidden].shape[1] for name in trace_.lists
               if (hidden := _hidden_name(trace_, name)) is not None}
    for top_level in (True, False):
        for name, output in reversed(trace_.after_blocks):
            if ("." not in name) == top_level and isinstance(output, torch.Tensor) and output.dim() == 3 \
                    and output.shape[1] in lengths:
                return {name: ContextParallelOutput(gather_dim=1, expected_dims=3)}
    if trace_.last_block is None:
        return None
    name, output = trace_.last_block
    outputs = [output] if isinstance(output, torch.Tensor) else list(output) if isinstance(output, (tuple, list)) \
        else []
    if not outputs or not all(isinstance(o, torch.Tensor) and o.dim() == 3 for o in outputs) or \
            (len(outputs) > 1 and not with_text):
        return None
    rule = [ContextParallelOutput(gather_dim=1, expected_dims=3) for _ in outputs]
    if name.endswith(".0"):  # a one-block list: its `.0` key splits the inputs; `.*` is the same block
        name = name[:-2] + ".*"
    return {name: rule[0] if isinstance(output, torch.Tensor) else rule}


def _hidden_name(trace_: Trace, name: str) -> str | None:
    """The block input that carries the token sequence: `hidden_states`, else the first 3-D tensor (or None)."""
    inputs = trace_.calls[name, 0].inputs
    value = inputs.get("hidden_states")
    if isinstance(value, torch.Tensor) and value.dim() == 3:
        return "hidden_states"
    return next((k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() == 3), None)


@dataclass
class CpDraft:
    """Candidate CP plans (label -> plan), best first, or the reason there are none."""

    candidates: dict = field(default_factory=dict)
    reason: str | None = None


def draft_cp_plans(model: torch.nn.Module, kwargs: dict, args: tuple = ()) -> CpDraft:
    """The candidate CP plans for `model` from one traced call (see the module docstring), or why none."""
    if not any(hasattr(getattr(m, "processor", None), "_parallel_config") or needs_route(m) for m in model.modules()):
        return CpDraft(reason="no diffusers attention module with a processor: diffusers cannot split its sequence")
    trace_ = trace(model, kwargs, args)
    if not trace_.lists:
        return CpDraft(reason="no top-level block list with attention ran: nowhere to split the sequence")
    if not any(isinstance(v, torch.Tensor) and v.dim() == 3 for v in trace_.calls[trace_.lists[0], 0].inputs.values()):
        return CpDraft(reason=f"{trace_.lists[0]}.0 receives no [batch, tokens, features] tensor to split")
    if _output_rule(trace_, True) is None:
        return CpDraft(reason="nowhere to gather the sequence: no module after the blocks returns the token sequence "
                              "and the last block's output is not tokens")
    draft = CpDraft()
    for label, with_text in (("blocks, text split", True), ("blocks, text whole", False)):
        lengths, full, plan = _lengths(trace_, with_text), set(), {}
        for name in trace_.lists:
            plan.update(_list_rules(trace_, name, lengths, with_text, full))
        _add(draft, label, plan, _output_rule(trace_, with_text))
    _add(draft, "forward inputs", _entry_rules(model, trace_, kwargs), _output_rule(trace_, True))
    return draft


def _add(draft: CpDraft, label: str, plan: dict, output: dict | None) -> None:
    known = [plan_text(p) for p in draft.candidates.values()]
    if plan and output and plan_text({**plan, **output}) not in known:
        draft.candidates[label] = {**plan, **output}


def _entry_rules(model: torch.nn.Module, trace_: Trace, kwargs: dict) -> dict:
    """Split the forward's own sequence inputs (packed tokens, text, position ids), where the model takes tokens
    `[batch, tokens, channels]` rather than a latent grid (a grid cannot be cut into token slices before patching)."""
    hidden = kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return {}
    lengths = _lengths(trace_, True) | {hidden.shape[1]}
    entries = {name: entry for name, value in kwargs.items()
               if name in inspect.signature(model.forward).parameters
               and (entry := _split_entry(value, lengths)) is not None}
    return {"": entries} if entries else {}


def plan_text(plan: dict) -> dict:
    """A CP plan as JSON-able text (`repr` of each entry)."""
    return {module: ({str(k): repr(v) for k, v in entry.items()} if isinstance(entry, dict) else repr(entry))
            for module, entry in plan.items()}
