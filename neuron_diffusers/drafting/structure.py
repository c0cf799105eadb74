"""Read a transformer's module tree (on the meta device) and assign each Linear a tensor-parallel role.

The roles come from structure only: module types from diffusers' and torch's base classes (`Attention`,
`AttentionModuleMixin`, `nn.Linear`, norms), shapes (a Linear's in/out features against the attention widths) and
attributes the attention classes share (`heads`, `head_dim`, `to_q` ...). No class name is read. What the rules below
cannot decide is returned as a `Note` (module path, reason) and left whole, never guessed: a plan that shards less is
slower, a plan that guesses wrong gives a plausible wrong image.

The order matters: attention first (it claims its own projections), then packed projections that close an attention
without an output projection (single-stream blocks), then feed-forwards (a pair or a gated triple of Linears in the
smallest module that holds them), then modulation (a Linear to k x the stream width, gathered), and what is left
stays whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from diffusers.hooks.tensor_parallel import PackedColwiseParallel, PackedRowwiseParallel
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention

from ..parallel import sharded_norm
from ..tp_plans.styles import GatheredColwiseParallel, ShardedRMSNorm

ATTENTION_TYPES = (Attention, AttentionModuleMixin)
#: Attention projections by the attribute diffusers' attention classes hold them in.
COLWISE_PROJECTIONS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
ROWWISE_PROJECTIONS = ("to_out", "to_add_out")
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k", "q_rms_norm", "k_rms_norm")
#: The projection each Q/K norm normalizes the output of.
NORMED_PROJECTIONS = {"norm_q": "to_q", "norm_k": "to_k", "norm_added_q": "add_q_proj", "norm_added_k": "add_k_proj",
                      "q_rms_norm": "to_q", "k_rms_norm": "to_k"}


@dataclass(frozen=True)
class Note:
    """A module the drafter leaves whole, and why (`decided=False`: it could not tell, so it did not guess)."""

    module: str
    reason: str
    decided: bool = True


@dataclass
class Roles:
    """Full module path -> style for every Linear the drafter shards, and the notes on what it left whole."""

    styles: dict[str, object] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    #: Attention modules whose projections are sharded: path -> heads (the TP degree must divide them).
    heads: dict[str, int] = field(default_factory=dict)
    #: Widths of the residual streams (the attentions' input and output widths): modulation is k x one of them.
    widths: set[int] = field(default_factory=set)
    #: Split Q/K norms over all heads (`ShardedRMSNorm`); False leaves such attentions whole (the fallback where a
    #: processor also reads the whole width, e.g. rotary embeddings over all heads).
    shard_norms: bool = True
    #: Attentions whose heads leave them split (no output projection): path -> their inner width.
    open_attentions: dict[str, int] = field(default_factory=dict)


def _linear(module) -> torch.nn.Linear | None:
    """The Linear at an attention attribute: the module itself, or the first of a `to_out`-style ModuleList."""
    if isinstance(module, torch.nn.ModuleList) and len(module) and isinstance(module[0], torch.nn.Linear):
        return module[0]
    return module if isinstance(module, torch.nn.Linear) else None


def _norm_width(norm: torch.nn.Module) -> int | None:
    """How many features a norm normalizes over (its weight, else its declared shape); None if it has neither."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.numel()
    shape = getattr(norm, "normalized_shape", None) or getattr(norm, "dim", None)
    if isinstance(shape, int):
        return shape
    return math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) and shape else None


