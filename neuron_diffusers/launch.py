"""One launch spec for the job (`generate`) and the server (`serve`): the options they share, and one planning step.

`add_launch_arguments` is the one argument group both commands offer (mesh, plan, cache, VAE, LoRA, compile, dtype),
so the two cannot drift. `plan_launch` checks all of it once, before any process group starts or any weight is read,
and returns a frozen `LaunchSpec`: the job and the server hand that to `load_pipeline`, which then checks nothing
again. `load_pipeline` called directly with keyword arguments builds the same spec itself (`spec_for`).

Each LoRA file is read once here (`parallel/lora.py`) and the read LoRAs travel in the spec to the fusing.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from . import tiny
from .batching import batch_refusal, declared_sizes
from .checkpoint import Checkpoint, resolve
from .cli import positive_int
from .compat.tp_loading import shard_specs
from .compile import compiled_block_classes, resolve_backend
from .distributed import AUTO_ORDER, MESH_ORDERS, check_cp_degrees, check_tp_degree, mesh_layout
from .parallel import context
from .parallel.cache import check_cache, parse_cache_spec
from .parallel.lora import LoadedLora, LoraSpec, check_loras, lora_loader, read_lora
from .parallel.plan_variants import VARIANTS, is_plan_file, resolved_plan
from .parallel.quantize import Quantization, check_launch_quantize
from .topology import check_node_local, detect_nodes

DTYPES = ("float32", "bfloat16", "float16")


def add_launch_arguments(parser: argparse.ArgumentParser, *, lora_type=None,
                         lora_metavar: str = "PATH[:SCALE]", lora_help: str | None = None):
    """The options `generate` and `serve` share, as one argument group (the LoRA option's syntax alone differs: the
    server names each LoRA so requests can choose it)."""
    group = parser.add_argument_group("launch (shared by generate and serve)")
    group.add_argument("--tp", type=positive_int, default=None,
                       help="tensor-parallel degree (default: all ranks; with --cfg-parallel half of them); the other "
                            "ranks form more replicas")
    group.add_argument("--plan", type=plan_choice, default="default", metavar="{default,lean,stock,FILE.py}",
                       help="tensor-parallel plan: default (no more collectives per forward than stock, then the "
                            "least memory), lean (less memory per rank for more collectives: Qwen-Image-2.1), "
                            "stock (diffusers' own), or a plan file (`plan draft MODEL --out FILE.py`, reviewed), "
                            "checked against the model before any weight is read")
    group.add_argument("--cfg-parallel", action="store_true",
                       help="true CFG (negative prompt, scale > 1): compute cond and uncond on two TP groups at once; "
                            "needs a multiple of 2 x tp ranks. Requests without true CFG use the pairs as data "
                            "parallelism")
    group.add_argument("--ulysses", type=positive_int, default=1,
                       help="context parallelism: split each image's sequence over N ranks with Ulysses all-to-all "
                            "(tp x ulysses must divide the attention heads)")
    group.add_argument("--ring", type=positive_int, default=1,
                       help="context parallelism: split each image's sequence over N ranks with ring attention")
    group.add_argument("--cp-any-length", action="store_true",
                       help="with --ulysses or --ring: any image size and prompt length, exactly, in diffusers' "
                            "*_anything modes (not with --compile); default: sizes whose tokens split, others refused "
                            "with nearby ones")
    group.add_argument("--mesh-order", choices=sorted([*MESH_ORDERS, AUTO_ORDER]), default=AUTO_ORDER,
                       help="which ranks are neighbours under context parallelism: ulysses-inner (contiguous "
                            "all-to-all groups, as Neuron needs), tp-inner (TP all-reduces between neighbours), "
                            "ring-outer (ring across nodes); auto (default): ulysses-inner, or ring-outer where "
                            "that keeps every TP and Ulysses group on one node")
    group.add_argument("--cross-node", action="store_true",
                       help="allow a TP or Ulysses group to span torchrun nodes (refused by default: their "
                            "collectives run in every block and would cross the network)")
    group.add_argument("--parallel-vae", action=argparse.BooleanOptionalAction, default=None,
                       help="every rank of a TP group decodes (and encodes) one piece of each image, so none idles "
                            "and the decode's memory is split; --no-parallel-vae: the TP leader decodes alone "
                            "(default: MiniMax-H3 always, the others from 1024 x 1024 pixels, with tp > 1)")
    group.add_argument("--dtype", choices=DTYPES, default=None,
                       help="default: bfloat16 on an accelerator, float32 on CPU")
    group.add_argument("--lora", type=lora_type, action="append", default=[], metavar=lora_metavar,
                       help=lora_help or "a LoRA (.safetensors file, a folder holding one, or a Hub id) fused into "
                                         "every rank's shard at SCALE (default 1); repeat for several")
    group.add_argument("--compile", nargs="?", const="auto", default=None, metavar="BACKEND",
                       help="compile the transformer's repeated blocks (default backend: neuron if present, else "
                            "inductor)")
    group.add_argument("--warmup", action="store_true",
                       help="with --compile: compile the requested sizes and every text-length bucket before the "
                            "first request (serve always warms up every --sizes entry)")
    group.add_argument("--quantize", default=None, metavar="KIND[:BLOCK]",
                       help="fp8 (weights and dynamic activations) or int8 (weight-only) for the transformer blocks' "
                            "Linears, each rank quantizing its own shard with the scales one process would use, per "
                            "BLOCK input columns (default 128; docs/quantization.md)")
    group.add_argument("--batch-size", "--max-batch", type=positive_int, default=1, metavar="N",
                       help="the most images one stock pipeline call makes: compatible requests (same size, steps, "
                            "guidance, negative prompt or none, LoRAs; no image inputs) share a call, each image equal "
                            "to the one made alone; with --compile the batch shapes 1, 2, 4, ..., N are declared "
                            "(default 1)")
    group.add_argument("--cache", default=None, metavar="SPEC",
                       help="step cache with decisions shared by each TP group: first-block:THRESHOLD, "
                            "taylorseer:KEY=VALUE,... or mag:KEY=VALUE,... (diffusers' FirstBlockCacheConfig, "
                            "TaylorSeerCacheConfig, MagCacheConfig fields)")
    return group


def plan_choice(text: str) -> str:
    """`--plan`'s value: a plan's name or a plan file (read and checked in `plan_launch`)."""
    if text in VARIANTS or is_plan_file(text):
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: '{text}' (choose from {', '.join(VARIANTS)}, or a plan file "
                                     "FILE.py)")


#: The destinations of the shared options (what a test compares between the two commands' parsers).
def launch_options() -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_launch_arguments(parser)
    return {option for action in parser._actions for option in action.option_strings}


@dataclass(frozen=True)
class LaunchSpec:
    """Everything that decides how a model is loaded over the mesh, checked: what `load_pipeline` builds from.

    The keyword arguments of `load_pipeline` are its front (same names: `plan`, `cache`, `loras`, `cp_any_length`,
    `parallel_vae`, `pipeline_class`, `buckets`); the rest is what planning found (the checkpoint, the plan's
    table, the context-parallel mode, the read LoRAs).
    """

    checkpoint: Checkpoint
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    #: 2: replicas are CFG pairs of image groups; else 1.
    cfg: int = 1
    mesh_order: str = AUTO_ORDER
    #: Whether a TP or Ulysses group may span nodes (`topology.check_node_local`).
    cross_node: bool = False
    cp_any_length: bool = False
    #: The tensor-parallel plan's name and its table (`parallel/plan_variants.py`).
    plan: str = "default"
    tp_plan: object = None
    #: The diffusers step-cache config (None: no cache) and the `--cache` text it came from.
    cache: object = None
    cache_text: str | None = None
    parallel_vae: bool | None = None
    #: The LoRAs, each read and checked once (`parallel.lora.LoadedLora`), fused at load.
    loras: tuple[LoadedLora, ...] = ()
    compile: str | None = None
    warmup: bool = False
    dtype: str | None = None
    #: Text-length buckets overriding the family's (None: the family's; `()`: no padding).
    buckets: tuple[int, ...] | None = None
    #: Quantized transformer weights (`parallel.quantize.Quantization`), or None.
    quantize: Quantization | None = None
    #: The batch shapes a compiled pipeline declares (`load_pipeline(batch_sizes=...)`; None: any batch size).
    batch_sizes: tuple[int, ...] | None = None

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else getattr(torch, self.dtype)

    @property
    def group(self) -> int:
        """Ranks that make one image together."""
        return self.tp * self.ulysses * self.ring

    def lora_records(self) -> list[dict]:
        """`{"source", "scale", "sha256"}` per LoRA: what outputs record (the sha256 from the one read)."""
        return [lora.spec.record() for lora in self.loras]


def check_guidance(adapter, given: dict, where: str = "") -> tuple:
    """The guidance-distilled rule, in one place: a family without true CFG takes no negative prompt and no
    true-CFG scale, one without a guidance kwarg no guidance. Where guidance *is* the true-CFG scale (Qwen-Image),
    the true-CFG option is stock's own name for it (`QwenImagePipeline(true_cfg_scale=...)`): an alias, folded into
    guidance, and refused only when both are given with different values. `given` maps each option's name as the
    user wrote it (`--guidance`, `'guidance'`, `guidance_scale`) to its value, in the order negative prompt,
    guidance, true CFG. Returns the (guidance, true CFG) values to use."""
    (negative, neg_value), (guidance, guidance_value), (true_cfg, true_value) = given.items()
    distilled = f"{where}{adapter.pipeline_class} is guidance-distilled"
    if neg_value is not None and not adapter.takes_negative_prompt:
        raise ValueError(f"{distilled} and takes no negative prompt: drop {negative}.")
    if guidance_value is not None and adapter.guidance_kwarg is None:
        raise ValueError(f"{distilled}: drop {guidance}.")
    if true_value is not None and not adapter.takes_negative_prompt:
        raise ValueError(f"{distilled} and has no true CFG: drop {true_cfg}.")
    if true_value is None or adapter.guidance_kwarg != "true_cfg_scale":
        return guidance_value, true_value
    if guidance_value is not None and guidance_value != true_value:
        raise ValueError(f"{where}For {adapter.pipeline_class}, {guidance} and {true_cfg} both set true_cfg_scale "
                         f"and differ ({_shown(guidance_value)} vs {_shown(true_value)}): give one of them.")
    return true_value, None


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def mesh_degrees(args, world_size: int) -> tuple[int, int]:
    """(tp, cfg pairs) from the options, checked against the world: tp defaults to every rank one image group has."""
    pairs = 2 if args.cfg_parallel else 1
    tp = args.tp or max(world_size // (pairs * args.ulysses * args.ring), 1)
    check_tp_degree(tp, world_size)
    check_cp_degrees(world_size, tp=tp, ulysses=args.ulysses, ring=args.ring)
    # Before any weight is read: the node layout comes from torchrun's environment alone.
    nodes = detect_nodes(world_size)
    names, sizes = mesh_layout(world_size, tp=tp, ulysses=args.ulysses, ring=args.ring, cfg=pairs,
                               order=args.mesh_order, nodes=nodes)
    check_node_local(sizes, names, nodes, cross_node=args.cross_node)
    return tp, pairs


def default_size(model) -> tuple[int, int]:
    """(height, width) when a request gives none: a tiny model's own small size, else 1024 x 1024."""
    return tiny.default_size(model) if isinstance(model, str) and model in tiny.NAMES else (1024, 1024)


