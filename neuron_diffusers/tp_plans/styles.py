"""The tensor-parallel styles we add to diffusers' `_tp_plan` vocabulary.

diffusers' plans say `"colwise"`, `"rowwise"`, `PackedColwiseParallel(blocks)` or
`PackedRowwiseParallel(blocks)`. Two things they cannot say:

- A Linear whose *small* output every rank needs whole, such as an AdaLN modulation projection
  (`temb -> 6 x hidden` shift/scale/gate vectors that every rank applies to its full hidden states).
  Stock plans leave those replicated: 28% of FLUX.1, 33% of Qwen-Image, 39% of MiniMax-H3.
  `GatheredColwiseParallel` shards them; with `hoist_from` all of them are gathered in one collective.
- Where a rowwise Linear's all-reduce happens. Per-collective latency dominates small collectives, and a
  dual-stream (MMDiT) block's image and text streams can be reduced together: `PartialRowwiseParallel`.

- An RMSNorm over the features a colwise Linear split, such as a Q/K norm over all heads at once (Wan,
  SkyReels-V2, ChronoEdit, LTX-Video: RMSNorm over `heads x head_dim`): `ShardedRMSNorm`.

All are data, read by `compat/tp_loading.py` (layout) and `parallel/coalesce.py` / `parallel/sharded_norm.py`
(the forward-time behaviour).
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


class ShardedRMSNorm(_Style):
    """An RMSNorm over a feature dimension that a colwise Linear in front of it has split across the TP group.

    Each rank holds its slice of the norm's weight (and bias), laid out like the colwise Linear's output, and
    computes the mean square of the *whole* feature vector with one all-reduce of its local sum of squares
    (`tokens x 1` floats, float32), so the result equals one process up to the summation order. The rule names the
    norm module itself (`"blocks.*.attn1.norm_q": ShardedRMSNorm()`), next to `"colwise"` for the Linear feeding it.
    `torch.nn.RMSNorm` and diffusers' `RMSNorm` are supported (`parallel/sharded_norm.py`, which mirrors each one's
    arithmetic).

    Why not gather Q/K before the norm: that all-gathers `tokens x width` per norm (and slices it back), where this
    reduces `tokens x 1`. For Wan2.1-14B at 1280x720x81 (75,600 tokens, width 5120) one gathered Q is 738 MiB
    (bf16) on each rank, against 0.29 MiB reduced here, for the same number of collectives; and leaving attention whole
    instead (what a plan could do without this) holds 5.1 x total/8 per rank at TP=8.
    """
