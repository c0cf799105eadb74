"""The one tensor-parallel style we add to diffusers' `_tp_plan` vocabulary.

diffusers' plans say `"colwise"`, `"rowwise"`, `PackedColwiseParallel(blocks)` or
`PackedRowwiseParallel(blocks)`. None of them fits a Linear whose *small* output every rank needs
whole, such as an AdaLN modulation projection (`temb -> 6 x hidden` shift/scale/gate vectors that
every rank applies to its full hidden states) or an input embedder feeding the residual stream.
Stock plans therefore leave those replicated: 28% of FLUX.1, 33% of Qwen-Image, 39% of MiniMax-H3.
"""

from __future__ import annotations


class GatheredColwiseParallel:
    """Column-wise shard (weight rows and bias), then all-gather the output across the TP group.

    Each rank stores and multiplies 1/tp of the weight; one all-gather of the (small) output gives
    every rank the exact full result, so the Linear needs no partner and nothing downstream changes.
    Loads stream only each rank's slice off safetensors, like `"colwise"`.
    """

    def __repr__(self) -> str:
        return "GatheredColwiseParallel()"

    def __eq__(self, other) -> bool:
        return isinstance(other, GatheredColwiseParallel)

    def __hash__(self) -> int:
        return hash(GatheredColwiseParallel)
