"""Our tensor-parallel plans: data only, one file per family (`<family>.py`: `PLAN` and `MODEL_CLASS`).

A plan is diffusers' `_tp_plan` format (module-path globs to styles) plus the styles of `styles.py`.
`import neuron_diffusers` makes each plan its class's default (`compat/plans.py`); stock plans stay reachable
through `neuron_diffusers.stock_plan(cls)` and `neuron_diffusers.using_plan(cls, plan)`.
"""

from .styles import GatheredColwiseParallel, PartialRowwiseParallel, ShardedRMSNorm

__all__ = ["GatheredColwiseParallel", "PartialRowwiseParallel", "ShardedRMSNorm"]
