"""Step caching under parallelism: diffusers' own cache hooks, every skip decision taken once for the whole group.

diffusers 0.42 ships step caches behind `transformer.enable_cache(config)`: FirstBlockCache skips the remaining
blocks when the first block's residual barely moved, TaylorSeer predicts hooked modules' outputs between full steps,
MagCache skips on a calibrated magnitude schedule. Each rank decides alone. Under tensor (or context) parallelism a
rank that skips while its peer computes leaves the peer waiting in a block's collective (a hang), or pairs
mismatched collectives. FirstBlockCache decides from data (`.item()` on a ratio of means), which agrees across ranks
only while their activations are bitwise equal: nothing guarantees that across devices, reduction orders or
sequence shards.

`enable_group_cache` installs diffusers' hooks unchanged and routes FirstBlockCache's decision through a vote: each
rank's own decision, all-reduced with MAX over the group (compute if any rank would; one 4-byte all-reduce per
forward), so every rank takes the same branch. The group is any process group: the TP group today, the whole
CP x TP group of an image with context parallelism. TaylorSeer and MagCache decide from step counters and a fixed
schedule, equal on ranks that make the same calls, so they are recorded, not voted on. Every decision is kept:
forwards computed vs served from the cache, per pipeline call.

- Guidance branches: the hooks keep one state per `cache_context` name ("cond" / "uncond"). CFG parallelism computes
  each branch under its own name on its own TP group, so each group votes on its branch only, as a serial run
  decides each branch on its own.
- Context parallelism: each rank sees a sequence shard, so its local decision is not one process's decision; the
  vote then computes whenever any shard moved more than the threshold (never a hang, possibly fewer skips than one
  process). Exact equality with one process would need the metric's sums reduced before the ratio, which diffusers'
  decision function does not expose.
- Compiled blocks: the decision (a Python branch on a float) must stay out of graphs. `suspended()` lifts the hooks
  so `compile.compile_repeated_blocks` can compile each block's own forward; re-installed, the hooks sit around the
  compiled forward (eager decision, no recompiles). Hooks inside a compiled block (TaylorSeer's default: every
  `attn`) are refused by `check_compilable`.
- Blocks: FirstBlockCache and MagCache need diffusers' block metadata (which output is `hidden_states`).
  Qwen-Image-2.1 and MiniMax-H3 blocks have none in diffusers 0.42.1 (registered here), and `coalesce` swaps
  dual-stream blocks to a same-named subclass, which inherits its stock class's metadata here.

Every diffusers-private access (block registry, hook names, decision points) goes through `compat.cache`.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import diffusers
import torch
import torch.distributed as dist
from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks import HookRegistry, ModelHook

from ..compat import cache as compat_cache
from ..compat.cache import FLUX_MAG_RATIOS
from .blocks import block_types_of, cache_metadata_for, cache_metadata_names
from .coalesce import stock_class

#: Caches whose decisions this module shares or records, by config class name.
SUPPORTED = ("FirstBlockCacheConfig", "TaylorSeerCacheConfig", "MagCacheConfig")
#: Other diffusers caches, and why they are refused under parallelism.
REFUSED = {
    "SeaCacheConfig": "SeaCache votes over the whole default process group (every data-parallel replica too), runs "
                      "uncached on DTensor-sharded blocks, and needs step indexes our pipelines' contexts do not pass",
    "PyramidAttentionBroadcastConfig": "its decisions come from a timestep callback that the runner cannot share yet",
    "FasterCacheConfig": "its decisions come from a timestep callback that the runner cannot share yet",
    "TextKVCacheConfig": "it caches text keys and values, not denoising steps (Qwen-Image-2.1 has its own KV cache)",
}
#: `--cache NAME:...` on the command line -> diffusers config class.
CLI_NAMES = {"first-block": "FirstBlockCacheConfig", "taylorseer": "TaylorSeerCacheConfig", "mag": "MagCacheConfig"}
#: The named diffusers hook on the transformer that counts forwards.
COUNT_HOOK = "neuron_diffusers.cache_counts"


def check_cache_config(config) -> None:
    """Reject a cache this module cannot run, or a nonsensical setting, from the config alone."""
    name = type(config).__name__
    if name in REFUSED:
        raise ValueError(f"{name} is not supported with neuron_diffusers: {REFUSED[name]}. Use one of "
                         f"{', '.join(SUPPORTED)}.")
    supported = (FirstBlockCacheConfig, TaylorSeerCacheConfig, MagCacheConfig)
    if not isinstance(config, supported) or not type(config).__module__.startswith("diffusers."):
        raise ValueError(f"`cache` takes a diffusers cache config ({', '.join(SUPPORTED)}), got {name}.")
    if isinstance(config, FirstBlockCacheConfig):
        threshold = config.threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
                or threshold < 0:
            raise ValueError(f"FirstBlockCacheConfig(threshold={threshold!r}): the threshold is a relative change "
                             "of the first block's residual, a finite number >= 0 (0 never skips; 0.05-0.2 typical).")
    if isinstance(config, TaylorSeerCacheConfig):
        for key, minimum, why in (("cache_interval", 1, "the steps between full computations"),
                                  ("disable_cache_before_step", 1, "at least the first step must compute"),
                                  ("max_order", 0, "the order of the Taylor expansion")):
            value = getattr(config, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"TaylorSeerCacheConfig({key}={value!r}): {why}, an integer >= {minimum}.")


def parse_cache_spec(spec: str, steps: int | None = None):
    """A diffusers cache config from the CLI's `--cache NAME[:VALUE | :KEY=VALUE,...]`, checked.

    `first-block:0.08` sets the threshold; `taylorseer:cache_interval=4,max_order=1` and `mag:threshold=0.06` set
    fields by name (numbers parsed as int or float, `true`/`false` as booleans). MagCache needs its model's magnitude
    ratios: `mag_ratios=flux` takes diffusers' published FLUX.1 ones (`FLUX_MAG_RATIOS`), `calibrate=true` measures
    them (computing every step); its `num_inference_steps` defaults to `steps`, the run's step count.
    """
    name, _, rest = spec.partition(":")
    if name not in CLI_NAMES:
        raise ValueError(f"--cache {spec!r}: unknown cache '{name}'. Choose one of {', '.join(CLI_NAMES)} "
                         "(e.g. first-block:0.08, taylorseer:cache_interval=4).")
    cls = getattr(diffusers, CLI_NAMES[name])
    fields = {}
    for item in filter(None, rest.split(",")):
        key, equals, value = item.partition("=")
        if not equals:
            if name != "first-block" or fields:
                raise ValueError(f"--cache {spec!r}: write settings as KEY=VALUE (only first-block takes a bare "
                                 "threshold, e.g. first-block:0.08).")
            key, value = "threshold", key
        fields[key.strip()] = _cli_value(value.strip())
    if name == "mag":
        if fields.get("mag_ratios") == "flux":
            fields["mag_ratios"] = FLUX_MAG_RATIOS
        if steps is not None:
            fields.setdefault("num_inference_steps", steps)
    try:
        config = cls(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--cache {spec!r}: {error}. See {cls.__name__}'s fields in the diffusers docs.") from None
    check_cache_config(config)
    return config


def _cli_value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def check_cache(config, transformer: torch.nn.Module, compiled_blocks: list[str] | None = None) -> None:
    """Everything `enable_group_cache` would refuse, tried on `transformer` and undone: pass a meta-device model
    (`Checkpoint.meta("transformer")`) to check before any weight is read. `compiled_blocks`: also refuse cache
    hooks inside these block classes (they would be compiled)."""
    check_cache_config(config)
    cache = GroupCache(transformer, config)
    cache.install()
    try:
        if compiled_blocks:
            cache.check_compilable(compiled_blocks)
    finally:
        cache.remove()


@dataclass
class Decision:
    """One cache decision: the branch (`cache_context` name), this rank's own decision, and what the group took."""

    context: str
    local: bool
    shared: bool


