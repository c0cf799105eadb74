"""The generation job: many prompts over a ("dp", "tp") mesh, resumable, each output traceable to its settings.

Every check of the user's input happens in `plan_job`, before the process group starts or any weight is read.
`run_job` then splits the requests over the data-parallel replicas (every core busy), skips outputs already made
with the same settings (a rerun after a crash resumes; `outputs.py` says what "the same" means, and guards the
folder against a second job), writes each output atomically with its settings in the PNG's text chunks, and has
rank 0 write `summary.json` (per-image seconds, per-phase timings, the compile report, the mesh). A failure on any
rank (a full disk while saving, say) ends the job on every rank with the same error; finished outputs stay.

With `--cfg-parallel` a replica is a CFG pair of TP groups (a ("dp", "cfg", "tp") mesh): a request with true CFG
runs on both groups, one guidance branch each; the requests without it alternate between the two groups, so no
group idles. A job none of whose requests uses true CFG (no negative prompt, a scale of at most 1, or a
guidance-distilled family) needs no pairs: it runs on the ("dp", "tp") mesh, the cfg ranks as data parallelism.

`--pipeline CLASS` runs the checkpoint with another stock class on its transformer (Kontext, img2img, inpainting,
Qwen-Image-Edit-Plus), and `--image`, `--mask`, `--strength` (or a .jsonl line's `image`, `mask`, `strength`, paths
relative to the prompt file) give its inputs. Each input file is read and checked up front; its path and sha256 go
into the request (so into the output's settings) and the output's metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import MagCacheConfig
from PIL import Image
from tqdm.auto import tqdm

from . import __version__
from .batching import pack
from .checkpoint import Checkpoint
from .cli import finite_float, positive_float, positive_int
from .compile import compile_repeated_blocks, compile_report, warmup
from .consistency import agree, raise_agreed, shareable
from .distributed import (
    AUTO_ORDER,
    broadcast_object_from_replica_leader,
    cfg_rank,
    check_cfg_degree,
    check_cp_degrees,
    default_store,
    detect_runtime,
    group_restarts,
    image_group,
    init_distributed,
    is_group_leader,
    is_main_process,
    is_replica_leader,
    leave_together,
)
from .launch import (
    DTYPES as DTYPES,  # re-exported: `job.DTYPES` was its home
)
from .launch import (
    LaunchSpec,
    add_launch_arguments,
    check_guidance,
    default_size,
    plan_launch,
    runner_mode,
)
from .media import InputImage, remove_stale_temps, save_json
from .outputs import (
    JobLock,
    check_unlocked,
    digest,
    key_text,
    merge_records,
    model_identity,
    read_summary_images,
    scan_outputs,
    settings_key,
)
from .parallel import context
from .parallel.lora import parse_lora_option
from .parallel.vae import resolve_parallel_vae
from .pipelines.base import MAX_SEED, SizeLimits, check_seeds, check_text
from .pipelines.image_inputs import call_image_kwargs, check_image_kwargs, takes_image_per_prompt
from .runner import check_context_parallel_call, load_pipeline
from .stopping import ExitWhenStuck
from .topology import detect_nodes

JSONL_KEYS = {"prompt", "negative_prompt", "seed", "height", "width", "steps", "guidance", "true_cfg_scale", "image",
              "mask", "strength"}
#: The default `--max-pixels`: 2048 x 2048, the most any family here is made for (FLUX.2: 4 megapixels).
DEFAULT_MAX_PIXELS = 2048 * 2048
#: What `--out` must not look like: it names a folder, and a file name there is almost always a mistake.
_FILE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".mp4", ".wav", ".json", ".txt", ".jsonl"}
#: A store key whose value says which rank failed first: other replicas stop at their next output instead of
#: finishing their whole share before the job ends.
_FAILED_KEY = "neuron_diffusers/job/failed"


class OutputWriteError(RuntimeError):
    """An output could not be written (a full disk, a folder that became read-only): the job stops on every rank."""


@dataclass(frozen=True)
class Request:
    """One output to make: the prompt and every setting that shapes it (every field but `index` is in the output's
    settings key, see `outputs.settings_key`: a field added later needs a default, or `metadata={"key": False}`)."""

    index: int = field(metadata={"key": False})
    prompt: str
    negative_prompt: str | None
    seed: int
    height: int
    width: int
    steps: int
    guidance: float | None
    #: FLUX.1's true-CFG scale (its `guidance` is the distilled `guidance_scale`); Qwen-Image's is `guidance`.
    true_cfg_scale: float | None = None
    #: Input images (several: reference images), an inpainting mask, img2img / inpainting strength; each file with
    #: the sha256 of its bytes, so a request's settings (and resume key) change with the images it reads.
    #: The key holds the files' sha256 only: a moved or renamed input still resumes.
    images: tuple[InputImage, ...] = field(default=(), metadata={"key": lambda images: [i.sha256 for i in images]})
    mask: InputImage | None = field(default=None, metadata={"key": lambda mask: mask.sha256})
    strength: float | None = None

    def image_kwargs(self) -> dict:
        """The `generate` kwargs of its image inputs, decoded (one image, or a list of references)."""
        images = [image.load() for image in self.images]
        kwargs = {"image": images[0] if len(images) == 1 else images} if images else {}
        if self.mask is not None:
            kwargs["mask_image"] = self.mask.load()
        return kwargs | ({} if self.strength is None else {"strength": self.strength})

    def file_name(self, suffix: str) -> str:
        """`00007-a-red-fox-in-the-snow.png`: sortable, and readable without opening the file."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.prompt.lower()).strip("-")[:48].rstrip("-") or "prompt"
        return f"{self.index:05d}-{slug}{suffix}"


