"""Peak RSS of the rank that encodes vs the rank that does not, with a text encoder big enough to see.

`load_pipeline` loads the text encoders (and, with `parallel_vae=False` as here, the VAE) only on the leader of
each tensor-parallel group; the other ranks load their transformer shard and the scheduler. This benchmark shows
what that saves. It builds the tiny FLUX.1 checkpoint with its T5 (`text_encoder_2`) widened to about
`--encoder-mib` MiB of fp32 weights (the transformer's `joint_attention_dim` follows T5's width), then measures,
each in a fresh process:

- two gloo CPU ranks at TP=2: `load_pipeline` + one `generate`;
- the stock way, what every rank pays without our runner: `DiffusionPipeline.from_pretrained` + one call.

Each process reports whether it holds a text encoder, how many `transformers.PreTrainedModel` instances are
alive in it, its RSS right after loading and its peak RSS.

The peak is the process's own high-water mark (`VmHWM`). `getrusage(RUSAGE_SELF).ru_maxrss` is reported too, but
on Linux it is not the process's own: the kernel keeps the pre-`exec` peak, and `spawn` forks the parent before
exec'ing the rank, so `ru_maxrss` never reads below the parent's peak (measured: a parent that had touched
1.5 GiB spawns a child with `ru_maxrss` 1.5 GiB and `VmHWM` 15 MiB). Both agree when the parent stays small,
which is why the checkpoint is built in a spawned process too.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import DiffusionPipeline, FluxTransformer2DModel
from transformers import PreTrainedModel, T5Config, T5EncoderModel

from ... import tiny
from ...distributed import init_distributed
from ...runner import load_pipeline
from ..spawn import run_on_cpu_ranks
from .rss import process_rss_mib

MIB = 2**20
FP32_BYTES = 4
PROMPT = "a red fox in the snow"
T5_LAYERS = 4  # a few wide layers: the encoder's size grows with its width, its depth stays readable
T5_HEAD_DIM = 64  # real T5's d_kv
TIMEOUT_S = 900.0


# -- the checkpoint --------------------------------------------------------------------------------------------


def t5_width(encoder_mib: float, vocab_size: int, layers: int = T5_LAYERS) -> int:
    """The T5 `d_model` (a multiple of `T5_HEAD_DIM`, `d_ff = 2 * d_model`) whose fp32 weights come nearest
    `encoder_mib`. Per layer: q, k, v, o (4 d^2) and the gated FFN (3 d * 2d); plus the token embedding."""
    params = encoder_mib * MIB / FP32_BYTES
    quadratic = layers * (4 + 3 * 2)
    width = (-vocab_size + math.sqrt(vocab_size**2 + 4 * quadratic * params)) / (2 * quadratic)
    return max(T5_HEAD_DIM, round(width / T5_HEAD_DIM) * T5_HEAD_DIM)


def _build_on_a_rank(path: str, encoder_mib: float, seed: int) -> dict:
    """Runs in a spawned process, so the benchmark's own process never holds the big encoder (see the module doc).

    The tiny FLUX.1 build, then `text_encoder_2` and the transformer rebuilt at the new text width and saved
    over theirs with `save_pretrained`.
    """
    root = tiny.build_tiny("flux", path, seed=seed)
    t5_config = T5Config.from_pretrained(root / "text_encoder_2")
    width = t5_width(encoder_mib, t5_config.vocab_size)
    t5_config.update(dict(d_model=width, d_kv=T5_HEAD_DIM, num_heads=width // T5_HEAD_DIM, d_ff=2 * width,
                          num_layers=T5_LAYERS))
    torch.manual_seed(seed)
    text_encoder_2 = T5EncoderModel(t5_config)
    shutil.rmtree(root / "text_encoder_2")
    text_encoder_2.save_pretrained(root / "text_encoder_2")

    transformer_config = dict(FluxTransformer2DModel.load_config(root, subfolder="transformer"))
    transformer_config["joint_attention_dim"] = width  # `context_embedder` takes T5's hidden states
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel.from_config(transformer_config)
    shutil.rmtree(root / "transformer")
    transformer.save_pretrained(root / "transformer")
    return {"d_model": width, "d_ff": 2 * width, "num_layers": T5_LAYERS, "num_heads": width // T5_HEAD_DIM,
            "params": sum(p.numel() for p in text_encoder_2.parameters())}


def build_checkpoint(path: Path, encoder_mib: float = 512, seed: int = 0) -> dict:
    """Build the checkpoint into `path` (new or empty); returns the T5's shape and each component's MiB on disk."""
    t5 = run_on_cpu_ranks(_build_on_a_rank, 1, str(path), encoder_mib, seed, timeout_s=TIMEOUT_S)[0]
    components = {folder.name: sum(f.stat().st_size for f in folder.rglob("*.safetensors")) / MIB
                  for folder in sorted(Path(path).iterdir()) if folder.is_dir()}
    return {"path": str(path), "t5": t5, "safetensors_mib": {k: v for k, v in components.items() if v}}


# -- what each process measures ----------------------------------------------------------------------------------


def _rss_mib() -> dict[str, float]:
    """This process's current RSS, its own peak (`VmHWM`), and `ru_maxrss` (see the module doc), in MiB."""
    return {**process_rss_mib(), "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB


def _alive_pretrained_models() -> list[str]:
    """Class names of every `transformers.PreTrainedModel` alive in this process (nested ones, e.g. T5Stack, too)."""
    gc.collect()
    # `issubclass(type(...))`, not `isinstance`: it reads no attribute, so deprecated module-level objects
    # (e.g. `torch.distributed.reduce_op`) do not warn.
    return sorted(type(obj).__name__ for obj in gc.get_objects() if issubclass(type(obj), PreTrainedModel))


def _report(loaded: dict, images, **fields) -> dict:
    models = _alive_pretrained_models()
    end = _rss_mib()
    return {**fields, "pretrained_models": len(models), "pretrained_model_classes": models,
            "image_size": None if images is None else list(images[0].size),
            "loaded_rss_mib": loaded["now"], "peak_rss_mib": end["peak"], "ru_maxrss_mib": end["ru_maxrss"]}


def _tp_rank(checkpoint: str, height: int, width: int, steps: int) -> dict:
    """One TP=2 rank: `load_pipeline` + one `generate`."""
    mesh = init_distributed(tp=2)
    pipe = load_pipeline(checkpoint, mesh, parallel_vae=False)
    loaded = _rss_mib()
    images = pipe.generate(PROMPT, seed=0, height=height, width=width, num_inference_steps=steps)
    return _report(loaded, images, rank=dist.get_rank(), tp_rank=mesh["tp"].get_local_rank(),
                   role="leader: encodes, denoises, decodes" if pipe.is_leader else "denoises only",
                   holds_encoder=pipe.encoder is not None)


def _stock_process(checkpoint: str, height: int, width: int, steps: int) -> dict:
    """The stock way: the whole pipeline in one process, as every rank would hold it without our runner."""
    pipe = DiffusionPipeline.from_pretrained(checkpoint)
    loaded = _rss_mib()
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        images = pipe(PROMPT, generator=torch.Generator("cpu").manual_seed(0), height=height, width=width,
                      num_inference_steps=steps).images
    encoders = [getattr(pipe, name, None) for name in ("text_encoder", "text_encoder_2")]
    return _report(loaded, images, rank=None, tp_rank=None, role="stock pipeline per rank",
                   holds_encoder=any(e is not None for e in encoders))


# -- the benchmark -------------------------------------------------------------------------------------------------


def measure(encoder_mib: float = 512, steps: int = 2, directory: Path | None = None, seed: int = 0) -> dict:
    """Build the checkpoint (in `directory`, kept, or a temporary folder), run both measurements, return the figures.

    `result["tp2"]` has one row per rank (rank order), `result["stock"]` the single stock process.
    """
    height, width = tiny.default_size("flux")
    with tempfile.TemporaryDirectory(prefix="neuron-diffusers-encoder-") as tmp:
        path = Path(directory) if directory is not None else Path(tmp) / "flux-big-t5"
        checkpoint = build_checkpoint(path, encoder_mib, seed)
        args = (str(path), height, width, steps)
        return {
            "checkpoint": checkpoint,
            "encoder_mib_requested": encoder_mib,
            "steps": steps,
            "size": [height, width],
            "tp2": run_on_cpu_ranks(_tp_rank, 2, *args, timeout_s=TIMEOUT_S),
            "stock": run_on_cpu_ranks(_stock_process, 1, *args, timeout_s=TIMEOUT_S)[0],
        }


def format_table(result: dict) -> str:
    """A markdown table of `measure`'s result, headed by what the checkpoint holds."""
    ckpt = result["checkpoint"]
    t5 = ckpt["t5"]
    sizes = ", ".join(f"{name} {mib:.1f}" for name, mib in ckpt["safetensors_mib"].items())
    lines = [
        f"checkpoint: tiny FLUX.1 with T5 d_model {t5['d_model']}, d_ff {t5['d_ff']}, {t5['num_layers']} layers "
        f"({t5['params'] / 1e6:.1f} M params); safetensors MiB: {sizes}",
        f"one {result['size'][0]}x{result['size'][1]} image, {result['steps']} steps, fp32 on CPU",
        "",
        "| process | TP rank | role | holds text encoder | PreTrainedModel instances | RSS after load (MiB) "
        "| peak RSS (MiB) |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    rows = [(f"TP=2 rank {row['rank']}", row) for row in result["tp2"]] + [("stock, 1 process", result["stock"])]
    for label, row in rows:
        tp_rank = "-" if row["tp_rank"] is None else row["tp_rank"]
        lines.append(f"| {label} | {tp_rank} | {row['role']} | {'yes' if row['holds_encoder'] else 'no'} | "
                     f"{row['pretrained_models']} | {row['loaded_rss_mib']:.0f} | {row['peak_rss_mib']:.0f} |")
    lines.append("\n(peak RSS: the process's own high-water mark, VmHWM; `--json` also gives ru_maxrss. RSS after load "
                 "counts only the safetensors pages read so far: most weights are mmapped and read on first use.)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--encoder-mib", type=float, default=512,
                        help="approximate fp32 size of the T5 text encoder to build (default: 512)")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps of the one image (default: 2)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="build the checkpoint into this new or empty folder and keep it (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of the table")


def main(args: argparse.Namespace) -> None:
    result = measure(args.encoder_mib, args.steps, args.dir)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