def default_dtype(dtype: str | None, device_type: str) -> str:
    return dtype or ("float32" if device_type == "cpu" else "bfloat16")


def runner_mode(checkpoint: Checkpoint, buckets: tuple[int, ...], ulysses: int, ring: int, any_length: bool, *,
                compiled: bool = False) -> context.RunnerMode | None:
    """How context parallelism runs this family (None without it), refusing `--compile` where that would be one of
    diffusers' `*_anything` modes: any length means no static shapes, so every new length would recompile."""
    if ulysses * ring == 1:
        return None
    checkpoint.family.check_context_parallel()
    name, adapter = checkpoint.family.display_name, checkpoint.adapter
    # Qwen-Image-2.1's text is padded by its buckets alone: without them, any length (`ulysses_anything`).
    text = "none" if adapter.cp_block_causal and not buckets else adapter.cp_text
    mode = context.runner_mode(name, text, ulysses, ring, any_length, block_causal=adapter.cp_block_causal)
    if mode.any_length and compiled:
        raise ValueError(
            f"--compile with context parallelism needs static shapes, but {name} would run diffusers' "
            f"{'ulysses' if mode.ulysses_anything else 'ring'}_anything mode here (any length, a host sync per "
            "attention call). Drop --compile, or --cp-any-length / the ring + padding combination."
        )
    return mode