@dataclass
class CacheCounts:
    """Transformer forwards of one pipeline call: fully computed, or served (partly) from the cache."""

    computed: int = 0
    cached: int = 0
    by_context: dict = field(default_factory=dict)

    def add(self, context: str, computed: bool) -> None:
        key = "computed" if computed else "cached"
        setattr(self, key, getattr(self, key) + 1)
        self.by_context.setdefault(context, {"computed": 0, "cached": 0})[key] += 1

    def as_dict(self) -> dict:
        return {"computed": self.computed, "cached": self.cached,
                "by_context": {name: dict(counts) for name, counts in self.by_context.items()}}


def sum_counts(counts: list[dict]) -> dict:
    """One image's counts from the ranks that computed its branches (a CFG pair: one branch each)."""
    total = {"computed": 0, "cached": 0, "by_context": {}}
    for part in counts:
        total["computed"] += part["computed"]
        total["cached"] += part["cached"]
        total["by_context"].update(part["by_context"])
    return total


class GroupCache:
    """diffusers' cache hooks on `transformer`, with shared decisions and counts (see the module doc).

    Build it with `enable_group_cache`. `group` is the process group whose ranks compute the same forward (the TP
    group; with context parallelism the CP x TP group); `None` or a group of one: a single process.
    """

    def __init__(self, transformer: torch.nn.Module, config, group=None):
        self.transformer = transformer
        self.config = config
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        #: Every decision since the current (or last) `pipeline_call` began (FirstBlockCache: one per forward).
        self.decisions: list[Decision] = []
        self.counts = CacheCounts()
        #: This rank's forwards over every pipeline call since `install` (what the job's timing table shows).
        self.totals = CacheCounts()
        self._forward: list[bool] | None = None
        self._enabled = False

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def install(self) -> None:
        """Enable the cache and route its decisions here; on any failure the model is left as it was."""
        _register_block_metadata(self.transformer, self.config)
        self.transformer.enable_cache(self.config)
        registry = HookRegistry.check_if_exists_or_initialize(self.transformer)
        try:
            self._wrap_decisions()
            if registry.get_hook(COUNT_HOOK) is None:
                registry.register_hook(_CountForwards(self), COUNT_HOOK)
        except BaseException:
            self.transformer.disable_cache()
            raise
        self._enabled = True

    def remove(self) -> None:
        """Disable the cache and drop this module's hook: the transformer computes every step again."""
        if self._enabled:
            self.transformer.disable_cache()
            self._enabled = False
        HookRegistry.check_if_exists_or_initialize(self.transformer).remove_hook(COUNT_HOOK, recurse=False)
        if getattr(self.transformer, _ATTRIBUTE, None) is self:
            delattr(self.transformer, _ATTRIBUTE)

    @contextmanager
    def suspended(self):
        """The cache's hooks lifted (every step computes), then re-installed around whatever each block's `forward`
        has become: compile blocks' forwards, or warm up every graph, in here."""
        was_enabled = self._enabled
        if was_enabled:
            self.transformer.disable_cache()
            self._enabled = False
        try:
            yield
        finally:
            if was_enabled:
                self.install()

    @contextmanager
    def pipeline_call(self):
        """Around one pipeline call: fresh cache state before and after (stock pipelines reset it at their end,
        MiniMax-H3's modular one does not), a "cond" context for pipelines that set none (FLUX.2, MiniMax-H3; the
        others set their own, which replaces it), and counts for this call only."""
        self.decisions, self.counts = [], CacheCounts()
        if not self._enabled:
            yield self.counts
            return
        HookRegistry.check_if_exists_or_initialize(self.transformer).reset_stateful_hooks()
        try:
            with self.transformer.cache_context("cond"):
                yield self.counts
        finally:
            HookRegistry.check_if_exists_or_initialize(self.transformer).reset_stateful_hooks()

    # -- decisions ----------------------------------------------------------------------------------------------

    def vote(self, local: bool, device: torch.device) -> bool:
        """The group's decision: compute if any rank would (every rank then takes the same branch)."""
        if self.group is None:
            return local
        flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def _record(self, context: str, local: bool, shared: bool) -> None:
        self.decisions.append(Decision(context, local, shared))
        if self._forward is not None:
            self._forward.append(shared)

    def _first_block_decision(self, stock, residual: torch.Tensor, previous: torch.Tensor | None, context: str):
        # A residual of another shape than the last (Qwen-Image-2.1's KV-cache prefill step returns text + image,
        # later steps the image alone) has nothing to compare with: compute, as ParaAttention and cache-dit do
        # (stock fails subtracting the two).
        local = True if previous is not None and previous.shape != residual.shape else stock(residual)
        shared = self.vote(local, residual.device)
        self._record(context, local, shared)
        return shared

    def _wrap_decisions(self) -> None:
        if isinstance(self.config, FirstBlockCacheConfig):
            compat_cache.wrap_first_block_decisions(self.transformer, self._first_block_decision)
        elif isinstance(self.config, TaylorSeerCacheConfig):
            record = lambda context, computed: self._record(context, computed, computed)  # noqa: E731
            if not compat_cache.wrap_taylorseer_decisions(self.transformer, record):
                raise ValueError(
                    f"TaylorSeerCacheConfig matched no module of {type(self.transformer).__name__}, so nothing would "
                    "be cached. Set `cache_identifiers` to regexes over module names "
                    r"(e.g. [r'transformer_blocks\.\d+']) or use_lite_mode=True."
                )

    def _begin_forward(self) -> None:
        self._forward = []

    def _end_forward(self) -> None:
        decided, self._forward = self._forward, None
        if not self._enabled:
            return
        if isinstance(self.config, MagCacheConfig):
            context, computed = compat_cache.mag_cache_decision(self.transformer)
            self._record(context, computed, computed)
            decided = [computed]
        # A forward counts as cached when any hooked module skipped its computation (TaylorSeer: all alike).
        context = self.decisions[-1].context if self.decisions else "cond"
        self.counts.add(context, all(decided))
        self.totals.add(context, all(decided))

    def check_compilable(self, block_classes: list[str]) -> None:
        """Refuse to compile blocks that hold a cache hook inside them: its decision would land in their graphs."""
        block_types = block_types_of(self.transformer, block_classes)
        blocks = [name for name, module in self.transformer.named_modules() if isinstance(module, block_types)]
        inside = [name for name in compat_cache.cache_hooked_modules(self.transformer)
                  if any(name.startswith(f"{block}.") for block in blocks)]
        if inside:
            raise ValueError(
                f"{type(self.config).__name__} hooks modules inside the blocks being compiled ({inside[0]}, ...), so "
                "its skip decision would have to be traced into their graphs. Hook whole blocks instead (TaylorSeer: "
                r"cache_identifiers=[r'transformer_blocks\.\d+', r'single_transformer_blocks\.\d+'] or "
                "use_lite_mode=True), or run this cache without compiling."
            )


