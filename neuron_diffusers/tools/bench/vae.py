"""`bench vae`: per-rank peak memory and seconds of one VAE decode, one rank vs N ranks, side by side in one run.

The images are decoded by FLUX.1's VAE structure (AutoencoderKL: 4 levels, 2 resnets per level, 16 latent channels,
no quant convs), the videos by MiniMax-H3's (a 6-level encoder and a 36-layer ViT decoder, decoding clip by clip),
both with random weights. By default both run at 1/8 of their channels (FLUX.1: 16, 32, 64, 64 instead of 128, 256,
512, 512; H3: 4 decoder heads of 64 instead of 32): a CPU decode of the real widths at 2048 px takes many minutes.
Activations scale with the channels at every level alike, so the ratio of per-rank memory between one rank and N is
the full model's; seconds are not (`--full-channels` measures the real widths).

Each case runs the stock decode on rank 0 alone (the others wait), then the parallel decode (`parallel/vae.py`) on
all N ranks, `--repeats` times each. Memory is each process's peak resident set while the decode runs, above what it
held just before (weights, latent): Linux's VmHWM, reset through /proc/self/clear_refs before each decode. It counts
everything the decode touches (activations, collective buffers, the assembled image), is what an out-of-memory kill
sees, and needs no instrumentation. glibc keeps freed heap pages resident, which would hide a later decode's
allocations under an earlier high-water mark, so the ranks run with MALLOC_MMAP_THRESHOLD_ fixed low: every buffer of
64 KiB or more is its own mapping, returned when freed. Seconds are wall time and this process's CPU time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import AutoencoderKL, AutoencoderKLMiniMaxH3

from ...parallel.vae import enable_parallel_vae
from ..spawn import run_on_cpu_ranks
from . import plot
from .rss import process_rss_mib

FLUX1_CHANNELS = (128, 256, 512, 512)
H3_CHANNELS = (128, 256, 256, 512, 512, 1024)
H3_DECODER_HEADS = 32
EIGHTH = 8  # the default width divisor
H3_SIZE = 256  # one spatial tile per clip (stock tiles at 256 px), so the clips are what the ranks share


def flux_vae(divisor: int, seed: int = 0) -> AutoencoderKL:
    """FLUX.1's VAE structure at 1/`divisor` of its channels, random weights."""
    channels = tuple(c // divisor for c in FLUX1_CHANNELS)
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
        norm_num_groups=math.gcd(32, channels[0]),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=channels, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()


def h3_vae(divisor: int, seed: int = 0) -> AutoencoderKLMiniMaxH3:
    """MiniMax-H3's video VAE structure (36 decoder layers, head size 64) at 1/`divisor` of its widths."""
    channels = tuple(c // divisor for c in H3_CHANNELS)
    torch.manual_seed(seed)
    return AutoencoderKLMiniMaxH3(block_out_channels=channels, norm_num_groups=math.gcd(32, channels[0]),
                                  decoder_num_attention_heads=H3_DECODER_HEADS // divisor).eval()


def h3_latent_frames(frames: int, vae: AutoencoderKLMiniMaxH3) -> int:
    """The latent frames the pipeline generates for `frames` video frames (`17 * n + 5`: encode's clips, less the
    dropped tail)."""
    clip, ratio = vae.config.clip_length, vae.temporal_compression_ratio
    if (frames - 5) % clip:
        raise ValueError(f"--h3-frames {frames}: MiniMax-H3 decodes 17 * n + 5 frames (22, 39, 56, 73, ..., 124).")
    return math.ceil(frames / clip) * math.ceil(clip / ratio) - vae.config.token_drop


def _measured(decode) -> dict:
    """Peak MiB above the start, wall seconds and CPU seconds of this process, of `decode()`."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = process_rss_mib()["now"]
    start, cpu_start = time.perf_counter(), time.process_time()
    decode()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {"peak_mib": process_rss_mib()["peak"] - before, "s": seconds, "cpu_s": cpu_seconds}


def _cases(sizes, h3_frames: int, divisor: int):
    """(name, label, build the VAE, the latent) per case."""
    for size in sizes:
        yield (f"FLUX.1 VAE, {size} px", f"{size} px", lambda: flux_vae(divisor),
               lambda size=size: torch.randn(1, 16, size // 8, size // 8, generator=torch.Generator().manual_seed(0)))
    if h3_frames:
        def latent():
            vae = h3_vae(divisor)
            shape = (1, vae.config.latent_channels, h3_latent_frames(h3_frames, vae), H3_SIZE // 16, H3_SIZE // 16)
            return torch.randn(shape, generator=torch.Generator().manual_seed(0))

        yield (f"MiniMax-H3 VAE, {h3_frames} frames at {H3_SIZE} px", f"H3 {h3_frames} fr", lambda: h3_vae(divisor),
               latent)


def _one_case(vae, latent: torch.Tensor, repeats: int) -> tuple[list, list]:
    """The stock decode on rank 0 alone (the others wait), then the parallel decode on every rank."""
    one = [_measured(lambda: vae.decode(latent)) for _ in range(repeats)] if dist.get_rank() == 0 else []
    dist.barrier()
    with enable_parallel_vae(vae):
        vae.decode(latent[..., :2, :2] if latent.ndim == 5 else latent[..., :16, :16])  # first-call costs
        dist.barrier()
        parallel = [_measured(lambda: vae.decode(latent)) for _ in range(repeats)]
    dist.barrier()
    return one, parallel


def _rank_bench(sizes, h3_frames: int, divisor: int, repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    with torch.no_grad():
        for name, label, build, make_latent in _cases(sizes, h3_frames, divisor):
            one, parallel = _one_case(build(), make_latent(), repeats)
            rows.append({"case": name, "label": label, "one_rank": one, "parallel": parallel})
    return rows


def _spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def measure(sizes=(512, 1024, 2048), ranks: int = 2, full_channels: bool = False, h3_frames: int = 73,
            repeats: int = 1) -> dict:
    """Every case on `ranks` spawned CPU ranks (one thread each), one rank vs all of them; per-rank figures."""
    if ranks < 2:
        raise ValueError(f"--ranks {ranks}: comparing one rank with N needs N >= 2.")
    divisor = 1 if full_channels else EIGHTH
    load_before = os.getloadavg()[0]
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # inherited by the spawned ranks
    try:
        per_rank = run_on_cpu_ranks(_rank_bench, ranks, list(sizes), h3_frames, divisor, repeats, timeout_s=7200)
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    cases = []
    for i, row in enumerate(per_rank[0]):
        one = row["one_rank"]
        parallel = [rank_rows[i]["parallel"] for rank_rows in per_rank]  # [rank][repeat]
        # Per repeat, the group is as slow as its slowest rank; memory: each rank's highest mark.
        wall = [max(rank_runs[k]["s"] for rank_runs in parallel) for k in range(repeats)]
        per_rank_peak = [max(run["peak_mib"] for run in rank_runs) for rank_runs in parallel]
        one_peak = max(run["peak_mib"] for run in one)
        cases.append({
            "case": row["case"], "label": row["label"],
            "one_rank": {"peak_mib": round(one_peak, 1), "s": _spread([run["s"] for run in one]),
                         "cpu_s": _spread([run["cpu_s"] for run in one])},
            "n_ranks": {"peak_mib_per_rank": [round(peak, 1) for peak in per_rank_peak], "s": _spread(wall),
                        "cpu_s_per_rank": [_spread([run["cpu_s"] for run in rank_runs]) for rank_runs in parallel]},
            "peak_ratio": round(max(per_rank_peak) / one_peak, 3),
            "cpu_ratio": round(max(statistics.median(run["cpu_s"] for run in rank_runs) for rank_runs in parallel)
                               / statistics.median(run["cpu_s"] for run in one), 3),
        })
    # Wall seconds mean little on a loaded machine (a descheduled rank stalls its peers at every exchange): say so.
    return {"ranks": ranks, "threads_per_rank": 1, "repeats": repeats, "cpus": os.cpu_count(),
            "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
            "channels": "full" if full_channels else f"1/{EIGHTH}", "cases": cases}


def format_table(result: dict) -> str:
    n = result["ranks"]
    lines = [f"VAE decode at {result['channels']} channels, one rank vs {n} CPU ranks (1 thread each), "
             f"median of {result['repeats']} (min-max); {result['cpus']} CPUs, load average "
             f"{result['load_average'][0]} at the start, {result['load_average'][1]} at the end",
             f"| case | 1 rank: peak MiB | s | CPU s | {n} ranks: peak MiB per rank | s | CPU s per rank | peak ratio "
             "| CPU ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def spread(figure: dict) -> str:
        return f"{figure['median']:.1f}" + ("" if figure["min"] == figure["max"] else
                                            f" ({figure['min']:.1f}-{figure['max']:.1f})")

    for case in result["cases"]:
        one, many = case["one_rank"], case["n_ranks"]
        lines.append(
            f"| {case['case']} | {one['peak_mib']:.0f} | {spread(one['s'])} | {spread(one['cpu_s'])} | "
            f"{' / '.join(f'{mib:.0f}' for mib in many['peak_mib_per_rank'])} | {spread(many['s'])} | "
            f"{' / '.join(spread(cpu) for cpu in many['cpu_s_per_rank'])} | {case['peak_ratio']:.2f} | "
            f"{case['cpu_ratio']:.2f} |")
    return "\n".join(lines)


def chart(result: dict, path: Path) -> None:
    """Per-rank peak memory and CPU seconds, one rank vs N, per case: images and videos in panels of their own
    (their scales differ by orders of magnitude)."""
    panels = []
    for kind, cases in (("images", [c for c in result["cases"] if not c["label"].startswith("H3")]),
                        ("H3 video", [c for c in result["cases"] if c["label"].startswith("H3")])):
        if not cases:
            continue
        panels += [
            {"title": f"{kind}: peak memory per rank", "unit": "MiB above the weights",
             "groups": [(c["label"], (c["one_rank"]["peak_mib"], max(c["n_ranks"]["peak_mib_per_rank"])))
                        for c in cases]},
            {"title": f"{kind}: CPU time per rank", "unit": "seconds (median)",
             "groups": [(c["label"], (c["one_rank"]["cpu_s"]["median"],
                                      max(cpu["median"] for cpu in c["n_ranks"]["cpu_s_per_rank"]))) for c in cases]},
        ]
    plot.paired_bars(panels, ("one rank", f"{result['ranks']} ranks, parallel VAE"),
                     f"VAE decode, {result['channels']} channels: one rank vs {result['ranks']}", path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048],
                        help="image sizes (height = width) for FLUX.1's VAE")
    parser.add_argument("--h3-frames", type=int, default=73,
                        help=f"MiniMax-H3 video frames at {H3_SIZE} px (17 * n + 5; 73: 4 clips); 0 skips H3")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="decodes per case and mode (median and spread)")
    parser.add_argument("--full-channels", action="store_true",
                        help="the real channel counts instead of 1/8 (slow on CPU at 2048 px)")
    parser.add_argument("--chart", type=Path, default=None, help="write the chart (PNG) here")
    parser.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> None:
    result = measure(args.sizes, args.ranks, args.full_channels, args.h3_frames, args.repeats)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    if args.chart:
        chart(result, args.chart)
