"""The tensor-parallel styles we add to diffusers' `_tp_plan` vocabulary.

diffusers' plans say `"colwise"`, `"rowwise"`, `PackedColwiseParallel(blocks)` or
`PackedRowwiseParallel(blocks)`. Two things they cannot say:

- A Linear whose *small* output every rank needs whole, such as an AdaLN modulation projection
  (`temb -> 6 x hidden` shift/scale/gate vectors that every rank applies to its full hidden states).
  Stock plans leave those replicated: 28% of FLUX.1, 33% of Qwen-Image, 39% of MiniMax-H3.
  `GatheredColwiseParallel` shards them; with `hoist_from` all of them are gathered in one collective.
- Where a rowwise Linear's all-reduce happens. Per-collective latency dominates small collectives, and a
  dual-stream (MMDiT) block's image and text streams can be reduced together: `PartialRowwiseParallel`.

Both are data, read by `compat/tp_loading.py` (layout) and `parallel/coalesce.py` (the
forward-time behaviour).
"""

from __future__ import annotations


class _Style:
    """Value semantics (equal when the class and arguments are), so plans compare and hash like data."""

    def _args(self) -> dict:
        return dict(vars(self))

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self._args().items() if value is not None)
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._args() == self._args()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self._args().items()))))


class GatheredColwiseParallel(_Style):
    """Column-wise shard (weight rows and bias), then all-gather the output across the TP group.

    Each rank stores and multiplies 1/tp of the weight; one all-gather of the (small) output gives every rank
    the exact full result, so the Linear needs no partner and nothing downstream changes. Loads stream only
    each rank's slice off safetensors, like `"colwise"`.

    `hoist_from="time_text_embed"` declares that the Linear's input is `silu(<output of that module>)` (cast
    to the Linear's dtype), as for every AdaLN modulation projection. Then all Linears hoisted from one module
    are computed right after it runs, from their local shards, and gathered in **one** all-gather per call of
    that module, instead of one per Linear. `first_half_if="zero_cond_t"`: when that model config flag is
    true, the Linear reads only the first half of the batch (Qwen-Image's `zero_cond_t` feeds `txt_mod` and
    `norm_out` the conditional half). In eager mode each hoisted Linear checks that its actual input is the
    declared one, and falls back to its own all-gather (with a warning) when it is not.
    """

    def __init__(self, hoist_from: str | None = None, first_half_if: str | None = None):
        if first_half_if is not None and hoist_from is None:
            raise ValueError("GatheredColwiseParallel(first_half_if=...) describes a hoisted input: give hoist_from "
                             "too.")
        self.hoist_from = hoist_from
        self.first_half_if = first_half_if


class PartialRowwiseParallel(_Style):
    """Row-wise shard like `"rowwise"`, but the output leaves the Linear as this rank's partial sum.

    The partial sums of all such Linears that share `reduced_at` within one block are all-reduced together,
    in one call, where their outputs are first needed whole:

    - `reduced_at="attn"` (any module path relative to the block): the outputs of that module's forward are
      all partial sums (e.g. a dual-stream attention returning `to_out` and `to_add_out` results) and are
      reduced as it returns.
    - `reduced_at="block"`: the block's forward reduces them. The block class must be one that
      `neuron_diffusers.coalesce` has a coalesced forward for: FLUX.1, FLUX.2 and Qwen-Image dual-stream blocks,
      whose two feed-forwards are then reduced together (stock's operations, in an order that computes both
      before either is used).

    Arithmetic equals stock rowwise (each rank adds `bias / tp`, exactly as DTensor's rowwise does before its
    all-reduce); only the number of collectives changes.
    """

    def __init__(self, reduced_at: str):
        self.reduced_at = reduced_at