@dataclass
class JobPlan:
    """Everything `run_job` needs, all of it checked."""

    checkpoint: Checkpoint
    requests: list[Request]
    out_dir: Path
    tp: int
    world_size: int
    dtype: str
    settings: dict = field(default_factory=dict)
    #: 2: replicas are CFG pairs of TP groups (`--cfg-parallel` and some request uses true CFG); else 1.
    cfg: int = 1
    #: Indexes of the requests that use true CFG (two transformer calls per step).
    true_cfg: frozenset = frozenset()
    #: What rank 0 tells the user before the run (e.g. why `--cfg-parallel` fell back to data parallelism).
    notes: list = field(default_factory=list)
    #: `--lora`, one set for the whole job: `{"source", "scale", "sha256"}` each (`LoraSpec.record`), recorded with
    #: every output; the file's sha256 and the scale are what identify a LoRA's effect.
    loras: list = field(default_factory=list)
    #: `--cache`: the diffusers step-cache config every rank installs (None: no cache).
    cache: object = None
    #: Each request's settings key (index -> `outputs.settings_key`), stored inside its output.
    keys: dict = field(default_factory=dict)
    #: Indexes of the requests whose outputs exist, complete and made with the same settings.
    done: frozenset = frozenset()
    #: The digest of every request's key: what the output folder's lock records.
    job_digest: str = ""
    #: Context parallelism: ranks splitting each image's sequence, any-length mode, and the mesh order.
    ulysses: int = 1
    ring: int = 1
    cp_any_length: bool = False
    #: `--plan`: the tensor-parallel plan's name (`parallel/plan_variants.py`), recorded with every output.
    tp_plan: str = "default"
    mesh_order: str = AUTO_ORDER
    #: `--cross-node`: TP or Ulysses groups may span nodes.
    cross_node: bool = False

    @property
    def group(self) -> int:
        """Ranks that make one image together."""
        return self.tp * self.ulysses * self.ring

    @property
    def dp(self) -> int:
        return self.world_size // (self.group * self.cfg)
    #: `--parallel-vae` (True), `--no-parallel-vae` or no request the default would split (False), else None (the
    #: default per VAE class and image size, `load_pipeline`'s).
    parallel_vae: bool | None = None
    #: The checked launch spec `load_pipeline` is handed (None: a plan built by hand; it is made from the fields).
    launch: LaunchSpec | None = None
    #: `--batch-size`: compatible requests made per stock call (`batch_key`), each image equal to the one made alone.
    batch_size: int = 1


def read_prompt_file(path: Path) -> list[dict]:
    """`.txt`: one prompt a line (blank lines skipped). `.jsonl`: one object a line with `prompt` and optional
    `negative_prompt`, `seed`, `height`, `width`, `steps`, `guidance`, `true_cfg_scale`, `image` (a path or a list),
    `mask`, `strength` (paths relative to the file). Errors name the file and line."""
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"--prompts {path}: use a .txt file (one prompt a line) or a .jsonl file (one JSON object "
                         "a line, with a 'prompt' key).")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--prompts {path} cannot be read: {error}. Check the path and that it is UTF-8 "
                         "text.") from None
    entries = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        if path.suffix == ".txt":
            entries.append({"prompt": line.strip(), "_where": where})
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON ({error.msg}): each line must be one JSON object such as "
                             '{"prompt": "a red fox", "seed": 3}.') from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
            raise ValueError(f"{where} has no string 'prompt': each line must be an object with a 'prompt'.")
        unknown = set(entry) - JSONL_KEYS
        if unknown & {"lora", "loras"}:
            raise ValueError(f"{where}: LoRAs cannot change per line: a switch rewrites every LoRA-touched weight "
                             "shard. Pass them for the whole job with --lora PATH[:SCALE], and run one job per LoRA "
                             "set.")
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(JSONL_KEYS)}.")
        if not isinstance(entry.get("negative_prompt", ""), (str, type(None))):
            raise ValueError(f"{where}: 'negative_prompt' must be a string (or null), got "
                             f"{entry['negative_prompt']!r:.60}.")
        entries.append({**entry, **_input_paths(entry, path.parent, where), "_where": where})
    if not entries:
        raise ValueError(f"--prompts {path} holds no prompt: add one per line.")
    return entries


def _input_paths(entry: dict, base: Path, where: str) -> dict:
    """A line's `image` (a path or a list of paths) and `mask` as paths relative to the prompt file's folder."""
    paths = {}
    for key in ("image", "mask"):
        value = entry.get(key)
        if value is None:
            continue
        items = value if key == "image" and isinstance(value, list) else [value]
        if not items or not all(isinstance(item, str) and item for item in items):
            what = "a path or a list of paths" if key == "image" else "a path"
            raise ValueError(f"{where}: '{key}' must be {what} (relative to the prompt file), got {value!r}.")
        paths[key] = [base / item for item in items]
    return paths


def _int(entry: dict, key: str, default, minimum: int = 0, maximum: int | None = None):
    value = entry.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum
                              or (maximum is not None and value > maximum)):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{entry['_where']}: '{key}' must be an integer {bound}, got {value!r}.")
    return value


def _number(entry: dict, key: str, default):
    value = entry.get(key, default)
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
                              or abs(value) == float("inf")):
        raise ValueError(f"{entry['_where']}: '{key}' must be a finite number, got {value!r} (NaN or infinity "
                         "turn every pixel into NaN, a black image).")
    return value


def _given(entry: dict, key: str):
    """The line's value of `key`: None when absent, True when there but null (given all the same)."""
    return (True if entry[key] is None else entry[key]) if key in entry else None


def _check_family_keys(entry: dict, adapter) -> dict:
    """Per-line settings the family cannot take, refused with the line (the flags get the same checks in
    `plan_job`); the line with Qwen-Image's `true_cfg_scale` folded into its `guidance` (`check_guidance`)."""
    guidance, true_cfg = check_guidance(adapter, {"'negative_prompt'": entry.get("negative_prompt"),
                                                  "'guidance'": _given(entry, "guidance"),
                                                  "'true_cfg_scale'": _given(entry, "true_cfg_scale")},
                                        where=f"{entry['_where']}: ")
    if "true_cfg_scale" in entry and true_cfg is None:
        entry = {**{key: value for key, value in entry.items() if key != "true_cfg_scale"}, "guidance": guidance}
    return entry


