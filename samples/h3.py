"""MiniMax-H3 text-to-video with stereo audio, tensor-parallel over the ranks torchrun launched (or one `python`).

Offline, on a tiny random MiniMax-H3 built on first use (CPU ranks over gloo); writes h3.mp4 (H.264 + AAC) and
h3.wav (the soundtrack, untouched):

    torchrun --nproc_per_node=2 samples/h3.py --out h3.mp4

The real model, unchanged script: download MiniMaxAI/MiniMax-H3 (the folder with `modular_model_index.json`) and
pass it. Without --height, --width, --num-frames and --steps a real checkpoint runs the trained 768x1344 canvas,
124 frames (5 s at 24 fps; up to 362 = 15 s) and 50 steps, in bfloat16 on an accelerator. H3 is guidance-distilled:
no negative prompt, one forward per step. TP=8 keeps 7.7 GiB of its 61.7 GiB transformer per rank (56 heads: TP 1,
2, 4, 7, 8, 14, 28 or 56); the 62 GiB Qwen3-VL conditioner runs once per prompt on the leader's CPU:

    hf download MiniMaxAI/MiniMax-H3 --local-dir /models/MiniMax-H3
    torchrun --nproc_per_node=8 samples/h3.py --model /models/MiniMax-H3 --compile --out h3.mp4
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
from neuron_diffusers.tiny.h3 import DEFAULT_NUM_FRAMES

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="h3", help="checkpoint folder (default: h3, the tiny MiniMax-H3)")
parser.add_argument("--prompt", default="A red fox trotting through a snowy pine forest, snow crunching underfoot")
parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: every rank)")
parser.add_argument("--height", type=int, help="a multiple of 32")
parser.add_argument("--width", type=int, help="a multiple of 32")
parser.add_argument("--num-frames", type=int, help="at 24 fps, 5 to 15 s, snapped up to 17n + 5")
parser.add_argument("--steps", type=int, help="counts the final sigma: N steps run N - 1 forwards (N >= 2)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--compile", nargs="?", const="auto", metavar="BACKEND", help="compile the repeated blocks")
parser.add_argument("--out", type=Path, default=Path("h3.mp4"), help=".mp4; the audio also goes to the .wav beside it")
args = parser.parse_args()

tiny_model = args.model == "h3"
height, width = tiny.default_size("h3") if tiny_model else (768, 1344)
height, width, steps = args.height or height, args.width or width, args.steps or (3 if tiny_model else 50)
num_frames = args.num_frames or (DEFAULT_NUM_FRAMES if tiny_model else 124)
dtype = torch.float32 if detect_runtime().device_type == "cpu" else torch.bfloat16

mesh = nd.init_distributed(tp=args.tp)  # torchrun env -> neuron > cuda > cpu; a ("dp", "tp") mesh
pipe = nd.load_pipeline(args.model, mesh=mesh, torch_dtype=dtype)  # transformer sharded; Qwen3-VL on CPU, leader only
call = dict(num_frames=num_frames)
if args.compile:
    compile_repeated_blocks(pipe, backend=args.compile)
    # Three steps: the first forward carries two noise levels, the later ones one; each is its own graph.
    warmup(pipe, sizes=[(height, width)], num_inference_steps=3, **call)

# With --tp below the world size, each TP group makes its own clip from its own seed.
group, groups = mesh["dp"].get_local_rank(), mesh["dp"].size()
out = args.out if groups == 1 else args.out.with_stem(f"{args.out.stem}-{group}")
if nd.is_main_process():
    print(f"MiniMax-H3 {args.model}: tp={mesh['tp'].size()} dp={groups} {height}x{width} {num_frames} frames "
          f"{steps} steps {dtype}", flush=True)
start = time.perf_counter()
videos = pipe.generate([args.prompt], seed=args.seed + group, height=height, width=width,
                       num_inference_steps=steps, **call)
if videos is not None:  # the TP group's leader decodes and saves: frames + stereo audio
    written = save_video(videos[0], out)
    if nd.is_main_process():
        print(f"wrote {', '.join(map(str, written))} in {time.perf_counter() - start:.1f} s", flush=True)
dist.barrier()
dist.destroy_process_group()
