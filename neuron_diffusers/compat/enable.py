"""A transactional `enable_parallelism` (gaps 3 and 14 of `compat/__init__.py`): a failure anywhere leaves the model
exactly as it was, and the context-parallel hooks are registered after TP's."""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch

from .context import attach_context_parallel, cp_plan_or_refuse, processors, split


def _snapshot(model: torch.nn.Module) -> list:
    """Every module's class and attributes, with the contents of its dicts (parameters, buffers, hooks, children).

    Restoring writes the saved contents back into the *same* dict objects, so hook handles taken
    before the failed call stay valid. Only plain dicts are mutable state here (a config's
    `FrozenDict` is restored by reference). Classes: `coalesce` swaps some modules' classes.
    """
    return [
        (module, type(module),
         {k: (v, dict(v) if type(v) in (dict, OrderedDict) else None) for k, v in vars(module).items()})
        for module in model.modules()
    ]


def _restore(snapshot: list) -> None:
    for module, cls, saved in snapshot:
        module.__class__ = cls
        for key in [k for k in vars(module) if k not in saved]:
            del module.__dict__[key]
        for key, (value, contents) in saved.items():
            if contents is not None:
                value.clear()
                value.update(contents)
            module.__dict__[key] = value


def wrap_enable_parallelism(stock):
    """All or nothing: a failure anywhere leaves the model exactly as it was (gap 3); CP hooks after TP (gap 14)."""

    @functools.wraps(stock)
    def enable_parallelism(self, *, config, cp_plan=None):
        config, cp, _ = split(config)
        plan = cp_plan_or_refuse(type(self), cp_plan) if cp is not None else None
        snapshot = _snapshot(self)
        # Processors are plain objects, outside the module snapshot: a stale `_parallel_config` left on them would
        # keep routing attention through Ulysses/ring on a model that is no longer split.
        saved = [(p, p._parallel_config) for p in processors(self)]
        try:
            if cp is None:
                return stock(self, config=config, cp_plan=cp_plan)
            stock(self, config=config, cp_plan={})  # checks, meshes, backend, processors, TP: no CP hooks yet
            attach_context_parallel(self, self._parallel_config, plan)
        except BaseException:
            _restore(snapshot)
            for processor, parallel_config in saved:
                processor._parallel_config = parallel_config
            raise

    return enable_parallelism