def build_requests(entries: list[dict], *, seed: int, height: int, width: int, steps: int,
                   guidance: float | None, negative_prompt: str | None, limits: SizeLimits, adapter,
                   true_cfg_scale: float | None = None, max_pixels: int | None = None, images: list[Path] = (),
                   mask: Path | None = None, strength: float | None = None) -> list[Request]:
    """Requests with the command line's settings as defaults; image `i` without its own seed uses `seed + i`.

    Every line is checked here, and every error names the line: its text (no lone surrogate, no NUL), the types
    and ranges of its fields, what the family takes, and its size (`limits`, and `max_pixels`). Each input file is
    read once, however many requests name it."""
    check_seeds(seed, len(entries), "--seed")
    requests = []
    read = {}

    def inputs(paths) -> tuple[InputImage, ...]:
        for path in paths:
            if str(path) not in read:
                read[str(path)] = InputImage.read(path)
        return tuple(read[str(path)] for path in paths)

    for index, entry in enumerate(entries):
        if not entry["prompt"].strip():
            raise ValueError(f"{entry['_where']}: the prompt is empty. Give the text to generate from.")
        check_text(entry["prompt"], f"{entry['_where']}: the prompt")
        if entry.get("negative_prompt") is not None:
            check_text(entry["negative_prompt"], f"{entry['_where']}: the negative prompt")
        entry = _check_family_keys(entry, adapter)
        request = Request(
            index=index,
            prompt=entry["prompt"],
            negative_prompt=entry.get("negative_prompt", negative_prompt),
            seed=_int(entry, "seed", seed + index, maximum=MAX_SEED),
            height=_int(entry, "height", height, 1),
            width=_int(entry, "width", width, 1),
            steps=_int(entry, "steps", steps, 1),
            guidance=_number(entry, "guidance", guidance),
            true_cfg_scale=_number(entry, "true_cfg_scale", true_cfg_scale),
            images=inputs(entry.get("image", images)),
            mask=next(iter(inputs(entry.get("mask", [] if mask is None else [mask]))), None),
            strength=_number(entry, "strength", strength),
        )
        own_size = "height" in entry or "width" in entry
        limits.check(request.height, request.width, entry["_where"] if own_size else "--height/--width", max_pixels)
        limits.check_steps(request.steps, entry["_where"] if "steps" in entry else "--steps")
        requests.append(request)
    return requests