def _head_dim(attn: torch.nn.Module, heads: int, query: torch.nn.Linear) -> int:
    head_dim = getattr(attn, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    inner = getattr(attn, "inner_dim", None)
    return (inner if isinstance(inner, int) else query.out_features) // heads


def _attention_refusal(attn: torch.nn.Module, norms: bool = True) -> str | None:
    """Why an attention module cannot be split by heads with the loader's mechanics, or None if it can."""
    heads = getattr(attn, "heads", None)
    if not isinstance(heads, int):
        return ("no integer `heads` attribute: the loader sets each rank's head count through it, so its "
                "processor would split the wrong number of heads")
    query = _linear(getattr(attn, "to_q", None))
    if query is None:
        return ("no `to_q` Linear and no fused projection that declares its packed layout (fused or renamed "
                "projections): which output columns are which heads is not known")
    head_dim = _head_dim(attn, heads, query)
    known = set(COLWISE_PROJECTIONS + ROWWISE_PROJECTIONS)
    for name, child in attn.named_children():
        if name not in known and any(isinstance(m, torch.nn.Linear) for m in child.modules()):
            return f"projection '{name}' has no role the drafter knows (it may act on the split heads)"
    for name in QK_NORMS:
        norm = getattr(attn, name, None)
        width = _norm_width(norm) if isinstance(norm, torch.nn.Module) else None
        if width is not None and width != head_dim and (not norms or _all_heads_norm(attn, name) is None):
            return (f"'{name}' normalizes over {width} features, not one head ({head_dim}) nor as an RMSNorm over "
                    "its projection's whole output: it needs every rank's heads at once, so the heads cannot be split")
    return None


def _all_heads_norm(attn: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The Q/K norm `name` when it is an RMSNorm over its projection's whole (all heads') output, which
    `ShardedRMSNorm` splits like that colwise projection (one all-reduce of sums of squares), else None."""
    norm, projection = getattr(attn, name, None), _linear(getattr(attn, NORMED_PROJECTIONS[name], None))
    if isinstance(norm, torch.nn.Module) and projection is not None and sharded_norm.supports(norm) \
            and _norm_width(norm) == projection.out_features:
        return norm
    return None


def _fused_styles(path: str, attn: torch.nn.Module) -> dict[str, object] | None:
    """An attention whose fused projections declare diffusers' packed layout (`_tp_packed_col_blocks` /
    `_tp_packed_row_blocks`, set in the model's `__init__`): packed colwise in, packed rowwise out."""
    styles = {}
    for name, child in attn.named_children():
        if getattr(child, "_tp_packed_col_blocks", None):
            styles[f"{path}.{name}"] = PackedColwiseParallel()
        elif getattr(child, "_tp_packed_row_blocks", None):
            styles[f"{path}.{name}"] = PackedRowwiseParallel()
    kinds = {type(style) for style in styles.values()}
    return styles if kinds == {PackedColwiseParallel, PackedRowwiseParallel} else None


def _read_attention(path: str, attn: torch.nn.Module, roles: Roles) -> None:
    fused = _fused_styles(path, attn) if _linear(getattr(attn, "to_q", None)) is None else None
    if fused is not None and isinstance(getattr(attn, "heads", None), int):
        roles.styles.update(fused)
        roles.heads[path] = attn.heads
        return
    refusal = _attention_refusal(attn, roles.shard_norms)
    if refusal is not None:
        roles.notes.append(Note(path, refusal, decided=False))
        return
    prefix = f"{path}." if path else ""
    query = _linear(attn.to_q)
    head_dim = _head_dim(attn, attn.heads, query)
    # Grouped-query attention: K and V have fewer heads, and each rank needs whole ones of those too.
    keys = [_linear(getattr(attn, name, None)) for name in ("to_k", "to_v")]
    kv_heads = [k.out_features // head_dim for k in keys if k is not None and k.out_features % head_dim == 0]
    roles.heads[path] = math.gcd(attn.heads, *kv_heads)
    roles.widths.add(query.in_features)
    for name in COLWISE_PROJECTIONS:
        if _linear(getattr(attn, name, None)) is not None:
            roles.styles[prefix + name] = "colwise"
    for name in QK_NORMS:
        norm = getattr(attn, name, None)
        if isinstance(norm, torch.nn.Module) and _norm_width(norm) != head_dim and _all_heads_norm(attn, name):
            roles.styles[prefix + name] = ShardedRMSNorm()
    closed = False
    for name in ROWWISE_PROJECTIONS:
        out = getattr(attn, name, None)
        linear = _linear(out)
        if linear is not None:
            roles.styles[prefix + name + (".0" if out is not linear else "")] = "rowwise"
            roles.widths.add(linear.out_features)
            closed = True
    if not closed:
        roles.open_attentions[path] = query.out_features


def read_attentions(model: torch.nn.Module, roles: Roles) -> None:
    """Split every attention by heads: Q/K/V (and the added text projections) colwise, outputs rowwise."""
    for path, module in model.named_modules():
        if isinstance(module, ATTENTION_TYPES) and not any(path.startswith(f"{p}.") for p in roles.heads):
            _read_attention(path, module, roles)


def _linears(module: torch.nn.Module, prefix: str, skip: set[str]) -> list[tuple[str, torch.nn.Linear]]:
    """The Linears under `module` not claimed yet and not inside an attention, with full paths."""
    found = []
    for name, child in module.named_modules():
        path = f"{prefix}.{name}" if prefix and name else (name or prefix)
        if isinstance(child, torch.nn.Linear) and path not in skip:
            found.append((path, child))
    return found


def read_packed(model: torch.nn.Module, roles: Roles) -> None:
    """Close each attention that has no output projection: its block's Linear whose input is cat(attention, MLP
    hidden) (in_features = inner + hidden, with a sibling Linear producing the hidden) becomes packed rowwise, the
    sibling colwise. Without one, the attention's heads would stay split: its rules are withdrawn and named."""
    modules = dict(model.named_modules())
    for attn_path, inner in list(roles.open_attentions.items()):
        block_path = attn_path.rpartition(".")[0]
        block = modules[block_path]
        found = _packed_partner(block, block_path, attn_path, inner, roles)
        if found is None:
            _withdraw(attn_path, roles, "has no output projection, and no Linear in its block reads cat(attention, "
                                        "MLP hidden): nothing closes its split heads")
            continue
        (hidden_path, hidden), (out_path, out) = found
        roles.styles[hidden_path] = "colwise"
        blocks = getattr(out, "_tp_packed_row_blocks", None)
        unit = math.gcd(inner, hidden.out_features)
        roles.styles[out_path] = (PackedRowwiseParallel() if blocks else
                                  PackedRowwiseParallel([inner // unit, hidden.out_features // unit]))
        roles.widths.add(out.out_features)
        del roles.open_attentions[attn_path]


def _packed_partner(block, block_path, attn_path, inner, roles):
    candidates = [(p, m) for p, m in _linears(block, block_path, set(roles.styles))
                  if not p.startswith(f"{attn_path}.")]
    for out_path, out in candidates:
        for hidden_path, hidden in candidates:
            if hidden is not out and out.in_features == inner + hidden.out_features \
                    and hidden.in_features == out.out_features:
                return (hidden_path, hidden), (out_path, out)
    return None


def _withdraw(attn_path: str, roles: Roles, reason: str) -> None:
    for path in [p for p in roles.styles if p.startswith(f"{attn_path}.")]:
        del roles.styles[path]
    roles.heads.pop(attn_path, None)
    roles.open_attentions.pop(attn_path, None)
    roles.notes.append(Note(attn_path, reason, decided=False))


def read_modulation(model: torch.nn.Module, roles: Roles) -> None:
    """A Linear outside attentions and MLPs that maps to k >= 2 times a stream width (AdaLN shift/scale/gate, the
    output norm's scale/shift) is needed whole by every rank: gathered colwise, exact, no partner needed."""
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or path in roles.styles or _inside(path, roles.heads):
            continue
        if any(module.out_features % w == 0 and module.out_features // w >= 2 for w in roles.widths):
            roles.styles[path] = GatheredColwiseParallel()


def _inside(path: str, prefixes) -> bool:
    return any(path.startswith(f"{p}.") for p in prefixes)


def _mlp_styles(linears: list[tuple[str, torch.nn.Linear]]) -> dict[str, object] | None:
    """Styles for an MLP's Linears: an up projection (width -> hidden; width -> 2 x hidden when gated: packed
    halves) then a down projection (hidden -> width), in registration order (shapes alone cannot tell a pair's up
    from its down); or two equal up projections (value and gate, any order) and the down projection that reads their
    hidden. None when the shapes are not one of these."""
    if len(linears) == 2:
        (up_path, up), (down_path, down) = linears
        if up.in_features != down.out_features:
            return None
        if up.out_features == down.in_features:
            return {up_path: "colwise", down_path: "rowwise"}
        if up.out_features == 2 * down.in_features:
            return {up_path: PackedColwiseParallel([1, 1]), down_path: "rowwise"}
        return None
    for down_path, down in linears:
        ups = [(p, m) for p, m in linears if m is not down]
        if all(m.in_features == down.out_features and m.out_features == down.in_features for _, m in ups) \
                and down.in_features != down.out_features:
            return {**{p: "colwise" for p, _ in ups}, down_path: "rowwise"}
    return None


def read_mlps(model: torch.nn.Module, roles: Roles) -> None:
    """Feed-forwards: the smallest module (deepest first) whose unclaimed Linears form an MLP pattern."""
    named = sorted(model.named_modules(), key=lambda item: -item[0].count("."))
    for path, module in named:
        if not path or isinstance(module, ATTENTION_TYPES) or _inside(path, roles.heads):
            continue
        linears = [(p, m) for p, m in _linears(module, path, set(roles.styles)) if not _inside(p, roles.heads)]
        styles = _mlp_styles(linears) if 2 <= len(linears) <= 3 else None
        if styles is not None and _hidden_norm(module, linears) is None:
            roles.styles.update(styles)
            roles.widths.update(m.out_features for p, m in linears if styles[p] == "rowwise")


def _hidden_norm(module: torch.nn.Module, linears) -> str | None:
    """A norm over the MLP's hidden width (between its Linears), or any other module holding a parameter as wide as
    it (a ConvNeXt GRN's gamma, a layer scale), needs the whole hidden: the pattern is refused."""
    hidden = {m.in_features for _, m in linears[-1:]}
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.Linear):
            continue
        if (_norm_width(child) in hidden and list(child.parameters())) \
                or any(p.numel() in hidden for p in child.parameters(recurse=False)):
            return name
    return None


def read_roles(model: torch.nn.Module, shard_norms: bool = True) -> Roles:
    """Every Linear's role in `model` (see the module docstring for the order and why); `shard_norms=False` leaves
    attention whose Q/K norm spans all heads whole."""
    roles = Roles(shard_norms=shard_norms)
    read_attentions(model, roles)
    read_packed(model, roles)
    read_mlps(model, roles)  # before modulation: an MLP's up projection is k x the width too
    read_modulation(model, roles)
    return roles