class _CountForwards(ModelHook):
    """On the transformer: opens and closes each forward's record of decisions (a named diffusers hook)."""

    def __init__(self, cache: GroupCache):
        super().__init__()
        self.cache = cache

    def pre_forward(self, module, *args, **kwargs):
        self.cache._begin_forward()
        return args, kwargs

    def post_forward(self, module, output):
        self.cache._end_forward()
        return output


_ATTRIBUTE = "_nd_group_cache"


def enable_group_cache(transformer: torch.nn.Module, config, group=None) -> GroupCache:
    """Install `config` (a diffusers cache config) on `transformer` with decisions shared over `group`.

    Every rank of `group` must call it with the same config. Returns the `GroupCache`, which `group_cache_of` finds
    again (the runner, `compile`).
    """
    check_cache_config(config)
    if group_cache_of(transformer) is not None or transformer.is_cache_enabled:
        raise ValueError(f"{type(transformer).__name__} already has a cache enabled. Call `disable_cache()` (or "
                         "`GroupCache.remove()`) first.")
    cache = GroupCache(transformer, config, group)
    cache.install()
    setattr(transformer, _ATTRIBUTE, cache)
    return cache


def group_cache_of(transformer: torch.nn.Module) -> GroupCache | None:
    return getattr(transformer, _ATTRIBUTE, None)


