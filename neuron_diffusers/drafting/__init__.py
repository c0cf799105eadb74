"""Tensor-parallel plans drafted from a transformer's module tree (any DiT), then verified by numbers.

`structure.py` reads roles from the module tree on the meta device, `draft.py` writes them as plan rules,
`tiny.py` shrinks a class's default config and synthesizes a forward call, `proof.py` compares TP=2 with one process
on spawned CPU ranks, `coverage.py` runs all of it over every transformer class diffusers exports.
"""

from .draft import Draft, draft_plan
from .structure import Note

__all__ = ["Draft", "Note", "draft_plan"]