def out_folder(value: str) -> Path:
    """An argparse type for `--out`: refuses the empty string, which `Path` would silently turn into "."."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty: name the folder to write into, e.g. --out images")
    return Path(value)


def check_out_dir(out_dir: Path) -> None:
    """The output folder must be a folder (or creatable as one) that can really be written; checked before anything
    starts, by writing and removing a probe: `os.access` says yes to root everywhere, and knows nothing of read-only
    mounts, /proc or a full disk."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file: --out names a folder to write one file per prompt into.")
    if not out_dir.exists() and out_dir.suffix.lower() in _FILE_SUFFIXES:
        raise ValueError(f"--out {out_dir} looks like a file name, but --out names a folder (one file per prompt, "
                         f"named from its index and prompt, plus summary.json): use --out {out_dir.with_suffix('')}.")
    existing = out_dir if out_dir.exists() else next(p for p in out_dir.parents if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {out_dir}: {existing} is not writable. Choose another output folder.")
    try:
        probe = Path(tempfile.mkdtemp(prefix=".neuron-diffusers-probe-", dir=existing))
        try:
            (probe / "probe").write_bytes(b"0")
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as error:
        raise PermissionError(f"--out {out_dir}: cannot write into {existing} ({error.strerror or error}). Choose "
                              "another output folder.") from None


def settings_text(request: Request, *, model: str, pipeline: str, tp: int, dp: int, cfg: int, dtype: str,
                  loras: list, key: dict, cache: str | None = None, ulysses: int = 1,
                  ring: int = 1, plan: str = "default") -> dict[str, str]:
    """The PNG text chunks (MP4 metadata for video): enough to regenerate the output, and its settings key (what
    resume compares). The server (`serve/`) writes the same chunks, so its images and the job's say the same."""
    values = {
        "prompt": request.prompt,
        "negative_prompt": request.negative_prompt or "",
        "seed": request.seed,
        "steps": request.steps,
        "size": f"{request.width}x{request.height}",
        "guidance": "" if request.guidance is None else request.guidance,
        "true_cfg_scale": "" if request.true_cfg_scale is None else request.true_cfg_scale,
        "model": model,
        "pipeline": pipeline,
        "tp": tp,
        "plan": plan,
        "ulysses": ulysses,
        "ring": ring,
        "dp": dp,
        "cfg": cfg,
        "cache": cache or "",
        "dtype": dtype,
        "loras": json.dumps(loras) if loras else "",
        "neuron_diffusers": __version__,
    }
    if request.images:
        values["images"] = json.dumps([image.record() for image in request.images])
    if request.mask is not None:
        values["mask"] = json.dumps(request.mask.record())
    if request.strength is not None:
        values["strength"] = request.strength
    return {**{name: str(value) for name, value in values.items()}, **key_text(key)}


def plan_job(args, world_size: int, device_type: str) -> JobPlan:
    """Resolve and check everything a run needs, reading no weight and starting no process group: the shared
    launch options once (`launch.plan_launch`), then the requests against them."""
    if (args.prompt is None) == (args.prompts is None):
        raise ValueError("Give exactly one of --prompt TEXT or --prompts FILE (.txt or .jsonl).")
    entries = ([{"prompt": args.prompt, "_where": "--prompt"}] if args.prompts is None
               else read_prompt_file(args.prompts))
    check_out_dir(args.out)
    launch = plan_launch(args, world_size, device_type, steps=args.steps,
                         loras=[parse_lora_option(text) for text in args.lora])
    checkpoint, adapter = launch.checkpoint, launch.checkpoint.adapter
    guidance, true_cfg_scale = check_guidance(adapter, {"--negative-prompt": args.negative_prompt,
                                                        "--guidance": args.guidance,
                                                        "--true-cfg-scale": args.true_cfg_scale})
    height, width = default_size(args.model)
    requests = build_requests(
        entries, seed=args.seed, height=args.height or height, width=args.width or width,
        steps=args.steps, guidance=guidance, negative_prompt=args.negative_prompt,
        limits=adapter.size_limits(checkpoint), adapter=adapter, true_cfg_scale=true_cfg_scale,
        max_pixels=args.max_pixels, images=args.image, mask=args.mask, strength=args.strength,
    )
    _check_requests(requests, launch, world_size)
    launch, true_cfg, notes = _settle_pairs(requests, launch, world_size)
    launch = dataclasses.replace(launch, parallel_vae=_parallel_vae(requests, launch))
    return _plan(args, launch, requests, true_cfg, notes, world_size)


def _check_requests(requests: list[Request], launch: LaunchSpec, world_size: int) -> None:
    """Each request against the launch: its image inputs, a MagCache schedule's steps, context-parallel splits."""
    checkpoint, adapter, cache = launch.checkpoint, launch.checkpoint.adapter, launch.cache
    for request in requests:
        _check_image_inputs(request, adapter)
    if isinstance(cache, MagCacheConfig) and any(r.steps != cache.num_inference_steps for r in requests):
        raise ValueError(f"--cache {launch.cache_text}: MagCache's schedule is laid out for num_inference_steps="
                         f"{cache.num_inference_steps}, and some requests run another number of steps. Give them all "
                         "the same steps, or run them as separate jobs.")
    mode = context_mode(checkpoint, launch.ulysses, launch.ring, launch.cp_any_length, compiled=bool(launch.compile))
    if mode is not None and not mode.any_length:
        for request in requests:
            try:
                check_context_parallel_call(adapter, checkpoint, call_kwargs(request, adapter),
                                            launch.ulysses * launch.ring)
            except ValueError as error:
                raise ValueError(f"Request {request.index} ({request.height}x{request.width}): {error}") from None


def _settle_pairs(requests: list[Request], launch: LaunchSpec, world_size: int) -> tuple[LaunchSpec, frozenset,
                                                                                         list]:
    """CFG pairs only where some request uses true CFG (else the cfg ranks run as data parallelism, with a note);
    the mesh is checked once the pairs are known: a fallback runs on any world."""
    adapter = launch.checkpoint.adapter
    true_cfg = frozenset(r.index for r in requests if adapter.uses_true_cfg(r.negative_prompt,
                                                                            call_kwargs(r, adapter)))
    notes, pairs = [], launch.cfg
    if pairs > 1 and not true_cfg:
        notes.append(_no_pairs_note(adapter, world_size, launch.tp, launch.ulysses * launch.ring))
        pairs = 1
    mode = context_mode(launch.checkpoint, launch.ulysses, launch.ring, launch.cp_any_length,
                        compiled=bool(launch.compile))
    check_mesh(launch.checkpoint, world_size, tp=launch.tp, ulysses=launch.ulysses, ring=launch.ring, cfg=pairs,
               mode=mode)
    return dataclasses.replace(launch, cfg=pairs), true_cfg, notes


def _parallel_vae(requests: list[Request], launch: LaunchSpec) -> bool | None:
    """`--parallel-vae` as given; by default False where no request is large enough for the default to split (the
    other ranks then need not hold the VAE)."""
    min_pixels = resolve_parallel_vae(launch.parallel_vae, launch.checkpoint.component_class_name("vae"),
                                      launch.group)
    if launch.parallel_vae is None and min_pixels is not None and all(r.height * r.width < min_pixels
                                                                      for r in requests):
        return False
    return launch.parallel_vae


def _plan(args, launch: LaunchSpec, requests: list[Request], true_cfg: frozenset, notes: list,
          world_size: int) -> JobPlan:
    """The settings keys, the folder's lock and what is already done: the `JobPlan`."""
    checkpoint, adapter = launch.checkpoint, launch.checkpoint.adapter
    lora_records = launch.lora_records()
    keys = {r.index: output_key(r, checkpoint, launch.dtype, launch.cache_text, lora_records,
                                     launch.quantize) for r in requests}
    job_digest = digest({"outputs": [digest(keys[r.index]) for r in requests]})
    check_unlocked(args.out, job_digest)
    done, broken = scan_outputs({r.index: args.out / r.file_name(adapter.output_suffix) for r in requests}, keys,
                                adapter.read_settings, overwrite=args.overwrite)
    if broken:
        notes.append(f"{len(broken)} incomplete output(s) (empty, truncated or not {adapter.output_suffix}) will be "
                     f"made again: {', '.join(path.name for path in broken[:5])}{' ...' if len(broken) > 5 else ''}")
    return JobPlan(checkpoint, requests, args.out, launch.tp, world_size, launch.dtype,
                   settings={"compile": args.compile, "warmup": args.warmup, "cache": args.cache}, cfg=launch.cfg,
                   true_cfg=true_cfg, notes=notes, keys=keys, done=done, job_digest=job_digest,
                   loras=lora_records, cache=launch.cache, ulysses=launch.ulysses, ring=launch.ring,
                   cp_any_length=launch.cp_any_length, mesh_order=launch.mesh_order, cross_node=launch.cross_node,
                   parallel_vae=launch.parallel_vae, tp_plan=launch.plan, launch=launch,
                   batch_size=getattr(args, "batch_size", 1))


def output_key(request: Request, checkpoint: Checkpoint, dtype: str, cache: str | None, loras: list,
               quantize=None) -> dict:
    """An output's settings key (`outputs.settings_key`), the one rule for the job and the server: the pipeline
    class when not the index's own (img2img, Kontext...), the cache, the LoRAs by content and scale, and the
    quantization (`launch.quantize`: its text, e.g. "fp8")."""
    own_class = checkpoint.pipeline_class == checkpoint.pipeline_class_name
    return settings_key(request, model=model_identity(checkpoint.source), dtype=dtype,
                        pipeline=None if own_class else checkpoint.pipeline_class, cache=cache,
                        loras=[{"sha256": lora["sha256"], "scale": lora["scale"]} for lora in loras],
                        quantize=None if quantize is None else str(quantize))


def context_mode(checkpoint: Checkpoint, ulysses: int, ring: int, any_length: bool, *,
                 compiled: bool) -> context.RunnerMode | None:
    """How context parallelism runs this family (None without it): `launch.runner_mode` with the family's buckets."""
    return runner_mode(checkpoint, checkpoint.adapter.buckets, ulysses, ring, any_length, compiled=compiled)


def check_mesh(checkpoint: Checkpoint, world_size: int, *, tp: int, ulysses: int, ring: int, cfg: int,
               mode: context.RunnerMode | None) -> None:
    """The CFG pairs and the context-parallel layout against the model, once the pairs are settled: the job and
    `serve` share these rules (and their messages)."""
    adapter = checkpoint.adapter
    if cfg > 1 and not adapter.names_cfg_branches:
        raise ValueError(f"--cfg-parallel cannot split {adapter.pipeline_class}'s true CFG: it calls its transformer "
                         "outside `cache_context('cond' / 'uncond')`, so the two branches cannot be told apart. Drop "
                         "--cfg-parallel (true CFG then runs its two branches one after the other).")
    check_cfg_degree(cfg, tp, world_size)
    check_cp_degrees(world_size, tp=tp, ulysses=ulysses, ring=ring, cfg=cfg)
    if mode is not None:
        heads = checkpoint.config("transformer").get("num_attention_heads")
        context.check_layout(checkpoint.family.display_name, heads, world_size, tp=tp, ulysses=ulysses, ring=ring,
                             cfg=cfg, ulysses_anything=mode.ulysses_anything)


def _no_pairs_note(adapter, world_size: int, tp: int, cp: int = 1) -> str:
    why = ("the model is guidance-distilled" if not adapter.takes_negative_prompt
           else "that needs a negative prompt and a true_cfg_scale above 1")
    layout = f"tp={tp}" + (f", ulysses x ring={cp}" if cp > 1 else "")
    return (f"--cfg-parallel: no request uses true CFG ({why}), so the transformer runs once per step and the cfg "
            f"ranks run as data parallelism instead: dp={world_size // (tp * cp)}, {layout}.")


def _check_image_inputs(request: Request, adapter) -> None:
    """The request's image inputs, checked as `generate` checks them (headers only: each file was decoded once)."""
    with ExitStack() as files:
        images = [files.enter_context(Image.open(image.path)) for image in request.images]
        mask = None if request.mask is None else files.enter_context(Image.open(request.mask.path))
        try:
            check_image_kwargs(adapter, (images[0] if len(images) == 1 else images) or None, mask, request.strength)
        except (TypeError, ValueError) as error:
            raise ValueError(f"Request {request.index} ({request.prompt[:40]!r}): {error}") from None


def call_kwargs(request: Request, adapter) -> dict:
    """The stock pipeline call's kwargs for `request` (its guidance under the family's own kwarg name)."""
    kwargs = {"height": request.height, "width": request.width, "num_inference_steps": request.steps}
    if "max_area" in adapter.call_parameters():  # Kontext: keep --height x --width (its default rescales to 1 MP)
        kwargs["max_area"] = request.height * request.width
    if request.guidance is not None:
        kwargs[adapter.guidance_kwarg] = request.guidance
    if request.true_cfg_scale is not None:
        kwargs["true_cfg_scale"] = request.true_cfg_scale
    return kwargs


def batch_key(item: tuple[Request, bool], adapter):
    """What requests must share to be made in one stock call (`--batch-size`): the call's kwargs (size, steps,
    guidance), CFG pairing, a negative prompt or none, and the kind of image inputs: none, or (a class that takes one
    image per prompt, `image_inputs.takes_image_per_prompt`) one input image of the same size, a mask or none, the
    same strength. None (made alone): image inputs of a class that takes one set of images for the whole call."""
    request, with_partner = item
    images = None
    if request.images or request.mask is not None:
        if not takes_image_per_prompt(adapter):
            return None
        first = request.images[0]
        images = (len(request.images), first.width, first.height, request.mask is not None, request.strength)
    return (with_partner, request.negative_prompt is None, tuple(sorted(call_kwargs(request, adapter).items())),
            images)


def pair_work(requests: list[Request], plan: JobPlan, cfg_rank: int) -> list[tuple[Request, bool]]:
    """What one TP group of a CFG pair makes of its pair's `requests`, as (request, with its partner).

    A request with true CFG is made by both groups together; the others alternate between the groups, in order.
    """
    work, alone = [], 0
    for request in requests:
        if plan.cfg > 1 and request.index in plan.true_cfg:
            work.append((request, True))
            continue
        if plan.cfg == 1 or alone % 2 == cfg_rank:
            work.append((request, False))
        alone += 1
    return work


def run_job(plan: JobPlan, *, overwrite: bool, compile_backend: str | None, warm: bool, timeout_s: float) -> dict:
    """Generate this process's share of the requests (its replica's, see `pair_work`); rank 0 returns (and writes)
    the summary. Any failure is raised on every rank alike."""
    mesh = init_distributed(tp=plan.tp, ulysses=plan.ulysses, ring=plan.ring, cfg=plan.cfg, order=plan.mesh_order,
                            cross_node=plan.cross_node, timeout_s=timeout_s)
    lock = _lock_out_dir(plan)
    try:
        return _run_locked(plan, mesh, overwrite, compile_backend, warm)
    finally:
        if lock is not None:
            lock.release()


def _lock_out_dir(plan: JobPlan) -> JobLock | None:
    """Rank 0 takes the output folder's lock and, holding it, removes what a killed job left; a refusal (another
    job got there first) is raised on every rank."""
    lock, error = None, None
    if is_main_process():
        try:
            lock = JobLock(plan.out_dir, plan.job_digest).acquire()
            stale = remove_stale_temps(plan.out_dir)
            if stale:
                print(f"neuron-diffusers generate: note: removed {len(stale)} temporary file(s) a killed job left in "
                      f"{plan.out_dir}", file=sys.stderr, flush=True)
        except (ValueError, OSError) as caught:
            error = shareable(caught)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0]
    return lock


