"""What one denoising step costs each rank of a (dp, cfg, ring, ulysses, tp) layout: FLOPs and bytes sent, by kind.

The full-size model on the meta device gives every Linear's shape and which ones the plan shards (diffusers' own
`resolve_tp_shard_specs`, through `sharding.sharded_names`); the trace (`trace.py`) gives the rows each one sees. Per
rank and forward:

- Linear: `2 x rows x in x out`, divided by `tp` when the plan shards it, and its rows by `ulysses x ring` when it
  runs on the split sequence;
- attention: `4 x batch x query rows x key rows x heads x head_dim` (QK^T and PV), divided by `tp x ulysses x ring`
  inside the split region (Ulysses gives each rank all rows of fewer heads, ring a share of the query rows over all
  keys), by `tp` outside it;
- tensor parallelism: one all-reduce per rowwise Linear (or per coalesced group), one all-gather per gathered
  Linear (or hoist source), of the Linear's output on this rank's rows;
- Ulysses: four all-to-alls per split attention (query, key, value, output), each of this rank's tensor;
- ring: what diffusers 0.42 runs, one all-gather of this rank's keys and values per split attention
  (`TemplatedRingAttention`, `rotate_method="allgather"`); a point-to-point ring sends the same bytes in
  `ring - 1` steps;
- CFG parallelism: each rank of the pair runs one of the two forwards, then one all-gather of the prediction;
- data parallelism: nothing.

Bytes are what each rank *sends* under ring algorithms, in bf16: an all-reduce of X bytes over n ranks sends
`2 (n-1)/n X`, an all-gather or all-to-all `(n-1)/n X` of its output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...compat.plans import cp_plan_of
from ...parallel.layouts import Layout
from ...parallel.rules import collective_groups, expand
from ...tp_plans.styles import ShardedRMSNorm
from .trace import Forward, Trace, module_patterns

BYTES = 2  # bf16 activations
#: The kinds of traffic, in report order: TP's two, Ulysses', ring's (a K/V all-gather in diffusers), CFG's.
KINDS = ("all_reduce", "all_gather", "all_to_all", "ring", "cfg")


@dataclass(frozen=True)
class Shapes:
    """What the full-size model contributes, independent of the layout."""

    #: Linear name -> (pattern, in_features, out_features).
    linears: dict[str, tuple[str, int, int]]
    #: Pattern of every attention module (one entry per module).
    attention: tuple[str, ...]
    #: Query heads x head width of every attention call.
    heads: int
    head_dim: int
    #: `(kind, Linear names)` per tensor-parallel collective (`rules.collective_groups`).
    collectives: tuple[tuple[str, tuple[str, ...]], ...]
    #: The Linears whose outputs are the prediction (what a CFG pair exchanges).
    outputs: tuple[str, ...]


def model_shapes(model: torch.nn.Module, plan: dict) -> Shapes:
    patterns = module_patterns(model)
    linears = {name: (patterns[name], module.in_features, module.out_features)
               for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    # A `ShardedRMSNorm` all-reduces one float32 per row: counted like a Linear with 2 bf16 outputs per row.
    linears |= {target.name: (patterns[target.name], target.module.weight.shape[0], 2)
                for target in expand(model, plan) if isinstance(target.style, ShardedRMSNorm)}
    attention = tuple(patterns[name] for name, module in model.named_modules() if hasattr(module, "processor"))
    cp_plan = cp_plan_of(type(model)) or {}
    outputs = tuple(key for key, entry in cp_plan.items() if hasattr(entry, "gather_dim")) or ("proj_out",)
    collectives = tuple((kind, tuple(t.name for t in targets)) for kind, targets in collective_groups(model, plan))
    return Shapes(linears, attention, model.config.num_attention_heads, model.config.attention_head_dim, collectives,
                  tuple(name for name in outputs if name in linears))


@dataclass
class Costs:
    """Per rank, per denoising step."""

    linear_flops: float = 0.0
    attention_flops: float = 0.0
    sent: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    collectives: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    def add(self, kind: str, count: int, sent: float) -> None:
        self.collectives[kind] += count
        self.sent[kind] += sent


def step_costs(shapes: Shapes, sharded: set[str], trace: Trace, layout: Layout) -> Costs:
    """What one step costs one rank of `layout`; `sharded` names the parameters the plan splits at `layout.tp`."""
    if layout.cfg > 1 and trace.forwards_per_step < 2:
        raise ValueError("cfg=2 needs two forwards per step (true CFG); this trace has one.")
    costs = Costs()
    forwards = trace.step[: trace.forwards_per_step // layout.cfg]
    for forward in forwards:
        _forward_costs(costs, shapes, sharded, forward, layout)
    if layout.cfg > 1:
        prediction = sum(call.rows * shapes.linears[name][2] * BYTES for name in shapes.outputs
                         for call in forwards[0].linears.get(shapes.linears[name][0], ())[:1])
        costs.add("cfg", 1, prediction)
    return costs


def _rows(call, layout: Layout) -> float:
    return call.rows / layout.context if call.split and call.sequence else call.rows


def _forward_costs(costs: Costs, shapes: Shapes, sharded: set[str], forward: Forward, layout: Layout) -> None:
    tp, ulysses, ring = layout.tp, layout.ulysses, layout.ring
    for name, (pattern, fan_in, fan_out) in shapes.linears.items():
        share = tp if f"{name}.weight" in sharded else 1
        rows = sum(_rows(call, layout) for call in forward.linears.get(pattern, ()))
        costs.linear_flops += 2 * rows * fan_in * fan_out / share
    width = shapes.heads * shapes.head_dim
    for pattern in shapes.attention:
        for call in forward.attention.get(pattern, ()):
            parts = tp * ulysses * ring if call.split else tp
            costs.attention_flops += 4 * call.batch * call.query_rows * call.key_rows * width / parts
            if not call.split:
                continue
            query = call.batch * call.query_rows / layout.context * width / tp * BYTES
            key = call.batch * call.key_rows / layout.context * width / tp * BYTES
            if ulysses > 1:  # this rank's query, key, value and output, each (ulysses-1)/ulysses of it sent
                costs.add("all_to_all", 4, (2 * query + 2 * key) * (ulysses - 1) / ulysses)
            if ring > 1:  # after Ulysses: key rows / ring of heads / (tp x ulysses); K and V to ring - 1 peers
                costs.add("ring", 1, 2 * key * (ring - 1))
    if tp > 1:
        for kind, names in shapes.collectives:
            factor = 2 * (tp - 1) / tp if kind == "all_reduce" else (tp - 1) / tp
            for index in range(len(forward.linears.get(shapes.linears[names[0]][0], ()))):
                size = sum(_output_bytes(forward, shapes, name, index, layout) for name in names)
                costs.add(kind, 1, factor * size)


def _output_bytes(forward: Forward, shapes: Shapes, name: str, index: int, layout: Layout) -> float:
    """Bytes of Linear `name`'s output at its `index`-th call of the forward (0 if the trace never saw it run)."""
    pattern, _, fan_out = shapes.linears[name]
    calls = forward.linears.get(pattern, ())
    return _rows(calls[min(index, len(calls) - 1)], layout) * fan_out * BYTES if calls else 0.0
