"""Step-cache internals (`parallel/cache.py`, gap 9 of `compat/__init__.py`): the block metadata FirstBlockCache and
MagCache look up, which block lists they hook, the hooks' names, and the two decision points (FirstBlockCache's
data-dependent one, TaylorSeer's counter) that `cache.py` wraps per hook instance so a group of ranks takes every
decision together."""

from __future__ import annotations

import dataclasses

import torch
from diffusers import hooks
from diffusers.hooks import _common, _helpers, first_block_cache, mag_cache, taylorseer_cache


def _module_with_hook_registry() -> torch.nn.Module:
    module = torch.nn.Identity()
    hooks.HookRegistry.check_if_exists_or_initialize(module)
    return module


PRIVATE_NAMES = (
    (_common, "_ALL_TRANSFORMER_BLOCK_IDENTIFIERS"),
    (_helpers, "TransformerBlockRegistry"),
    (_helpers, "TransformerBlockMetadata"),
    (_helpers.TransformerBlockMetadata, "_cls"),
    (_helpers.TransformerBlockMetadata, "_cached_parameter_indices"),
    (first_block_cache, "_FBC_LEADER_BLOCK_HOOK"),
    (first_block_cache, "_FBC_BLOCK_HOOK"),
    (first_block_cache.FBCHeadBlockHook, "_should_compute_remaining_blocks"),
    (taylorseer_cache, "_TAYLORSEER_CACHE_HOOK"),
    (taylorseer_cache.TaylorSeerCacheHook, "_measure_should_compute"),
    (mag_cache, "_MAG_CACHE_LEADER_BLOCK_HOOK"),
    (mag_cache, "_MAG_CACHE_BLOCK_HOOK"),
    (mag_cache, "FLUX_MAG_RATIOS"),  # read by parallel/cache.py (`mag_ratios=flux`)
)

#: Instance attributes read here (set at run time, so tests/test_patches.py checks them on a fresh instance from the
#: factory): (factory, attribute).
PRIVATE_INSTANCE_ATTRIBUTES = (
    (first_block_cache.FBCSharedBlockState, "head_block_residual"),
    (mag_cache.MagCacheState, "should_compute"),
    (_module_with_hook_registry, "_diffusers_hook"),  # where a module's HookRegistry lives
)

#: diffusers' published FLUX.1 magnitude ratios for MagCache.
FLUX_MAG_RATIOS = mag_cache.FLUX_MAG_RATIOS


def cache_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks diffusers' block caches hook: every block of the top-level ModuleLists it recognises by name."""
    return [block for name, child in transformer.named_children()
            if name in _common._ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
            for block in child]


def block_metadata(cls: type) -> tuple[int, int | None] | None:
    """Which outputs of block class `cls` are `hidden_states` and `encoder_hidden_states` (None: unregistered)."""
    try:
        metadata = _helpers.TransformerBlockRegistry.get(cls)
    except ValueError:
        return None
    return metadata.return_hidden_states_index, metadata.return_encoder_hidden_states_index


def register_block_metadata(cls: type, hidden_states_index: int, encoder_hidden_states_index: int | None) -> None:
    """Tell FirstBlockCache and MagCache which outputs of `cls` are which (its inputs keep the stock names)."""
    _helpers.TransformerBlockRegistry.register(cls, _helpers.TransformerBlockMetadata(
        return_hidden_states_index=hidden_states_index, return_encoder_hidden_states_index=encoder_hidden_states_index))


def inherit_block_metadata(cls: type, base: type) -> None:
    """Register `cls`, a subclass with `base`'s forward signature (`coalesce`), with a copy of `base`'s metadata."""
    copy = dataclasses.replace(_helpers.TransformerBlockRegistry.get(base), _cls=None, _cached_parameter_indices=None)
    _helpers.TransformerBlockRegistry.register(cls, copy)


_CACHE_HOOKS = (first_block_cache._FBC_LEADER_BLOCK_HOOK, first_block_cache._FBC_BLOCK_HOOK,
                mag_cache._MAG_CACHE_LEADER_BLOCK_HOOK, mag_cache._MAG_CACHE_BLOCK_HOOK,
                taylorseer_cache._TAYLORSEER_CACHE_HOOK)


def _hooks(transformer: torch.nn.Module, hook_name: str) -> list[tuple[str, hooks.ModelHook]]:
    registries = ((name, getattr(module, "_diffusers_hook", None)) for name, module in transformer.named_modules())
    return [(name, registry.get_hook(hook_name)) for name, registry in registries
            if registry is not None and registry.get_hook(hook_name) is not None]


def cache_hooked_modules(transformer: torch.nn.Module) -> list[str]:
    """The names of the modules that hold a FirstBlockCache, MagCache or TaylorSeer hook."""
    return sorted({module for name in _CACHE_HOOKS for module, _ in _hooks(transformer, name)})


def wrap_first_block_decisions(transformer: torch.nn.Module, decide) -> int:
    """Route each FirstBlockCache head hook's skip decision through `decide`; returns how many hooks.

    `decide(stock, residual, previous, context)` gets stock's decision function, this step's first-block residual,
    the one kept from the last computed step (None at the first) and the `cache_context` name, and returns whether
    to compute the remaining blocks. Replaced per hook instance: `disable_cache` drops the hook and the override.
    """
    leaders = _hooks(transformer, first_block_cache._FBC_LEADER_BLOCK_HOOK)
    for _, hook in leaders:
        stock = hook._should_compute_remaining_blocks

        @torch.compiler.disable  # as stock's: a Python branch on a float, never traced
        def decision(residual, *, hook=hook, stock=stock):
            previous = hook.state_manager.get_state().head_block_residual
            return decide(stock, residual, previous, hook.state_manager.context.name)

        hook._should_compute_remaining_blocks = decision
    return len(leaders)


def wrap_taylorseer_decisions(transformer: torch.nn.Module, record) -> int:
    """Call `record(context, should_compute)` with each TaylorSeer hook's decision; returns how many hooks."""
    hooked = _hooks(transformer, taylorseer_cache._TAYLORSEER_CACHE_HOOK)
    for _, hook in hooked:
        stock = hook._measure_should_compute

        @torch.compiler.disable  # as stock's
        def decision(*, hook=hook, stock=stock):
            should_compute, state = stock()
            record(hook.state_manager.context.name, should_compute)
            return should_compute, state

        hook._measure_should_compute = decision
    return len(hooked)


def mag_cache_decision(transformer: torch.nn.Module) -> tuple[str, bool]:
    """What MagCache's head hook decided at the last forward: (`cache_context` name, computed the blocks)."""
    (_, hook), = _hooks(transformer, mag_cache._MAG_CACHE_LEADER_BLOCK_HOOK)
    return hook.state_manager.context.name, hook.state_manager.get_state().should_compute
