"""Context parallelism (Ulysses, ring) next to tensor parallelism: layouts, meshes, and inputs it cannot split.

diffusers' `ContextParallelConfig` splits the sequence over a ("ring", "ulysses") region of the mesh, and its
attention backends exchange heads for sequence (Ulysses: all-to-all) or rotate key/value blocks (ring) inside that
region; our TP shards heads over "tp". One image then runs on an *image group* of tp x ulysses x ring ranks, and
CFG pairs and dp replicas of such groups tile the world (`distributed.init_distributed`). Everything here is
public logic; the diffusers private names it needs are reached through `compat/`.

What must divide:

- Ulysses splits the heads each TP rank keeps: `(heads / tp) % ulysses == 0` (diffusers' `ulysses_anything` pads
  heads instead, within its own limit).
- The plain modes split every sequence the model's `_cp_plan` names into equal parts: its length must be a
  multiple of ulysses x ring. The runner makes that so with padding that attention masks out (text buckets, H3's
  packed rows), and checks image token counts up front; diffusers' `*_anything` modes take any length, exactly,
  at the price of a size exchange (and a host sync) per attention call, so they are not the compiled path.
- Ring attention applies each rank's mask to every rotated key block: a mask with masked positions would give a
  silently wrong image, so masked padding goes with Ulysses only.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..distributed import build_mesh
from .layouts import Layout, layout_problem, valid_layouts


def describe_layouts(layouts: list[Layout], limit: int = 12) -> str:
    text = ", ".join(f"tp={lay.tp} x ulysses={lay.ulysses} x ring={lay.ring}" for lay in layouts[:limit])
    return text + (f" (and {len(layouts) - limit} more)" if len(layouts) > limit else "")


def check_layout(model_name: str, num_heads: int | None, world_size: int, *, tp: int, ulysses: int, ring: int,
                 cfg: int = 1, ulysses_anything: bool = False) -> None:
    """Reject a TP x CP layout the model or the world cannot take, naming the context-parallel layouts that work."""
    problem = layout_problem(num_heads, world_size, tp, ulysses, ring, ulysses_anything, cfg=cfg)
    if problem is not None:
        working = [lay for lay in valid_layouts(num_heads, world_size, cfg_degrees=(cfg,)) if lay.context > 1]
        raise ValueError(
            f"Cannot run {model_name} with tensor parallelism tp={tp} and context parallelism ulysses={ulysses} x "
            f"ring={ring} on {world_size} ranks: {problem}. Context-parallel layouts that work for {num_heads} heads "
            f"on {world_size} ranks{' with CFG pairs' if cfg > 1 else ''}: {describe_layouts(working) or 'none'}."
        )


# --- meshes handed to diffusers ------------------------------------------------------------------------------------


def _dim_size(mesh, name: str) -> int | None:
    names = mesh.mesh_dim_names or ()
    return mesh.shape[names.index(name)] if name in names else None


def tp_size(tp_config) -> int:
    """The TP degree a config asks for: its mesh's size when it has one (diffusers then ignores `tp_degree`)."""
    if tp_config is None:
        return 1
    return tp_config.mesh.size() if tp_config.mesh is not None else tp_config.tp_degree


def resolve_meshes(cp_config, tp_config, device_type: str, world_size: int):
    """(root, tp mesh or None) for a CP (+ TP) config: the user's meshes checked, or one built in the default order.

    The root carries "ring" and "ulysses" (diffusers' CP setup slices them out of it); TP gets a 1-D mesh.
    """
    tp_degree = tp_size(tp_config)
    if cp_config.mesh is None:
        if tp_config is not None and tp_config.mesh is not None:
            raise ValueError(
                "TensorParallelConfig(mesh=...) was given but ContextParallelConfig(mesh=...) was not: both must come "
                "from one mesh. Pass the whole mesh (with 'ring' and 'ulysses' dimensions, e.g. from "
                "neuron_diffusers.init_distributed(tp=, ulysses=, ring=)) to ContextParallelConfig and mesh['tp'] to "
                "TensorParallelConfig, or pass neither mesh."
            )
        root = build_mesh(device_type, world_size, tp=tp_degree, ulysses=cp_config.ulysses_degree,
                          ring=cp_config.ring_degree)
        return root, (root["tp"] if tp_config is not None else None)
    root = cp_config.mesh
    for name, degree in (("ring", cp_config.ring_degree), ("ulysses", cp_config.ulysses_degree)):
        if _dim_size(root, name) != degree:
            raise ValueError(
                f"ContextParallelConfig(mesh=...) has {name} dimension of size {_dim_size(root, name)} (dims "
                f"{root.mesh_dim_names}), but {name}_degree={degree}. diffusers reads the degree and the mesh "
                f"separately, so they must agree: build the mesh with {name}={degree}, or fix {name}_degree."
            )
    if tp_config is None:
        return root, None
    tp_mesh = tp_config.mesh if tp_config.mesh is not None else (root["tp"] if _dim_size(root, "tp") else None)
    if tp_mesh is None or tp_mesh.size() != tp_degree:
        raise ValueError(
            f"The context-parallel mesh {root.mesh_dim_names} has no 'tp' dimension of size {tp_degree}: pass "
            "TensorParallelConfig(mesh=mesh['tp']) from the same mesh."
        )
    cp_ranks = set(root["ring", "ulysses"].mesh.flatten().tolist())
    shared = cp_ranks & set(tp_mesh.mesh.flatten().tolist())
    if shared != {torch.distributed.get_rank()}:
        raise ValueError(
            f"The tensor-parallel mesh (ranks {sorted(tp_mesh.mesh.flatten().tolist())}) and the context-parallel "
            f"region (ranks {sorted(cp_ranks)}) must cross in exactly this rank; they share {sorted(shared)}. Take "
            "both from one mesh: ContextParallelConfig(mesh=mesh), TensorParallelConfig(mesh=mesh['tp'])."
        )
    return root, tp_mesh


