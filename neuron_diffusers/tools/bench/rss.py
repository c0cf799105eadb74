"""Peak-RSS evidence that a tensor-parallel load never materialises a full planned weight on a rank.

The plan report counts what a rank *keeps*; this measures what a rank's process *touches* while
loading. It writes a FLUX.1-architecture transformer at full width (hidden 2048, 16 heads x 128)
but only three blocks, with random bf16 weights (about 0.57 GiB of safetensors), then loads it in
fresh processes:

(a) one process, plain `from_pretrained`;
(b) two gloo CPU ranks, `from_pretrained(..., parallel_config=TensorParallelConfig(mesh))`.

Each process resets its peak-RSS mark (`/proc/self/clear_refs`, Linux) right before the load,
then reports growth over the RSS it had then: the peak during the load, the RSS at its end split
into anonymous (allocated by the process) and file-backed (pages of the mmapped checkpoint), and
the peak once every weight it holds has been read (safetensors weights are mmap views, resident
only once read). A rank that materialised a full planned weight and kept only its slice would show
a load peak above its end-of-load RSS, or anonymous memory beyond the slices it had to copy.

(c) two gloo CPU ranks load as in (b), read every weight, then fuse a LoRA on every Linear
(`parallel/lora.py`, rank 16). What stays is a CPU copy of each touched local shard (to restore
the base exactly) and the read LoRA; what comes and goes is one fp32 block of rows of one local
shard at a time. A rank that built a full weight, or a full delta, to fuse would show a peak above
its end-of-fuse RSS by at least that weight's size (the largest is given for comparison).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import FluxPipeline, FluxTransformer2DModel, TensorParallelConfig
from safetensors.torch import save_file
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...compat.tp_loading import shard_specs
from ...parallel import lora
from ...parallel.plan_variants import variant_plan
from ..plan.sharding import BF16_BYTES, held_params, planned_model
from ..spawn import run_on_cpu_ranks

CONFIG = dict(num_attention_heads=16, attention_head_dim=128, num_layers=1, num_single_layers=2,
              joint_attention_dim=2048, pooled_projection_dim=768, in_channels=64)
MB = 2**20
LORA_RANK = 16


def build_checkpoint(path: Path, seed: int = 0) -> Path:
    """Write the random transformer as a one-component pipeline folder (`transformer/` + `model_index.json`)."""
    with torch.device("meta"):
        model = FluxTransformer2DModel(**CONFIG)
    # `torch.nn.Module.to`, not `ModelMixin.to`, which warns about fp32-only modules this model has none of.
    torch.nn.Module.to(model, torch.bfloat16)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(path / "transformer")
    (path / "model_index.json").write_text(json.dumps(
        {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    return path


def build_lora(checkpoint: Path, seed: int = 0) -> Path:
    """A random rank-16 LoRA on every Linear of the checkpoint's transformer (PEFT keys, fp32), next to it."""
    with torch.device("meta"):
        model = FluxTransformer2DModel(**CONFIG)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(LORA_RANK, module.in_features,
                                                                      generator=generator) * 0.01
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, LORA_RANK,
                                                                     generator=generator) * 0.01
    path = checkpoint / "lora.safetensors"
    save_file(state, path)
    return path


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none: then everything is assumed to fit)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_rss_mib() -> dict[str, float]:
    """This process's peak, current, anonymous and file-backed resident memory (Linux `/proc/self/status`)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[name].split()[0]) / 1024
            for key, name in (("peak", "VmHWM"), ("now", "VmRSS"), ("anon", "RssAnon"), ("file", "RssFile"))}


def _measured_load(checkpoint: str, tp: bool) -> dict:
    """Runs in a fresh process: load the transformer, then read every weight once; RSS growth in MiB."""
    kwargs = {}
    if tp:
        kwargs["parallel_config"] = TensorParallelConfig(mesh=DeviceMesh("cpu", list(range(dist.get_world_size()))))
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = process_rss_mib()
    model = FluxTransformer2DModel.from_pretrained(checkpoint, subfolder="transformer", dtype=torch.bfloat16,
                                                   **kwargs)
    loaded = process_rss_mib()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    with torch.no_grad():
        for tensor in local:  # mmap-backed weights become resident only when read
            tensor.view(torch.uint8).max()
    used = process_rss_mib()
    return {
        "held_mib": sum(t.nbytes for t in local) / MB,
        "load_peak_mib": loaded["peak"] - before["now"],
        "load_end_mib": loaded["now"] - before["now"],
        "load_anon_mib": loaded["anon"] - before["anon"],
        "load_file_mib": loaded["file"] - before["file"],
        "used_peak_mib": used["peak"] - before["now"],
    }


def _measured_fuse(checkpoint: str, lora_file: str) -> dict:
    """Runs in a fresh process: a TP load with every weight read, then the LoRA fused; RSS growth in MiB."""
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    model = FluxTransformer2DModel.from_pretrained(checkpoint, subfolder="transformer", dtype=torch.bfloat16,
                                                   parallel_config=TensorParallelConfig(mesh=mesh))
    local = {name: p.to_local() if isinstance(p, DTensor) else p for name, p in model.named_parameters()}
    with torch.no_grad():
        for tensor in local.values():
            tensor.view(torch.uint8).max()
    fused = lora.FusedLoras(model, FluxPipeline, groups=[dist.group.WORLD])
    Path("/proc/self/clear_refs").write_text("5")
    before = process_rss_mib()
    fused.set([(lora_file, 1.0)])
    after = process_rss_mib()
    copies = fused.base_copies
    touched = [f"{name}.weight" for name in copies]
    return {
        "fuse_peak_mib": after["peak"] - before["now"],
        "fuse_end_mib": after["now"] - before["now"],
        "fuse_anon_mib": after["anon"] - before["anon"],
        "fuse_file_mib": after["file"] - before["file"],
        "copies_mib": sum(saved.nbytes for saved in copies.values()) / MB,
        "largest_local_fp32_mib": max(local[name].numel() for name in touched) * 4 / MB,
        "largest_full_mib": max(model.get_parameter(name).numel() for name in touched) * BF16_BYTES / MB,
    }


def _expected(checkpoint: Path, tp: int) -> dict[str, float]:
    """What the plan predicts for one rank, in MiB of bf16.

    `rowwise_slices`: a rowwise slice is strided in the row-major file, so the loader copies it
    (anonymous memory) and reads every page of the whole weight through the mmap (file-backed);
    colwise slices and replicated weights stay zero-copy views of the file.
    """
    planned = planned_model(str(checkpoint))
    model = planned.module
    specs = shard_specs(model, variant_plan(planned.family, "default"), tp)
    params = dict(model.named_parameters())
    sharded = {name for name, spec in specs.items() if spec.dim is not None}
    return {
        "share": held_params(model, sharded, tp) * BF16_BYTES / MB,
        "rowwise_slices": sum(params[n].numel() // tp for n, spec in specs.items() if spec.dim == 1) * BF16_BYTES / MB,
        "largest_planned_weight": max(params[n].numel() for n in sharded) * BF16_BYTES / MB,
    }


def run(seed: int = 0) -> dict:
    """Build the checkpoint in a temporary folder, measure (a) and (b), print and return the figures."""
    with tempfile.TemporaryDirectory(prefix="neuron-diffusers-rss-") as tmp:
        checkpoint = build_checkpoint(Path(tmp), seed)
        result = {
            "checkpoint_mib": sum(f.stat().st_size for f in checkpoint.rglob("*.safetensors")) / MB,
            "tp2_expected_mib": _expected(checkpoint, 2),
            "plain": run_on_cpu_ranks(_measured_load, 1, str(checkpoint), False)[0],
            "tp2": run_on_cpu_ranks(_measured_load, 2, str(checkpoint), True),
        }
        lora_file = build_lora(checkpoint, seed)
        result["lora_mib"] = lora_file.stat().st_size / MB
        # glibc keeps freed buffers in its heap once they were large enough to raise its mmap threshold, so a
        # transient buffer would stay resident and look permanent: a fixed threshold returns each one on free.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
        try:
            result["tp2_fuse"] = run_on_cpu_ranks(_measured_fuse, 2, str(checkpoint), str(lora_file))
        finally:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
    print(format_rss(result))
    return result


def format_rss(result: dict) -> str:
    """A markdown table of `run`'s result, with the figures it is to be read against."""
    expected = result["tp2_expected_mib"]
    lines = [
        f"checkpoint: {result['checkpoint_mib']:.0f} MiB of bf16 safetensors (FLUX.1 architecture, {CONFIG})",
        f"TP=2 rank, as planned: {expected['share']:.0f} MiB held, of which {expected['rowwise_slices']:.0f} MiB "
        f"rowwise slices (copied); largest planned weight, whole: {expected['largest_planned_weight']:.0f} MiB",
        "",
        "| load | weights held | load: peak growth | load: growth at end (anon + file) | peak growth once every "
        "weight was read |",
        "|---|---:|---:|---:|---:|",
    ]
    rows = [("plain, 1 process", result["plain"])] + [(f"TP=2, rank {r}", row) for r, row in enumerate(result["tp2"])]
    for label, row in rows:
        lines.append(f"| {label} | {row['held_mib']:.0f} | {row['load_peak_mib']:.0f} | {row['load_end_mib']:.0f} "
                     f"({row['load_anon_mib']:.0f} + {row['load_file_mib']:.0f}) | {row['used_peak_mib']:.0f} |")
    lines.append("\n(MiB; growth over each process's RSS right before `from_pretrained`)")
    if "tp2_fuse" in result:
        lines += [
            "",
            f"Fusing a rank-{LORA_RANK} LoRA on every Linear ({result['lora_mib']:.0f} MiB file) into the TP=2 shards:",
            "",
            "| rank | fuse: peak growth | growth at end (anon + file) | CPU copies of touched shards | transient "
            "(peak - end) | largest local shard, fp32 | largest full weight, bf16 |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r, row in enumerate(result["tp2_fuse"]):
            lines.append(f"| {r} | {row['fuse_peak_mib']:.0f} | {row['fuse_end_mib']:.0f} ({row['fuse_anon_mib']:.0f} "
                         f"+ {row['fuse_file_mib']:.0f}) | {row['copies_mib']:.0f} | "
                         f"{row['fuse_peak_mib'] - row['fuse_end_mib']:.0f} | "
                         f"{row['largest_local_fp32_mib']:.0f} | {row['largest_full_mib']:.0f} |")
        lines.append(f"\n(MiB; growth over the RSS right before `set_loras`, every weight already read. Writing turns "
                     "the file-backed (copy-on-write) shards anonymous; fp32 work memory is one block of rows, at most "
                     f"{lora.FP32_CHUNK_BYTES // MB} MiB)")
    return "\n".join(lines)
