"""Deprecated: diffusers' privates moved to `neuron_diffusers.compat`, one module per concern.

Kept one release so that `from neuron_diffusers.parallel import patches` (and `patches.X`) keeps working; every name
resolves to its new home with a `DeprecationWarning` saying where.
"""

from __future__ import annotations

import importlib
import warnings

#: Old name -> "module:name" in its new home.
_MOVED = {
    **{name: f"neuron_diffusers.compat.version:{name}" for name in ("check_diffusers_version",)},
    **{name: f"neuron_diffusers.compat.privates:{name}" for name in (
        "PRIVATE_NAMES", "PRIVATE_INSTANCE_ATTRIBUTES", "LAZY_PRIVATE_NAMES", "internal")},
    **{name: f"neuron_diffusers.compat.vae:{name}" for name in (
        "VAE_BLOCKS", "vae_blocks", "posterior_parameters", "vae_encode_output")},
    **{name: f"neuron_diffusers.compat.tp_loading:{name}" for name in ("shard_specs", "local_shard")},
    **{name: f"neuron_diffusers.compat.context:{name}" for name in (
        "attach_context_parallel", "context_parallel_config_of")},
    **{name: f"neuron_diffusers.compat.plans:{name}" for name in (
        "tp_plan_of", "record_tp_plan", "cp_plan_of", "stock_plan", "using_plan", "compile_blocks",
        "repeated_blocks")},
    **{name: f"neuron_diffusers.compat.cache:{name}" for name in (
        "cache_blocks", "block_metadata", "register_block_metadata", "inherit_block_metadata",
        "cache_hooked_modules", "wrap_first_block_decisions", "wrap_taylorseer_decisions", "mag_cache_decision")},
    **{name: f"neuron_diffusers.pipelines.qwenimage21_padding:{name}" for name in (
        "ExactTextPadding", "exact_text_padding")},
    "install": "neuron_diffusers.compat.install:install",
}


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _MOVED[name].split(":")
    warnings.warn(f"neuron_diffusers.parallel.patches.{name} moved to {module}.{attribute}; import it from there "
                  "(this alias goes in the next release).", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted(_MOVED)
