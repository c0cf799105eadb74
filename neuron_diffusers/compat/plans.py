"""The plan registry: the class attributes stock reads plans and repeated blocks from (gaps 6 and 17 of
`compat/__init__.py`).

`_tp_plan`, `_cp_plan` and `_repeated_blocks` are read and written here only. The plans themselves are pushed in
(`register`, called once per family by `neuron_diffusers/__init__.py`): this module names no family, so it imports
none of `families`, `pipelines` or `tiny`.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from diffusers.models.modeling_utils import ModelMixin

PRIVATE_NAMES = (
    (ModelMixin, "_cp_plan"),
    (ModelMixin, "compile_repeated_blocks"),
)


class ContextParallelQuirks(Protocol):
    """What a family whose attention stock context parallelism cannot split as is adds (e.g. Qwen-Image-2.1's)."""

    def check(self, cp_config) -> None:
        """Refuse a `ContextParallelConfig` the model cannot run, before any weight is read."""

    def install(self, model: torch.nn.Module, cp_config, cp_rank: int, cp_size: int) -> None:
        """Hook `model` before diffusers' `apply_context_parallel` registers the plan's hooks."""


#: Stock's `_tp_plan` of each registered class (None: diffusers ships none), keyed by the class object.
_STOCK_PLANS: dict[type, dict | None] = {}
_CP_QUIRKS: dict[type, ContextParallelQuirks] = {}
_UNSET = object()


def register(model_class: type, tp_plan: dict, cp_plan: dict | None = None,
             cp_quirks: ContextParallelQuirks | None = None) -> None:
    """Make `tp_plan` the class's `_tp_plan`, remembering stock's; give it `cp_plan` where diffusers ships none.

    Idempotent: a second call keeps the first stock plan it remembered.
    """
    _STOCK_PLANS.setdefault(model_class, model_class.__dict__.get("_tp_plan"))
    model_class._tp_plan = tp_plan
    if cp_plan is not None and model_class._cp_plan is None:
        model_class._cp_plan = cp_plan
    if cp_quirks is not None:
        _CP_QUIRKS[model_class] = cp_quirks


def cp_quirks_of(model_or_class) -> ContextParallelQuirks | None:
    """The registered context-parallel quirks of a model (or class), by class: subclasses inherit them."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return next((_CP_QUIRKS[base] for base in cls.__mro__ if base in _CP_QUIRKS), None)


def tp_plan_of(cls_or_model) -> dict | None:
    """The plan `from_pretrained(parallel_config=TensorParallelConfig(...))` shards a class with, or the plan a model
    was sharded with (`record_tp_plan`; else its class's)."""
    return cls_or_model._tp_plan


def record_tp_plan(model: torch.nn.Module, plan: dict) -> None:
    """Remember on `model` the plan it was sharded with (`using_plan` restores the class default after the load), so
    later readers see that plan: stock `enable_parallelism` reads `self._tp_plan`, LoRA fusing `tp_plan_of`."""
    model._tp_plan = plan


def cp_plan_of(cls) -> dict | None:
    """The context-parallel plan (`_cp_plan`) diffusers splits `cls`'s sequence with (None: the class has none)."""
    return getattr(cls, "_cp_plan", None)


#: Classes loaded inside `using_cp_plan(..., route=True)`: their processors that bypass dispatch are routed.
_ROUTED: set[type] = set()


@contextlib.contextmanager
def using_cp_plan(cls, plan: dict | None, route: bool = False):
    """Load `cls` under context parallelism with `plan` as its `_cp_plan` inside the block (None: the class's own),
    and where `route`, its attention processors that call SDPA themselves routed through diffusers' dispatch when the
    plan is attached (`attention_route.py`): a drafted family's verified plan, which no class attribute holds."""
    previous = cls.__dict__.get("_cp_plan", _UNSET)
    if plan is not None:
        cls._cp_plan = plan
    if route:
        _ROUTED.add(cls)
    try:
        yield
    finally:
        _ROUTED.discard(cls)
        if previous is _UNSET:
            if "_cp_plan" in cls.__dict__:
                del cls._cp_plan
        else:
            cls._cp_plan = previous


def routes_attention(model: torch.nn.Module) -> bool:
    """Whether `model` is loaded inside `using_cp_plan(..., route=True)`."""
    return type(model) in _ROUTED


def stock_plan(cls) -> dict | None:
    """The plan diffusers ships for `cls` (None for a class it does not plan)."""
    return _STOCK_PLANS[cls] if cls in _STOCK_PLANS else cls._tp_plan


@contextlib.contextmanager
def using_plan(cls, plan: dict | None):
    """Load or shard `cls` with `plan` inside the block, e.g. `using_plan(cls, stock_plan(cls))`."""
    previous = cls.__dict__.get("_tp_plan")
    cls._tp_plan = plan
    try:
        yield
    finally:
        cls._tp_plan = previous


def compile_blocks(transformer: torch.nn.Module, block_classes: list[str], **compile_kwargs) -> None:
    """Stock `compile_repeated_blocks` over `block_classes` (which it reads from `_repeated_blocks`), in place."""
    stock_blocks = transformer.__dict__.get("_repeated_blocks")
    transformer._repeated_blocks = block_classes
    try:
        transformer.compile_repeated_blocks(**compile_kwargs)
    finally:
        if stock_blocks is None:
            del transformer._repeated_blocks
        else:
            transformer._repeated_blocks = stock_blocks


def repeated_blocks(transformer: torch.nn.Module) -> list[str]:
    """The block classes the model declares as repeated (what stock compiles by default)."""
    return list(getattr(transformer, "_repeated_blocks", ()) or ())