def read_loras(checkpoint: Checkpoint, loras) -> tuple[LoadedLora, ...]:
    """Each LoRA read once and checked against the transformer's config, before any weight is read."""
    specs = check_loras(checkpoint, loras)
    if not specs:
        return ()
    loader = lora_loader(checkpoint.adapter)
    return tuple(read_lora(spec, loader, checkpoint.transformer_class(), checkpoint.config("transformer"))
                 for spec in specs)


def checked_plan(checkpoint: Checkpoint, plan: str, tp: int) -> tuple[dict, str]:
    """The plan's table and its label for outputs (`resolved_plan`); a plan file is also laid out on the meta-device
    transformer at degree `tp` (every rule must name Linears, split evenly and be coalesced as written), as the
    loader would, before any weight is read. The named plans are the package's own, proven by its tests."""
    tp_plan, label = resolved_plan(checkpoint.family, plan)
    if is_plan_file(plan):
        try:
            shard_specs(checkpoint.meta("transformer"), tp_plan, tp)
        except ValueError as error:
            raise ValueError(f"Plan file {plan} does not fit {checkpoint.path}'s transformer at tp={tp}: {error} "
                             f"(`neuron-diffusers plan check {plan} --model {checkpoint.path}` lists every "
                             "problem).") from None
    return tp_plan, label


