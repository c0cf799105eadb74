"""FLUX.1 text-to-image, tensor-parallel over the ranks torchrun launched (or one plain `python` process).

Offline, on a tiny random FLUX.1 built on first use (CPU ranks over gloo):

    torchrun --nproc_per_node=2 samples/flux.py --out flux.png

The real model, unchanged script: download black-forest-labs/FLUX.1-dev and pass the folder. Without --height,
--width and --steps a real checkpoint runs FLUX.1-dev's recommended 1024x1024, 28 steps, guidance 3.5, in bfloat16
on an accelerator. TP=8 keeps 2.8 GiB of transformer per rank (24 heads: TP 1, 2, 3, 4, 6, 8, 12 or 24):

    hf download black-forest-labs/FLUX.1-dev --local-dir /models/FLUX.1-dev
    torchrun --nproc_per_node=8 samples/flux.py --model /models/FLUX.1-dev --compile --out flux.png
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
parser.add_argument("--model", default="flux", help="checkpoint folder (default: flux, the tiny FLUX.1)")
parser.add_argument("--prompt", default="A cat holding a sign that says hello world")
parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: every rank)")
parser.add_argument("--height", type=int)
parser.add_argument("--width", type=int)
parser.add_argument("--steps", type=int)
parser.add_argument("--guidance-scale", type=float, default=3.5)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--compile", nargs="?", const="auto", metavar="BACKEND", help="compile the repeated blocks")
parser.add_argument("--out", type=Path, default=Path("flux.png"))
args = parser.parse_args()

tiny_model = args.model == "flux"
height, width = tiny.default_size("flux") if tiny_model else (1024, 1024)
height, width, steps = args.height or height, args.width or width, args.steps or (4 if tiny_model else 28)
dtype = torch.float32 if detect_runtime().device_type == "cpu" else torch.bfloat16

mesh = nd.init_distributed(tp=args.tp)  # torchrun env -> neuron > cuda > cpu; a ("dp", "tp") mesh
pipe = nd.load_pipeline(args.model, mesh=mesh, torch_dtype=dtype)  # transformer sharded; T5 + CLIP on CPU, leader only
call = dict(guidance_scale=args.guidance_scale)
if args.compile:
    compile_repeated_blocks(pipe, backend=args.compile)
    warmup(pipe, sizes=[(height, width)], **call)

# With --tp below the world size, each TP group makes its own image from its own seed.
group, groups = mesh["dp"].get_local_rank(), mesh["dp"].size()
out = args.out if groups == 1 else args.out.with_stem(f"{args.out.stem}-{group}")
if nd.is_main_process():
    print(f"FLUX.1 {args.model}: tp={mesh['tp'].size()} dp={groups} {height}x{width} {steps} steps {dtype}", flush=True)
start = time.perf_counter()
images = pipe.generate([args.prompt], seed=args.seed + group, height=height, width=width,
                       num_inference_steps=steps, **call)
if images is not None:  # the TP group's leader decodes and saves
    save_png(images[0], out, text={"prompt": args.prompt, "seed": str(args.seed + group), "model": args.model})
    if nd.is_main_process():
        print(f"wrote {out} in {time.perf_counter() - start:.1f} s", flush=True)
dist.barrier()
dist.destroy_process_group()
