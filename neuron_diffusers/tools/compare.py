"""`neuron-diffusers compare A B`: PSNR and SSIM of two images, or of the same-named images of two output folders.

Tiny random models say nothing about what a step cache does to image quality, so users measure on their own
checkpoint: generate the same prompts once without the cache and once with it, then compare the two folders. The
metrics are scikit-image's (an optional extra: `pip install 'neuron-diffusers[quality]'`), called the way
cache-dit's metrics command calls them (uint8 RGB, PSNR over 0..255, SSIM with its default 7x7 window per channel),
so the figures read against cache-dit's published tables for the same algorithms. Images only (PNG, JPEG, WebP):
MiniMax-H3's videos are not compared.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def _metrics():
    try:
        # Optional: scikit-image and its dependencies are ~200 MB, needed by this command only.
        from skimage.metrics import peak_signal_noise_ratio, structural_similarity
    except ImportError:
        raise ImportError(
            "`neuron-diffusers compare` needs scikit-image for PSNR and SSIM: pip install 'neuron-diffusers[quality]' "
            "(or pip install scikit-image)."
        ) from None
    return peak_signal_noise_ratio, structural_similarity


def _rgb(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def compare_images(reference: Path, candidate: Path) -> dict[str, float]:
    """PSNR (dB; `inf` when identical) and SSIM (1 when identical) of `candidate` against `reference`."""
    psnr, ssim = _metrics()
    a, b = _rgb(reference), _rgb(candidate)
    if a.shape != b.shape:
        raise ValueError(f"Cannot compare {reference} ({a.shape[1]}x{a.shape[0]}) with {candidate} "
                         f"({b.shape[1]}x{b.shape[0]}): generate both at the same height and width.")
    identical = bool((a == b).all())  # PSNR is infinite: say so without scikit-image's divide-by-zero warning
    return {"psnr": float("inf") if identical else float(psnr(a, b, data_range=255)),
            "ssim": float(ssim(a, b, channel_axis=2, data_range=255))}


def compare_paths(reference: Path, candidate: Path) -> dict:
    """Two images, or two folders: every image name present in both, and the means (identical pairs left out of the
    PSNR mean, where they are infinite)."""
    if reference.is_file() and candidate.is_file():
        return {"pairs": {candidate.name: compare_images(reference, candidate)}}
    if not (reference.is_dir() and candidate.is_dir()):
        raise ValueError(f"Compare two image files or two folders of images: got {reference} and {candidate}.")
    names = sorted(p.name for p in reference.iterdir()
                   if p.suffix.lower() in IMAGE_SUFFIXES and (candidate / p.name).is_file())
    if not names:
        raise ValueError(f"{reference} and {candidate} share no image file name: compare the outputs of two runs of "
                         "the same prompts (`generate` names files by index and prompt).")
    pairs = {name: compare_images(reference / name, candidate / name) for name in names}
    finite = [m["psnr"] for m in pairs.values() if m["psnr"] != float("inf")]
    return {"pairs": pairs, "mean": {"psnr": sum(finite) / len(finite) if finite else float("inf"),
                                     "ssim": sum(m["ssim"] for m in pairs.values()) / len(pairs)}}


def format_table(result: dict) -> str:
    rows = ["| image | PSNR (dB) | SSIM |", "|---|---:|---:|"]
    for name, metric in {**result["pairs"], **({"mean": result["mean"]} if "mean" in result else {})}.items():
        rows.append(f"| {name} | {metric['psnr']:.2f} | {metric['ssim']:.4f} |")
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", type=Path, help="image (or folder of images) made without the cache")
    parser.add_argument("candidate", type=Path, help="image (or folder) made with it, same names")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args) -> None:
    try:
        result = compare_paths(args.reference, args.candidate)
    except ImportError as error:  # a missing optional extra is the user's to install: one line, exit status 2
        raise ValueError(str(error)) from None
    print(json.dumps(result, indent=2) if args.json else format_table(result))