def _run_locked(plan: JobPlan, mesh, overwrite: bool, compile_backend: str | None, warm: bool) -> dict | None:
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    leader = is_group_leader(mesh)
    mine = plan.requests[dp_rank::dp]
    # The replica's leader decides what is left to do (the replica writes into one folder) and tells the replica.
    todo = broadcast_object_from_replica_leader(
        [r for r in mine if overwrite or r.index not in plan.done] if is_replica_leader(mesh) else None, mesh)
    work = pair_work(todo, plan, cfg_rank(mesh))

    images, phases, error = [], None, None
    try:
        if work:  # a fully resumed group loads nothing
            images, phases = _generate_share(plan, mesh, work, compile_backend, warm, dp)
    except dist.DistError:  # a peer is gone: nothing left to agree with
        raise
    except Exception as caught:
        error = caught
        default_store().compare_set(_FAILED_KEY, "", f"rank {dist.get_rank()}: {caught}")  # the first failure wins
    error = agree(error, dist.group.WORLD)  # every rank ends with the same error, or all go on
    if is_main_process():
        default_store().delete_key(_FAILED_KEY)  # every rank is past its last look at it: the next job starts clean
    if error is not None:
        raise error
    gathered = [None] * dist.get_world_size() if is_main_process() else None
    dist.gather_object({"images": images, "phases": phases} if leader else None, gathered, dst=0)
    summary, error = None, None
    if is_main_process():
        summary = _summary(plan, mesh, gathered, compile_report() if compile_backend else None)
        try:
            save_json(summary, plan.out_dir / "summary.json")
        except OSError as caught:
            error = OutputWriteError(f"Cannot write {plan.out_dir / 'summary.json'}: {caught.strerror or caught}. "
                                     "Every image is written; free space and rerun the same command to rewrite it.")
    raise_agreed(error, dist.group.WORLD)  # also: no rank leaves before the summary is written
    return summary