def _register_block_metadata(transformer: torch.nn.Module, config) -> None:
    """Give every hooked block class the metadata FirstBlockCache and MagCache read (before they look it up)."""
    if not isinstance(config, (FirstBlockCacheConfig, MagCacheConfig)):
        return
    blocks = compat_cache.cache_blocks(transformer)
    if not blocks:
        raise ValueError(f"{type(config).__name__} hooks the blocks of a transformer's block lists, and "
                         f"{type(transformer).__name__} has none diffusers recognises. Use TaylorSeerCacheConfig.")
    for cls in dict.fromkeys(type(block) for block in blocks):
        if compat_cache.block_metadata(cls) is not None:
            continue
        # `coalesce` swaps a block to a same-named subclass with a reordered forward of the same signature.
        stock = stock_class(cls)
        if stock is not cls and compat_cache.block_metadata(stock) is not None:
            compat_cache.inherit_block_metadata(cls, stock)
            continue
        own = cache_metadata_for(transformer, cls)
        if own is None:
            raise ValueError(
                f"{type(config).__name__} needs to know which output of {cls.__name__} is `hidden_states`, and "
                f"diffusers has no metadata for it. Use TaylorSeerCacheConfig, or add {cls.__name__} to the "
                "`CACHE_BLOCK_METADATA` of its family's tp_plans/<family>.py."
            )
        compat_cache.register_block_metadata(cls, *own)
    head, tail = (compat_cache.block_metadata(type(block)) for block in (blocks[0], blocks[-1]))
    if isinstance(config, FirstBlockCacheConfig) and (head[1] is None) != (tail[1] is None):
        # FLUX.2: stock FirstBlockCache subtracts the head's (text, image) pair from the tail's one joined tensor.
        raise ValueError(
            f"FirstBlockCacheConfig cannot cache {type(transformer).__name__} in diffusers 0.42.1: its first block "
            f"({type(blocks[0]).__name__}) returns the text and image streams apart and its last one "
            f"({type(blocks[-1]).__name__}) returns them joined, which the cache's residual arithmetic does not "
            "handle (it fails at the first step). Use MagCacheConfig or TaylorSeerCacheConfig for this model."
        )


def __getattr__(name: str):
    """`OWN_BLOCK_METADATA` moved into each family's `tp_plans/<family>.py` (`CACHE_BLOCK_METADATA`)."""
    if name == "OWN_BLOCK_METADATA":
        warnings.warn("neuron_diffusers.parallel.cache.OWN_BLOCK_METADATA is deprecated: block metadata lives in each "
                      "family's tp_plans/<family>.py as CACHE_BLOCK_METADATA.", DeprecationWarning, stacklevel=2)
        return cache_metadata_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