def check_experts(checkpoint: Checkpoint, *, cache=None, loras=(), compile: str | None = None) -> None:
    """A checkpoint with a second expert (Wan 2.2 A14B's `transformer_2`) is sharded, quantized and run under CFG and
    context parallelism like its transformer; what is written for one transformer alone is refused, before any
    weight is read."""
    if not checkpoint.experts:
        return
    wanted = [name for name, given in (("a step cache (--cache)", cache), ("LoRAs (--lora)", loras),
                                       ("--compile", compile)) if given]
    if wanted:
        raise ValueError(f"{checkpoint.path} has a second expert ({', '.join(checkpoint.experts)}), and "
                         f"{' and '.join(wanted)} would apply to its first transformer only (not supported yet): "
                         "run it without them.")


def plan_launch(args, world_size: int, device_type: str, *, steps: int | None = None,
                loras: list[LoraSpec] = ()) -> LaunchSpec:
    """Check every shared option once, reading no weight and starting no process group: a frozen `LaunchSpec`.

    `args` holds the `add_launch_arguments` options plus `model` and `pipeline`; `steps` lays out a MagCache schedule;
    `loras` are the specs to read (the job's `--lora`; the server passes its named ones). The cfg pairs are the
    ones asked for: a caller that falls back to data parallelism replaces `cfg` and calls `check_mesh` again."""
    if args.warmup and not args.compile:
        raise ValueError("--warmup compiles shapes up front, so it needs --compile [BACKEND].")
    if args.compile:
        resolve_backend(args.compile)
    cache = parse_cache_spec(args.cache, steps=steps) if args.cache else None
    tp, pairs = mesh_degrees(args, world_size)
    checkpoint = resolve(args.model, args.pipeline)
    check_experts(checkpoint, cache=cache, loras=loras, compile=args.compile)
    checkpoint.check_safetensors()
    checkpoint.check_heads(tp)
    tp_plan, plan_text = checked_plan(checkpoint, args.plan, tp)
    if cache is not None:
        # Tried on the meta-device transformer (no weights), with the blocks `--compile` would compile.
        meta = checkpoint.meta("transformer")
        check_cache(cache, meta, compiled_block_classes(meta, checkpoint.adapter) if args.compile else None)
    runner_mode(checkpoint, checkpoint.adapter.buckets, args.ulysses, args.ring, args.cp_any_length,
                compiled=bool(args.compile))
    quantize = check_launch_quantize(checkpoint, tp_plan, tp, getattr(args, "quantize", None))
    batch_sizes = launch_batch_sizes(checkpoint.adapter, getattr(args, "batch_size", 1), args.ulysses * args.ring > 1,
                                     bool(args.compile))
    return LaunchSpec(checkpoint, tp=tp, ulysses=args.ulysses, ring=args.ring, cfg=pairs,
                      mesh_order=args.mesh_order, cross_node=args.cross_node, cp_any_length=args.cp_any_length,
                      plan=plan_text, tp_plan=tp_plan,
                      cache=cache, cache_text=args.cache, parallel_vae=args.parallel_vae,
                      compile=args.compile, warmup=args.warmup, dtype=default_dtype(args.dtype, device_type),
                      loras=read_loras(checkpoint, loras), quantize=quantize, batch_sizes=batch_sizes)