def _generate_share(plan: JobPlan, mesh, work: list[tuple[Request, bool]], compile_backend, warm: bool, dp: int):
    """Load, compile, and generate this TP group's `work`; returns the saved images' records and the phases."""
    if plan.launch is not None:
        pipe = load_pipeline(plan.launch, mesh)
    else:
        pipe = load_pipeline(plan.checkpoint, mesh, torch_dtype=getattr(torch, plan.dtype),
                             loras=[(lora["source"], lora["scale"]) for lora in plan.loras], cache=plan.cache,
                             cp_any_length=plan.cp_any_length, parallel_vae=plan.parallel_vae, plan=plan.tp_plan)
    compile_start = time.perf_counter()
    if compile_backend:
        if plan.launch is None:  # a launch spec compiles as `load_pipeline`'s last step
            compile_repeated_blocks(pipe, backend=compile_backend)
        if warm:
            sizes = sorted({(r.height, r.width) for r, _ in work})
            # A class that needs image inputs warms up with the first request's.
            warmup(pipe, sizes, num_inference_steps=max(2, min(r.steps for r, _ in work)),
                   **work[0][0].image_kwargs())
    compile_seconds = time.perf_counter() - compile_start
    after_warmup = (dict(pipe.times.seconds), dict(pipe.times.calls),
                    pipe.cache.totals.as_dict() if pipe.cache is not None else None)

    images = []
    # One bar, on rank 0, over its TP group's images; the stock per-step bar (rank 0 only, see `load_pipeline`)
    # clears itself after each call.
    pipe.pipe.set_progress_bar_config(disable=not is_main_process(), leave=False)
    bar = tqdm(total=len(work), desc="images" if dp * plan.cfg == 1 else "images (rank 0's TP group)",
               disable=not is_main_process())
    for batch in pack(work, plan.batch_size, lambda item: batch_key(item, pipe.adapter)):
        _make_batch(plan, pipe, [request for request, _ in batch], batch[0][1], dp, images)
        bar.update(len(batch))
    bar.close()

    return images, _phases(pipe, after_warmup, compile_seconds, images)


class BatchError(RuntimeError):
    """A stock call making several images failed: the message names them (their output files)."""


def _generate_batch(pipe, requests: list[Request], with_partner: bool) -> list | None:
    """One `generate` call for `requests` (compatible: `batch_key`), each with its own seed, negative prompt and
    input image (and mask)."""
    if len(requests) == 1:
        request = requests[0]
        return pipe.generate(request.prompt, seed=request.seed, negative_prompt=request.negative_prompt,
                             alone=not with_partner, **request.image_kwargs(), **call_kwargs(request, pipe.adapter))
    negatives = None if requests[0].negative_prompt is None else [r.negative_prompt for r in requests]
    try:
        return pipe.generate([r.prompt for r in requests], seed=[r.seed for r in requests], negative_prompt=negatives,
                             alone=not with_partner, batch_size=len(requests), **call_kwargs(requests[0], pipe.adapter),
                             **call_image_kwargs([r.image_kwargs() for r in requests]))
    except dist.DistError:
        raise
    except Exception as error:  # every rank raises the same agreed error, so every rank names the same images
        names = ", ".join(r.file_name(pipe.adapter.output_suffix) for r in requests)
        raise BatchError(f"A batch of {len(requests)} images failed ({names}): {error}") from error


