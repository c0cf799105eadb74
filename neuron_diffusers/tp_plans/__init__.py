"""Our tensor-parallel plans, one data file per family, and the switch between them and stock.

`register()` (run by `import neuron_diffusers`) sets each model class's `_tp_plan` to ours, so the
stock `Model.from_pretrained(..., parallel_config=TensorParallelConfig(mesh=mesh))` and
`enable_parallelism` use them with no other change. Stock plans stay reachable through
`stock_plan(cls)` and `using_plan(cls, plan)`, for comparison and benchmarks.
"""

from __future__ import annotations

import contextlib

from . import flux, flux2, hunyuanvideo, minimax_h3, qwenimage, qwenimage21
from .styles import GatheredColwiseParallel, PartialRowwiseParallel

FAMILY_PLANS = {
    "flux": flux,
    "flux2": flux2,
    "qwenimage": qwenimage,
    "qwenimage21": qwenimage21,
    "h3": minimax_h3,
    "hunyuanvideo": hunyuanvideo,  # the worked example of docs/authoring.md; no tiny pipeline
}

_STOCK_PLANS: dict[str, dict | None] = {}


def model_class(family: str):
    import diffusers

    return getattr(diffusers, FAMILY_PLANS[family].MODEL_CLASS)


def register() -> None:
    """Make our plans the classes' `_tp_plan`, remembering stock's (H3 and HunyuanVideo have none)."""
    for family, module in FAMILY_PLANS.items():
        cls = model_class(family)
        _STOCK_PLANS.setdefault(cls.__name__, cls.__dict__.get("_tp_plan"))
        cls._tp_plan = module.PLAN


def stock_plan(cls) -> dict | None:
    """The plan diffusers ships for `cls` (None for a class it does not plan)."""
    return _STOCK_PLANS[cls.__name__] if cls.__name__ in _STOCK_PLANS else cls._tp_plan


@contextlib.contextmanager
def using_plan(cls, plan: dict | None):
    """Load or shard `cls` with `plan` inside the block, e.g. `using_plan(cls, stock_plan(cls))`."""
    previous = cls.__dict__.get("_tp_plan")
    cls._tp_plan = plan
    try:
        yield
    finally:
        cls._tp_plan = previous


__all__ = ["FAMILY_PLANS", "GatheredColwiseParallel", "PartialRowwiseParallel", "model_class", "register", "stock_plan", "using_plan"]