# --- what the runner asks of diffusers for a family ----------------------------------------------------------------


class RunnerMode(NamedTuple):
    """How the runner runs one family under context parallelism (`runner_mode`)."""

    ulysses_anything: bool
    ring_anything: bool
    #: Whether text buckets / packed rows are padded with masked positions (to a multiple of ulysses x ring).
    pad: bool

    @property
    def any_length(self) -> bool:
        return self.ulysses_anything or self.ring_anything


def runner_mode(display_name: str, text: str, ulysses: int, ring: int, any_length: bool, *,
                block_causal: bool) -> RunnerMode:
    """Which diffusers mode gives `display_name` the exact image at any prompt length, or a clear refusal.

    `text` is the adapter's `cp_text`: "fixed" (the pipeline pads to `max_sequence_length` itself), "masked"
    (padding with masked positions makes lengths static), or "none" (no padding here: the `*_anything` modes).
    `block_causal` (the adapter's `cp_block_causal`): ring attention cannot run it. Required, so that no caller
    (job, serve, runner) checks a block-causal model as if it were not.
    """
    if ulysses * ring == 1:
        return RunnerMode(False, False, pad=True)
    if block_causal and ring > 1:
        raise ValueError(f"{display_name}'s block-causal attention needs Ulysses: ring attention would apply one "
                         "rank's part of the mask to every rotated key block. Use --ulysses N without --ring.")
    if text == "masked" and ring > 1 and not any_length:
        if ulysses > 1:
            raise ValueError(
                f"{display_name} pads its sequence with masked positions (static shapes), which ring attention cannot "
                "take (it applies each rank's mask to every rotated key block), and without padding no mode takes "
                f"any length with both ulysses={ulysses} and ring={ring}. Use --ulysses N alone (padded, static "
                "shapes), or --ring N alone (unpadded, diffusers' ring_anything)."
            )
        any_length = True  # ring alone: no padding, any length
    if text == "none":
        any_length = True
    if any_length and ulysses > 1 and ring > 1:
        raise ValueError(
            f"Any prompt length or image size with ulysses={ulysses} x ring={ring}: diffusers' *_anything modes take "
            "Ulysses or ring alone. Use one of them, or sizes whose sequences divide ulysses x ring (no "
            "--cp-any-length)."
        )
    return RunnerMode(ulysses_anything=any_length and ulysses > 1, ring_anything=any_length and ring > 1,
                      pad=not (ring > 1 and text == "masked"))