def _make_batch(plan: JobPlan, pipe, requests: list[Request], with_partner: bool, dp: int, images: list) -> None:
    """Make and save one batch; the saving rank decides for the ranks that made it: all go on, or all stop."""
    start = time.perf_counter()
    outputs = _generate_batch(pipe, requests, with_partner)
    error = None
    if outputs is not None:  # the rank that holds the images saves them
        seconds = (time.perf_counter() - start) / len(requests)
        # Each image's step-cache counts: its stock call's (a batch decides once for all its rows).
        counts = pipe.cache_counts[-len(requests):] if pipe.cache is not None else [None] * len(requests)
        for request, output, cache in zip(requests, outputs, counts, strict=True):
            error = _save(plan, pipe, request, output, with_partner, dp, images, seconds, len(requests), cache)
            if error is not None:
                break
        if error is None and default_store().check([_FAILED_KEY]):
            error = OutputWriteError(f"Stopped: {default_store().get(_FAILED_KEY).decode()}")
    raise_agreed(error, image_group(pipe.mesh), pipe.mesh["cfg"].get_group() if with_partner else None)


def _save(plan: JobPlan, pipe, request: Request, output, with_partner: bool, dp: int, images: list,
          seconds: float, batch: int, cache: dict | None) -> OutputWriteError | None:
    """Write one output with its settings and record it in `images` (with `cache`, its step-cache counts); the error
    (a full disk) instead of raising."""
    save_start = time.perf_counter()
    path = plan.out_dir / request.file_name(pipe.adapter.output_suffix)
    try:
        pipe.adapter.save(output, path, text=settings_text(
            request, model=plan.checkpoint.source, pipeline=plan.checkpoint.pipeline_class, tp=plan.tp, dp=dp,
            cfg=2 if with_partner else 1, dtype=plan.dtype, loras=plan.loras, key=plan.keys[request.index],
            cache=plan.settings.get("cache"), ulysses=plan.ulysses, ring=plan.ring, plan=plan.tp_plan))
    except OSError as caught:  # media's staged writes leave no partial file behind
        return OutputWriteError(
            f"Cannot write {path}: {caught.strerror or caught}. The {len(images)} output(s) this group finished "
            "before it are complete and kept, and no partial file is left; free space (or fix the folder) and rerun "
            "the same command to make the rest.")
    save_seconds = time.perf_counter() - save_start
    images.append({**asdict(request), "file": path.name, "seconds": round(seconds + save_seconds, 4),
                   "save_seconds": round(save_seconds, 4), "rank": dist.get_rank(), "cfg_parallel": with_partner,
                   **({"batch": batch} if batch > 1 else {}),
                   **({"cache": cache} if cache is not None else {})})
    return None


#: Rows of the timing table that count (a step cache's transformer forwards) instead of timing.
COUNT_PHASES = ("transformer forwards computed", "transformer forwards from cache")


def _phases(pipe, after_warmup: tuple[dict, dict, dict | None], compile_seconds: float, images: list) -> dict:
    """Seconds per phase on this rank: load, compile (incl. warm-up), encode, denoise per step, decode, save; with a
    step cache, also this rank's transformer forwards computed and served from the cache (counts).

    Encode, denoise and decode count the real requests only: warm-up runs are compile time. With a cache,
    "denoise per transformer forward" averages computed and cached forwards.
    """
    seconds = {name: value - after_warmup[0].get(name, 0.0) for name, value in pipe.times.seconds.items()}
    forwards = pipe.times.calls.get("transformer forward", 0) - after_warmup[1].get("transformer forward", 0)
    decode = seconds.get("decode", 0.0)
    denoise = seconds.get("denoise + decode", 0.0) - decode
    cached = {}
    if pipe.cache is not None:
        totals, before = pipe.cache.totals.as_dict(), after_warmup[2]
        cached = dict(zip(COUNT_PHASES, (totals["computed"] - before["computed"],
                                         totals["cached"] - before["cached"]), strict=True))
    return {
        "load transformer (sharded)": round(pipe.times.seconds.get("load transformer (sharded)", 0.0), 4),
        "load other components": round(pipe.times.seconds.get("load other components", 0.0), 4),
        "fuse LoRAs": round(pipe.times.seconds.get("fuse LoRAs", 0.0), 4),
        "compile + warm-up": round(compile_seconds, 4),
        "encode": round(seconds.get("encode", 0.0), 4),
        "denoise": round(denoise, 4),
        "denoise per transformer forward": round(denoise / forwards, 4) if forwards else None,
        "decode": round(decode, 4),
        "save": round(sum(image["save_seconds"] for image in images), 4),
        **cached,
    }


def _summary(plan: JobPlan, mesh, gathered: list, compile_info: dict | None) -> dict:
    """This run's records (`generated` counts them) and, under `images`, every output's record: earlier runs' are
    kept while their files are there. An output found done on disk with no earlier record (made by an attempt killed
    before it wrote a summary, e.g. before a torchrun restart) is listed too, with `seconds` unknown (null)."""
    leaders = [entry for entry in gathered if entry is not None]
    new = sorted((image for entry in leaders for image in entry["images"]), key=lambda image: image["index"])
    suffix = plan.checkpoint.adapter.output_suffix
    found = [{**asdict(r), "file": r.file_name(suffix), "seconds": None} for r in plan.requests if r.index in plan.done]
    images = merge_records(found + read_summary_images(plan.out_dir / "summary.json"), new, plan.out_dir)
    return {
        "model": plan.checkpoint.source,
        "checkpoint": str(plan.checkpoint.path),
        "mesh": {"dims": list(mesh.mesh_dim_names), "shape": list(mesh.shape), "world_size": plan.world_size,
                 "nodes": detect_nodes(plan.world_size).count},
        # torchrun --max-restarts: how many times the agent restarted the group before this run (0: first attempt).
        "restarts": group_restarts(),
        "dtype": plan.dtype,
        "plan": plan.tp_plan,
        "loras": plan.loras,
        "parallel_vae": plan.parallel_vae,
        "neuron_diffusers": __version__,
        "requests": len(plan.requests),
        "generated": len(new),
        "images": images,
        "phases_per_tp_group": [entry["phases"] for entry in leaders],
        "compile": compile_info,
    }