def launch_batch_sizes(adapter, batch_size: int, context_parallel: bool, compiled: bool):
    """`--batch-size` / `--max-batch` N checked before any weight is read (`batching.batch_refusal`: the rule
    `generate` refuses by); compiled, the batch shapes it declares (1, 2, 4, ..., N), else None."""
    if batch_size == 1:
        return None
    why = batch_refusal(adapter, context_parallel)
    if why:
        raise ValueError(f"--batch-size {batch_size}: {why}. Leave --batch-size (--max-batch) out (1).")
    return declared_sizes(batch_size) if compiled else None


def spec_for(model, *, torch_dtype=None, pipeline_class=None, buckets=None, loras=(), cache=None,
             cp_any_length: bool = False, parallel_vae: bool | None = None, plan: str = "default",
             quantize=None) -> LaunchSpec:
    """`load_pipeline`'s keyword arguments as a checked spec (the mesh's degrees are filled in at load; the
    quantization's blocks are checked against them there)."""
    checkpoint = resolve(model, pipeline_class)
    check_experts(checkpoint, cache=cache, loras=loras)
    tp_plan, plan_text = checked_plan(checkpoint, plan, 1)
    quantize = check_launch_quantize(checkpoint, tp_plan, 1, quantize)
    if cache is not None:
        check_cache(cache, checkpoint.meta("transformer"))
    dtype = None if torch_dtype is None else str(torch_dtype).removeprefix("torch.")
    return LaunchSpec(checkpoint, cp_any_length=cp_any_length, plan=plan_text, tp_plan=tp_plan, cache=cache,
                      parallel_vae=parallel_vae, loras=read_loras(checkpoint, loras), dtype=dtype,
                      buckets=None if buckets is None else tuple(buckets), quantize=quantize)


def with_cfg(spec: LaunchSpec, cfg: int) -> LaunchSpec:
    return dataclasses.replace(spec, cfg=cfg)
