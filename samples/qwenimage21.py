"""Qwen-Image-2.1 text-to-image, tensor-parallel over the ranks torchrun launched (or one plain `python` process).

Offline, on a tiny random Qwen-Image-2.1 built on first use (CPU ranks over gloo), with true CFG switched on:

    torchrun --nproc_per_node=2 samples/qwenimage21.py --negative-prompt "blurry" --true-cfg-scale 4 --out q21.png

The real model, unchanged script: download Qwen/Qwen-Image-2.1 and pass the folder. Without --height, --width and
--steps a real checkpoint runs Qwen's recommended 1024x1024, 40 steps, no guidance (`--negative-prompt TEXT
--true-cfg-scale 4` turns true CFG on, two passes per step), in bfloat16 on an accelerator. The transformer is small
(13 GiB bf16): TP=4 keeps 3.3 GiB per rank (32 heads: TP 1, 2, 4, 8, 16 or 32):

    hf download Qwen/Qwen-Image-2.1 --local-dir /models/Qwen-Image-2.1
    torchrun --nproc_per_node=4 samples/qwenimage21.py --model /models/Qwen-Image-2.1 --compile --out q21.png

Prompts are padded to length buckets (64 ... 1024 tokens) with masked positions, and the transformer's RoPE positions
are those of the unpadded prompt, so the image is the unpadded one and a compiled model never recompiles for a new
prompt length (--compile compiles every bucket up front).
"""

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

import neuron_diffusers as nd
from neuron_diffusers import tiny
from neuron_diffusers.compile import compile_repeated_blocks, warmup
from neuron_diffusers.distributed import detect_runtime
from neuron_diffusers.media import save_png

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="qwenimage21", help="checkpoint folder (default: the tiny Qwen-Image-2.1)")
parser.add_argument("--prompt", default="A capybara wearing a wizard hat, reading a book by candlelight, oil painting")
parser.add_argument("--negative-prompt", default=None, help="what to steer away from, with --true-cfg-scale > 1")
parser.add_argument("--true-cfg-scale", type=float, default=1.0, help="> 1 with a negative prompt runs true CFG")
parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: every rank)")
parser.add_argument("--height", type=int)
parser.add_argument("--width", type=int)
parser.add_argument("--steps", type=int)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--compile", nargs="?", const="auto", metavar="BACKEND", help="compile every length bucket")
parser.add_argument("--out", type=Path, default=Path("qwenimage21.png"))
args = parser.parse_args()

tiny_model = args.model == "qwenimage21"
height, width = tiny.default_size("qwenimage21") if tiny_model else (1024, 1024)
height, width, steps = args.height or height, args.width or width, args.steps or (4 if tiny_model else 40)
dtype = torch.float32 if detect_runtime().device_type == "cpu" else torch.bfloat16

mesh = nd.init_distributed(tp=args.tp)  # torchrun env -> neuron > cuda > cpu; a ("dp", "tp") mesh
pipe = nd.load_pipeline(args.model, mesh=mesh, torch_dtype=dtype)
call = dict(negative_prompt=args.negative_prompt, true_cfg_scale=args.true_cfg_scale)
if args.compile:
    compile_repeated_blocks(pipe, backend=args.compile)
    warmup(pipe, sizes=[(height, width)], **call)  # every bucket, KV-cache prefill and cached steps

# With --tp below the world size, each TP group makes its own image from its own seed.
group, groups = mesh["dp"].get_local_rank(), mesh["dp"].size()
out = args.out if groups == 1 else args.out.with_stem(f"{args.out.stem}-{group}")
if nd.is_main_process():
    print(f"Qwen-Image-2.1 {args.model}: tp={mesh['tp'].size()} dp={groups} {height}x{width} {steps} steps {dtype}",
          flush=True)
start = time.perf_counter()
images = pipe.generate([args.prompt], seed=args.seed + group, height=height, width=width,
                       num_inference_steps=steps, **call)
if images is not None:  # the TP group's leader decodes and saves
    save_png(images[0], out, text={"prompt": args.prompt, "negative_prompt": args.negative_prompt or "",
                                   "seed": str(args.seed + group), "model": args.model})
    if nd.is_main_process():
        print(f"wrote {out} in {time.perf_counter() - start:.1f} s", flush=True)
dist.barrier()
dist.destroy_process_group()
