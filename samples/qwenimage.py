"""Qwen-Image text-to-image with true classifier-free guidance, tensor-parallel over the ranks torchrun launched.

Offline, on a tiny random Qwen-Image built on first use (CPU ranks over gloo; plain `python` works too):

    torchrun --nproc_per_node=2 samples/qwenimage.py --out qwenimage.png
    torchrun --nproc_per_node=2 samples/qwenimage.py --cfg-parallel --out qwenimage.png  # cond, uncond at once

The real model, unchanged script: download Qwen/Qwen-Image and pass the folder. Without --height, --width and
--steps a real checkpoint runs Qwen's recommended 1328x1328, 50 steps, true_cfg_scale 4 with a negative prompt, in
bfloat16 on an accelerator. TP=8 keeps 4.8 GiB of transformer per rank (24 heads: TP 1, 2, 3, 4, 6, 8, 12 or 24);
the Qwen2.5-VL text encoder runs on the leader's CPU, and prompts are padded to length buckets (64 ... 1024 tokens)
so a compiled model never recompiles for a new prompt length:

    hf download Qwen/Qwen-Image --local-dir /models/Qwen-Image
    torchrun --nproc_per_node=8 samples/qwenimage.py --model /models/Qwen-Image --compile --out qwenimage.png
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
parser.add_argument("--model", default="qwenimage", help="checkpoint folder (default: qwenimage, the tiny Qwen-Image)")
parser.add_argument("--prompt", default='A coffee shop entrance with a chalkboard sign reading "Qwen Coffee 2 dollars"')
parser.add_argument("--negative-prompt", default=" ", help="what to steer away from (Qwen's examples use ' ')")
parser.add_argument("--true-cfg-scale", type=float, default=4.0, help="> 1 runs true CFG: two passes per step")
parser.add_argument("--tp", type=int, default=None,
                    help="tensor-parallel degree (default: every rank; with --cfg-parallel half of them)")
parser.add_argument("--cfg-parallel", action="store_true",
                    help="compute the cond and uncond passes of each step on two TP groups at once (2 x tp ranks)")
parser.add_argument("--height", type=int)
parser.add_argument("--width", type=int)
parser.add_argument("--steps", type=int)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--compile", nargs="?", const="auto", metavar="BACKEND", help="compile the repeated blocks")
parser.add_argument("--out", type=Path, default=Path("qwenimage.png"))
args = parser.parse_args()

tiny_model = args.model == "qwenimage"
height, width = tiny.default_size("qwenimage") if tiny_model else (1328, 1328)
height, width, steps = args.height or height, args.width or width, args.steps or (4 if tiny_model else 50)
dtype = torch.float32 if detect_runtime().device_type == "cpu" else torch.bfloat16

# torchrun env -> neuron > cuda > cpu; a ("dp", "tp") mesh, or ("dp", "cfg", "tp") with --cfg-parallel
mesh = nd.init_distributed(tp=args.tp, cfg=2 if args.cfg_parallel else 1)
pipe = nd.load_pipeline(args.model, mesh=mesh, torch_dtype=dtype)  # text encoder: leader only, on CPU
call = dict(negative_prompt=args.negative_prompt, true_cfg_scale=args.true_cfg_scale)
if args.compile:
    compile_repeated_blocks(pipe, backend=args.compile)
    warmup(pipe, sizes=[(height, width)], **call)  # every length bucket, so no prompt compiles anything later

# With more ranks than one replica (a TP group, or with --cfg-parallel a pair of them) each replica makes its own
# image from its own seed.
group, groups = mesh["dp"].get_local_rank(), mesh["dp"].size()
out = args.out if groups == 1 else args.out.with_stem(f"{args.out.stem}-{group}")
if nd.is_main_process():
    print(f"Qwen-Image {args.model}: tp={mesh['tp'].size()} cfg={2 if args.cfg_parallel else 1} dp={groups} "
          f"{height}x{width} {steps} steps {dtype}",
          flush=True)
start = time.perf_counter()
images = pipe.generate([args.prompt], seed=args.seed + group, height=height, width=width,
                       num_inference_steps=steps, **call)
if images is not None:  # the replica's leader decodes and saves
    save_png(images[0], out, text={"prompt": args.prompt, "negative_prompt": args.negative_prompt,
                                   "seed": str(args.seed + group), "model": args.model})
    if nd.is_main_process():
        print(f"wrote {out} in {time.perf_counter() - start:.1f} s", flush=True)
dist.barrier()
dist.destroy_process_group()
