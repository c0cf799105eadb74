"""Wan 2.1 text-to-video, tensor-parallel over the ranks torchrun launched (or one `python`).

Offline, on a tiny random Wan 2.1 built on first use (CPU ranks over gloo); writes wan.mp4 (H.264, 16 fps):

    torchrun --nproc_per_node=2 samples/wan.py --out wan.mp4

The real model, unchanged script: download Wan-AI/Wan2.1-T2V-14B-Diffusers and pass it. Without --height, --width,
--num-frames and --steps a real checkpoint runs 1280x720, 81 frames (5 s at 16 fps) and 50 steps, guidance 5.0
(two forwards per step), in bfloat16 on an accelerator. TP=8 keeps 3.33 GiB of its 26.6 GiB transformer per rank
(1.001 x total / 8; TP 1, 2, 4 or 8); the UMT5-XXL text encoder runs once per prompt on the leader's CPU, and the
VAE decodes on the leader:

    hf download Wan-AI/Wan2.1-T2V-14B-Diffusers --local-dir /models/Wan2.1-T2V-14B
    torchrun --nproc_per_node=8 samples/wan.py --model /models/Wan2.1-T2V-14B --compile --out wan.mp4
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
from neuron_diffusers.media import save_video
from neuron_diffusers.tiny.wan import DEFAULT_NUM_FRAMES

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="wan", help="checkpoint folder (default: wan, the tiny Wan 2.1)")
parser.add_argument("--prompt", default="A red fox trotting through a snowy pine forest, cinematic, golden hour")
parser.add_argument("--negative-prompt", default=None, help="what to steer away from (default: the empty prompt)")
parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: every rank)")
parser.add_argument("--height", type=int, help="a multiple of 16")
parser.add_argument("--width", type=int, help="a multiple of 16")
parser.add_argument("--num-frames", type=int, help="4n + 1 frames at 16 fps (default 81: 5 s)")
parser.add_argument("--steps", type=int)
parser.add_argument("--guidance", type=float, default=5.0, help="guidance_scale (above 1: two forwards per step)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--compile", nargs="?", const="auto", metavar="BACKEND", help="compile the repeated blocks")
parser.add_argument("--out", type=Path, default=Path("wan.mp4"), help=".mp4")
args = parser.parse_args()

tiny_model = args.model == "wan"
height, width = tiny.default_size("wan") if tiny_model else (720, 1280)
height, width, steps = args.height or height, args.width or width, args.steps or (2 if tiny_model else 50)
call = dict(num_frames=args.num_frames or DEFAULT_NUM_FRAMES, guidance_scale=args.guidance)
dtype = torch.float32 if detect_runtime().device_type == "cpu" else torch.bfloat16

mesh = nd.init_distributed(tp=args.tp)  # torchrun env -> neuron > cuda > cpu; a ("dp", "tp") mesh
pipe = nd.load_pipeline(args.model, mesh=mesh, torch_dtype=dtype)  # transformer sharded; UMT5 on CPU, leader only
if args.compile:
    compile_repeated_blocks(pipe, backend=args.compile)
    warmup(pipe, sizes=[(height, width)], num_inference_steps=2, **call)

# With --tp below the world size, each TP group makes its own clip from its own seed.
group, groups = mesh["dp"].get_local_rank(), mesh["dp"].size()
out = args.out if groups == 1 else args.out.with_stem(f"{args.out.stem}-{group}")
if nd.is_main_process():
    print(f"Wan 2.1 {args.model}: tp={mesh['tp'].size()} dp={groups} {height}x{width} {call['num_frames']} frames "
          f"{steps} steps {dtype}", flush=True)
start = time.perf_counter()
videos = pipe.generate([args.prompt], seed=args.seed + group, negative_prompt=args.negative_prompt, height=height,
                       width=width, num_inference_steps=steps, **call)
if videos is not None:  # the TP group's leader decodes and saves
    written = save_video(videos[0], out)
    if nd.is_main_process():
        print(f"wrote {', '.join(map(str, written))} in {time.perf_counter() - start:.1f} s", flush=True)
dist.barrier()
dist.destroy_process_group()