def format_phases(summary: dict) -> str:
    """The final timing table: one column per TP group ("-" for a group that had nothing left to do); seconds,
    and the step cache's forward counts (whole numbers) where there are any."""
    groups = summary["phases_per_tp_group"]
    names = next((list(group) for group in groups if group), [])
    if not names:
        return "nothing left to generate: every output exists (pass --overwrite to regenerate)"
    rows = ["| phase | " + " | ".join(f"group {i}" for i in range(len(groups))) + " |",
            "|---|" + "---:|" * len(groups)]
    for phase in names:
        values = [None if group is None else group[phase] for group in groups]
        counts = phase in COUNT_PHASES
        rows.append(f"| {phase}{'' if counts else ' (s)'} | "
                    + " | ".join("-" if v is None else f"{v}" if counts else f"{v:.3f}" for v in values) + " |")
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="flux",
                        help="checkpoint folder, or a tiny family name built offline (default: flux, a tiny FLUX.1)")
    parser.add_argument("--prompt", default=None, help="one prompt (or use --prompts)")
    parser.add_argument("--prompts", type=Path, default=None,
                        help=".txt (one prompt a line) or .jsonl (prompt, negative_prompt, seed, height, width, steps, "
                             "guidance, true_cfg_scale, image, mask, strength per line; paths relative to the file)")
    parser.add_argument("--pipeline", default=None, metavar="CLASS",
                        help="the stock pipeline class to run the checkpoint with, on its transformer (default: the "
                             "one its model_index.json names), e.g. FluxKontextPipeline, FluxImg2ImgPipeline, "
                             "FluxInpaintPipeline")
    parser.add_argument("--image", type=Path, action="append", default=[], metavar="PATH",
                        help="input image for every prompt; repeat for reference images (FLUX.2, Qwen-Image-Edit-Plus, "
                             "Qwen-Image-2.1)")
    parser.add_argument("--mask", type=Path, default=None, metavar="PATH",
                        help="inpainting mask (white repaints), the input image's size")
    parser.add_argument("--strength", type=finite_float, default=None,
                        help="img2img / inpainting: how much of the image to repaint, in (0, 1]")
    parser.add_argument("--negative-prompt", default=None,
                        help="for true classifier-free guidance (Qwen-Image, Qwen-Image-2.1; FLUX.1 with "
                             "true_cfg_scale)")
    parser.add_argument("--out", required=True, type=out_folder,
                        help="folder: one PNG per prompt (H3: MP4 + WAV), named from its index and prompt, "
                             "+ summary.json")
    parser.add_argument("--overwrite", action="store_true",
                        help="regenerate outputs that already exist (default: skip those made with the same settings, "
                             "refuse those made with other settings)")
    parser.add_argument("--guidance", type=finite_float, default=None,
                        help="guidance scale (FLUX: guidance_scale; Qwen-Image / 2.1: true_cfg_scale)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--true-cfg-scale", type=finite_float, default=None,
                        help="FLUX.1's true CFG scale (with --negative-prompt); for Qwen-Image / 2.1 another name "
                             "for --guidance")
    parser.add_argument("--height", type=positive_int, default=None)
    parser.add_argument("--width", type=positive_int, default=None)
    parser.add_argument("--max-pixels", type=positive_int, default=DEFAULT_MAX_PIXELS,
                        help=f"refuse images larger than this many pixels (default {DEFAULT_MAX_PIXELS}, 2048 x 2048); "
                             "the model's own maximum size applies in any case")
    parser.add_argument("--steps", type=positive_int, default=4)
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="seconds any collective may wait")
    add_launch_arguments(parser, lora_help="a LoRA (.safetensors file, a folder holding one, or a Hub id) fused into "
                                           "every rank's shard at SCALE (default 1); repeat for several. One set for "
                                           "the whole job")


def _cp_text(plan: JobPlan) -> str:
    return f"ulysses={plan.ulysses}, ring={plan.ring}, " if plan.ulysses * plan.ring > 1 else ""


def main(args: argparse.Namespace) -> int:
    """`neuron-diffusers generate`: the job, alone or under torchrun; exit status 1 when a rank failed."""
    runtime = detect_runtime()
    # Every check runs here, before the process group starts or any weight is read. Every rank resolves the
    # model itself: a tiny family is built into the cache by whichever rank renames its build into place first.
    plan = plan_job(args, runtime.world_size, runtime.device_type)
    if runtime.rank == 0:
        for note in plan.notes:
            print(f"neuron-diffusers generate: note: {note}", file=sys.stderr, flush=True)
    # torchrun stops its workers with SIGTERM: leave through Python (temporary files and the folder lock cleaned up
    # on the way out) instead of dying wherever the signal lands.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with ExitWhenStuck():  # ... or, blocked in a collective with a dead peer, end 5 s after the signal
            summary = run_job(plan, overwrite=args.overwrite, compile_backend=args.compile, warm=args.warmup,
                              timeout_s=args.timeout)
    except (RuntimeError, dist.DistError) as error:
        # Another rank died and a collective failed or timed out, or an output could not be written (the same
        # error on every rank): what was written is complete (atomic writes), and the same command resumes.
        print(f"neuron-diffusers generate: error on rank {runtime.rank}: {error}\nOutputs written so far are "
              "complete; rerun the same command to generate the rest.", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if summary is not None:
        print(format_phases(summary))
        if summary["compile"]:
            report = {k: v for k, v in summary["compile"].items() if k != "recompile_reasons"}
            print(f"compile report: {json.dumps(report)}")
        print(f"wrote {summary['generated']} of {summary['requests']} to {plan.out_dir} "
              f"(tp={plan.tp}, {_cp_text(plan)}cfg={plan.cfg}, dp={plan.dp}, {plan.dtype}); "
              "summary.json", flush=True)
    # The fixed shutdown order (with `cli.run`'s exit after it, see `distributed.exit_process`): every rank past its
    # last collective, then the process group destroyed while the interpreter is whole.
    leave_together(args.timeout)
    dist.destroy_process_group()
    return 0


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)