def round_buckets(buckets: tuple[int, ...], multiple: int) -> tuple[int, ...]:
    """Text buckets rounded up to multiples of the context-parallel degree (each split into equal parts)."""
    return tuple(sorted({-(-bucket // multiple) * multiple for bucket in buckets}))


def check_split_lengths(display_name: str, lengths: dict[str, int], degree: int, suggestion: str = "") -> None:
    """Every sequence the plain modes split must be a multiple of `degree` = ulysses x ring; else say which and why."""
    bad = {name: length for name, length in lengths.items() if length % degree}
    if bad:
        what = ", ".join(f"{name} = {length}" for name, length in bad.items())
        raise ValueError(
            f"{display_name} under context parallelism splits each sequence into {degree} equal parts (ulysses x "
            f"ring), but {what} is not a multiple of {degree}. {suggestion}Or run any length exactly with "
            "`load_pipeline(..., cp_any_length=True)` (job: --cp-any-length; diffusers' *_anything modes, not for "
            "compiled static shapes)."
        )


def valid_sizes(height: int, width: int, multiple: int, degree: int, count: int = 3) -> list[tuple[int, int]]:
    """Nearby (height, width), multiples of `multiple`, whose image token count (h/m x w/m) divides by `degree`."""
    found = []
    for step in range(0, 64):
        for h, w in ((height, width + step * multiple), (height + step * multiple, width),
                     (height + step * multiple, width + step * multiple)):
            if (h // multiple) * (w // multiple) % degree == 0 and (h, w) not in found:
                found.append((h, w))
        if len(found) >= count:
            break
    return found[:count]


# --- inputs a context-parallel split cannot take ------------------------------------------------------------------


def _forward_parameters(module) -> list[str]:
    return list(inspect.signature(type(module).forward).parameters)[1:]


class SplitCheck:
    """Checks, before diffusers' split hooks run, that every tensor they split divides evenly across the region.

    Stock asserts (`Tensor size along dimension to be sharded must be divisible by mesh size`) without saying which
    input or what to do. Ring attention reuses each rank's mask for every rotated key block, so a split mask with
    masked positions would silently give a wrong image; it is refused (not while compiling: it reads the data).
    """

    def __init__(self, model_name: str, module_id: str, inputs: dict, cp_config, names: dict):
        self.model_name, self.module_id, self.inputs, self.cp = model_name, module_id, inputs, cp_config
        self.names = names  # forward's parameter names per module class, read once: no `inspect` when compiled
        self.region = cp_config.ulysses_degree * cp_config.ring_degree
        self.anything = cp_config.ulysses_anything or cp_config.ring_anything

    def _check(self, label: str, tensor, spec) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != (spec.expected_dims or tensor.dim()):
            return  # diffusers does not split it either
        size = tensor.shape[spec.split_dim]
        where = f"{self.model_name}: {label} of '{self.module_id or 'the model'}'"
        if self.anything and size < self.region:
            raise ValueError(f"{where} has {size} positions along dim {spec.split_dim}, fewer than the "
                             f"{self.region} context-parallel ranks: use fewer ranks for context parallelism.")
        if not self.anything and size % self.region:
            mode = ("ContextParallelConfig(ulysses_anything=True)" if self.cp.ring_degree == 1
                    else "ContextParallelConfig(ring_anything=True) (no attention mask)")
            raise ValueError(
                f"{where} has {size} positions along dim {spec.split_dim}, which ulysses x ring = {self.region} ranks "
                f"cannot split evenly. Pad the sequence to a multiple of {self.region} with masked positions "
                f"(load_pipeline's text buckets do), or use {mode} (load_pipeline: cp_any_length=True)."
            )
        if (self.cp.ring_degree > 1 and "mask" in label and not torch.compiler.is_compiling()
                and not bool(tensor.bool().all())):
            raise ValueError(
                f"{where} masks out some positions, but ring attention applies each rank's mask to every rotated key "
                "block, which would attend to the wrong keys. Use Ulysses (ulysses_degree) for masked (padded) "
                "sequences, or pass no padding."
            )

    def inputs_hook(self, module, args, kwargs):
        names = self.names[type(module)]
        for name, spec in self.inputs.items():
            if isinstance(name, int) or getattr(spec, "split_output", False):
                continue
            index = names.index(name) if name in names else len(args)
            value = kwargs.get(name, args[index] if index < len(args) else None)
            if isinstance(spec, (list, tuple)):  # a tuple input (rotary cos, sin): one spec per part, as diffusers
                for part, (tensor, part_spec) in enumerate(zip(value or (), spec, strict=False)):
                    if not part_spec.split_output:
                        self._check(f"input '{name}'[{part}]", tensor, part_spec)
            else:
                self._check(f"input '{name}'", value, spec)

    def check_outputs(self, output) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for index, spec in self.inputs.items():
            if isinstance(index, int) and spec.split_output and index < len(outputs):
                self._check(f"output {index}", outputs[index], spec)


def plan_modules(model: torch.nn.Module, module_id: str) -> list[torch.nn.Module]:
    """The modules a CP plan key names: '' (the model), a dotted path, or one '*' over a ModuleList."""
    if not module_id:
        return [model]
    prefix, star, suffix = module_id.partition("*")
    if not star:
        return [model.get_submodule(module_id)]
    blocks = model.get_submodule(prefix.strip("."))
    suffix = suffix.strip(".")
    return [block.get_submodule(suffix) if suffix else block for block in blocks]


SPLIT_CHECK_HOOK = "neuron_diffusers.cp_split_check---{}"


def install_split_checks(model: torch.nn.Module, plan: dict, cp_config) -> None:
    """Put a `SplitCheck` on every module whose inputs or outputs the plan splits. Call before diffusers'
    `apply_context_parallel`: input checks are torch pre-hooks (they run before the forward that diffusers' hook
    registry wraps, so before any split), output checks a diffusers hook registered first, so it sees the output
    before the CP hook splits it."""
    class _OutputCheck(ModelHook):
        def __init__(self, check):
            super().__init__()
            self.check = check

        def post_forward(self, module, output):
            self.check.check_outputs(output)
            return output

    for module_id, entry in plan.items():
        if not isinstance(entry, dict):
            continue
        modules = plan_modules(model, module_id)
        check = SplitCheck(type(model).__name__, module_id, entry, cp_config,
                           {type(m): _forward_parameters(m) for m in modules})
        for module in modules:
            module.register_forward_pre_hook(check.inputs_hook, with_kwargs=True)
            if any(isinstance(key, int) for key in entry):
                HookRegistry.check_if_exists_or_initialize(module).register_hook(
                    _OutputCheck(check), SPLIT_CHECK_HOOK.format(module_id))
