"""`neuron-diffusers bench step`: one transformer forward at the real width and token count, our plans vs stock TP vs
one process, beside the ideal (one process / N).

`bench collectives` runs tiny widths, where a forward is a few milliseconds and the latency of each collective
decides; a real model's step is compute-bound, and that is the regime a plan must not lose in. So each family's
transformer is built from its full-size default config (hidden size, heads, MLP and text widths as released) with
`--blocks` blocks of each kind, random weights, and called the way its pipeline calls it at 1024 x 1024 (4096 image
tokens) with a 512-token text: the call is captured from the family's tiny pipeline at that size (its VAE and patch
factors are the released ones) and its inputs widened to the full-size model's (`widen`).

The random weights are saved once into a temporary checkpoint, so every rank loads the way `load_pipeline` does:
our plans and diffusers' own stream each rank's slice (`from_pretrained(parallel_config=...)`), and "one process" is
the whole model on rank 0 alone while the other ranks wait (one copy: FLUX.2's is about 9 GiB of float32). Each rank
runs one thread (as `torchrun` sets it), so one process gets one core, as each TP rank does. After one warm-up
forward of each, the variants run in alternation, `--repeats` times (every other round in reverse order), and the
median is reported: load from other processes hits all of them alike. Ours / stock is the median of each round's
ratio, with its range: a round's two forwards run back to back, so the ratio cancels the machine's drift between
rounds (measured here: whole rounds 10% slower than others). Where the TP copies and a whole one would not fit in
memory together (FLUX.2's 9 GiB copies on a 24 GiB host), the whole one is loaded after the TP copies are freed and
timed alone, marked "(after)" in the table and `one_process_after` in the JSON. Output of each TP variant is
compared with the one-process output (max abs difference). `--control` adds stock's plan loaded a second time: the
same work twice, so its ratio to stock is the machine's noise, in the same run as ours. What it prints is measured.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import TensorParallelConfig

from ... import families, tiny
from ...checkpoint import resolve
from ...cli import positive_int
from ...compat.plans import stock_plan, using_plan
from ...distributed import init_distributed
from ...parallel.quantize import Quantization
from ..plan.cases import capture_first_call, predictions
from ..plan.meta import meta_transformer
from ..spawn import run_on_cpu_ranks
from . import plot, record
from .collectives import DEPTH_FIELDS, forward_call
from .rss import available_bytes

#: The image families (MiniMax-H3 makes video + audio: a 1024 x 1024 image step is not its shape).
FAMILIES = ("flux", "flux2", "qwenimage", "qwenimage21")
#: The label of `--control`: stock's plan loaded a second time, an A/A comparison.
CONTROL = "stock again"
#: What a quantized row's time means here (printed under the table, stored with it).
QUANTIZED_NOTE = ("Quantized rows: on CPU their times say little about an accelerator. fp8 runs one `torch._scaled_mm` "
                  "per block of input columns (CPU refuses block-wise scales), int8 dequantizes each weight at each "
                  "call: both are correctness paths here, not fast ones (docs/quantization.md).")
#: Pixels per image token along each side in all four families: the VAE's 8 x 8, then 2 x 2 patches.
PIXELS_PER_TOKEN = 16
#: Forward inputs whose last dimension is a width of the model, and the config fields that set it (first present).
INPUT_WIDTHS = {
    "hidden_states": ("in_channels",),
    "encoder_hidden_states": ("joint_attention_dim", "context_in_dim"),
    "pooled_projections": ("pooled_projection_dim",),
}


def _public(config) -> dict:
    return {key: value for key, value in config.items() if not key.startswith("_")}


def bench_config(family: str, blocks: int, width: str) -> dict:
    """`family`'s transformer config at `width` ("full": the class's default config, the released widths; "tiny": the
    tiny checkpoint's) with `blocks` blocks of each kind.

    The tiny checkpoint's switches (booleans such as `guidance_embeds`) win at either width: the captured call feeds
    what its pipeline feeds (FLUX.1-dev's guidance; the class default is schnell's, without a guidance embedder)."""
    tiny_config = _public(families.get(family).model_class().load_config(tiny.cached_tiny(family),
                                                                          subfolder="transformer"))
    config = _public(meta_transformer(family).module.config) if width == "full" else tiny_config
    switches = {key: value for key, value in tiny_config.items() if isinstance(value, bool)}
    return {**config, **switches, **{field: blocks for field in DEPTH_FIELDS if field in config}}


def widen(kwargs: dict, config: dict, seed: int = 0) -> dict:
    """The captured call's inputs with every model-width input (`INPUT_WIDTHS`) redrawn at `config`'s width
    (standard normal, seeded); lengths, masks, ids and timesteps stay as the pipeline made them."""
    generator = torch.Generator().manual_seed(seed)
    widened = dict(kwargs)
    for name, fields in INPUT_WIDTHS.items():
        value = kwargs.get(name)
        width = next((config[field] for field in fields if field in config), None)
        if isinstance(value, torch.Tensor) and width is not None:
            widened[name] = torch.randn(*value.shape[:-1], width, generator=generator, dtype=value.dtype)
    return widened


def capture_call(family: str, tokens: int, text: int) -> tuple[tuple, dict]:
    """The transformer's first call in `family`'s tiny stock pipeline for a square image of `tokens` image tokens
    and a prompt of `text` tokens (a second run corrects the word count where the tokenizer adds tokens)."""
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"--tokens {tokens} is not a square number: image tokens are side x side latent patches "
                         f"(4096 = 64 x 64 is 1024 x 1024 pixels). Try {side * side} or {(side + 1) ** 2}.")
    resolved = resolve(tiny.cached_tiny(family))
    pipe = resolved.adapter.load_stock(resolved)
    pipe.set_progress_bar_config(disable=True)
    takes_length = "max_sequence_length" in inspect.signature(pipe.__call__).parameters

    def run(words: int) -> tuple[tuple, dict]:
        call = {"prompt": " ".join(["fox"] * words), "height": side * PIXELS_PER_TOKEN,
                "width": side * PIXELS_PER_TOKEN, "num_inference_steps": 2, "output_type": "latent",
                "generator": torch.Generator().manual_seed(0)}
        if takes_length:
            call["max_sequence_length"] = text
        return capture_first_call(pipe, call)

    args, kwargs = run(text)
    measured = kwargs["encoder_hidden_states"].shape[1]
    if measured != text and text + text - measured > 0:
        args, kwargs = run(text + text - measured)
    return args, kwargs


def _alternate(models: dict, args: tuple, kwargs: dict, repeats: int, seconds: dict, outputs: dict) -> None:
    """One warm-up forward of each model (lazy buffers, allocator), then `repeats` rounds of one forward each, every
    other round in reverse order (A B, B A, ...): no variant always runs right after the same one, or first."""
    with torch.no_grad():
        for label, model in models.items():
            dist.barrier()
            if model is not None:
                outputs[label] = predictions(forward_call(model, args, kwargs))
        for round_ in range(repeats):
            for label, model in list(models.items())[::-1 if round_ % 2 else 1]:
                dist.barrier()  # every rank starts each forward together (the others wait out one process's)
                if model is not None:
                    start = time.perf_counter()
                    forward_call(model, args, kwargs)
                    seconds.setdefault(label, []).append(time.perf_counter() - start)
        dist.barrier()


def _load_variants(cls, folder: str, plans: dict, mesh, quantize) -> dict:
    """Each plan's TP model, and with `quantize` our default plan quantized through `from_pretrained`."""
    models = {}
    for label, plan in plans.items():
        with using_plan(cls, plan):
            models[label] = cls.from_pretrained(folder, subfolder="transformer",
                                                parallel_config=TensorParallelConfig(mesh=mesh)).eval()
    if quantize is not None:
        with using_plan(cls, plans["default"]):
            models[f"default {quantize}"] = cls.from_pretrained(
                folder, subfolder="transformer", quantization_config=str(quantize),
                parallel_config=TensorParallelConfig(mesh=mesh)).eval()
    return models


def _rank_job(family: str, folder: str, args: tuple, kwargs: dict, repeats: int, one_process_after: bool,
              control: bool, quantize=None) -> dict:
    torch.set_num_threads(1)  # as torchrun does: the ranks share the host's cores
    tp = dist.get_world_size()
    mesh = init_distributed(tp=tp)["tp"]
    record = families.get(family)
    cls = record.model_class()
    plans = {**record.plan_variants, "stock": stock_plan(cls)}
    if control:  # stock's plan loaded twice: its ratio to stock is this machine's noise, measured in the same run
        plans[CONTROL] = plans["stock"]
    models = _load_variants(cls, folder, plans, mesh, quantize)
    variants = list(models)
    alone = dist.get_rank() == 0
    seconds, outputs = {}, {}
    if one_process_after:  # the TP copies and a whole one do not fit together: the whole one runs after, alone
        _alternate(models, args, kwargs, repeats, seconds, outputs)
        models.clear()
        gc.collect()
    models["one process"] = cls.from_pretrained(folder, subfolder="transformer").eval() if alone else None
    _alternate(models, args, kwargs, repeats, seconds, outputs)
    if not alone:
        return {}
    reference = outputs["one process"]
    if not all(torch.isfinite(out).all() for out in reference):
        raise RuntimeError(f"{record.display_name}'s one-process output is not finite on the captured call: a timing "
                           "of it would mean nothing. Check the call (`capture_call`) and the config.")
    diffs = {label: max((out - ref).abs().max().item() for out, ref in zip(outputs[label], reference, strict=True))
             for label in variants}
    return {"seconds": seconds, "max_abs_diff": diffs,
            "params": sum(p.numel() for p in models["one process"].parameters())}


def one_process_after(params: int, tp_plans: int, element_size: int = 4, available: int | None = None) -> bool:
    """Whether the one-process model must wait for the TP copies to be freed: together they hold `tp_plans` + 1
    whole copies of the weights, kept under 80% of the memory available (the rest: activations, the spawn)."""
    available = available_bytes() if available is None else available
    return available is not None and (tp_plans + 1) * params * element_size > 0.8 * available


def measure_family(family: str, *, tp: int = 2, blocks: int = 1, tokens: int = 4096, text: int = 512,
                   repeats: int = 3, width: str = "full", one_process: str = "auto", control: bool = False,
                   quantize=None) -> dict:
    """One family's figures: seconds per forward of each plan and of one process (all samples and the median), the
    ideal (one process / tp), and the ratios; with `quantize` ("fp8", "int8:16"), our default plan quantized too, in
    the same alternation (its max abs diff is then its quantization error against the one-process bf16/float32)."""
    quantize = None if quantize is None else Quantization.of(quantize)
    if tp < 2:
        raise ValueError(f"--tp {tp}: tensor parallelism needs at least 2 ranks (one process is measured anyway).")
    config = bench_config(family, blocks, width)
    args, kwargs = capture_call(family, tokens, text)
    kwargs = widen(kwargs, config)
    record = families.get(family)
    cls = record.model_class()
    with tempfile.TemporaryDirectory(prefix="bench-step-") as folder:
        torch.manual_seed(0)
        model = cls.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(Path(folder) / "transformer")
        del model
        after = (one_process == "after" if one_process != "auto"
                 else one_process_after(params, len(record.plan_variants) + 1 + control + (quantize is not None)))
        rank0 = run_on_cpu_ranks(_rank_job, tp, family, folder, args, kwargs, repeats, after, control, quantize,
                                 timeout_s=7200.0)[0]
    seconds = rank0["seconds"]
    median = {label: statistics.median(values) for label, values in seconds.items()}
    ideal = median["one process"] / tp
    # Each round's TP forwards ran back to back, so its ratio cancels the machine's drift between rounds.
    rounds = {label: [ours / stock for ours, stock in zip(seconds[label], seconds["stock"], strict=True)]
              for label in rank0["max_abs_diff"]}
    return {
        "family": family, "name": families.get(family).display_name, "width": width, "tp": tp,
        "blocks": {field: blocks for field in DEPTH_FIELDS if field in config}, "params": rank0["params"],
        "image_tokens": kwargs["hidden_states"].shape[1], "text_tokens": kwargs["encoder_hidden_states"].shape[1],
        "repeats": repeats, "one_process_after": after, "seconds": seconds, "median_s": median,
        "ideal_s": ideal,
        "vs_stock": {label: statistics.median(ratios) for label, ratios in rounds.items()},
        "vs_stock_rounds": rounds,
        "vs_ideal": {label: median[label] / ideal for label in median},
        "max_abs_diff": rank0["max_abs_diff"],
        "quantize": None if quantize is None else str(quantize),
    }


def markdown(results: list[dict]) -> str:
    """The table `step.md` holds: median seconds per forward of each variant, the ideal, and the ratios."""
    first = results[0]
    lines = [
        f"One transformer forward at TP={first['tp']}, {first['image_tokens']} image + {first['text_tokens']} text "
        f"tokens, {first['width']} width, one thread per rank: median of each row's rounds of forwards, the "
        "variants in alternation (every other round reversed); ours / stock: median of the rounds' ratios "
        "[min - max]; ideal = one process / N.", "",
        "| model | blocks | rounds | one process (s) | ideal (s) | stock TP (s) | ours (s) | ours / stock "
        "| ours / ideal |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        median, ratio = result["median_s"], result["vs_ideal"]
        blocks = ", ".join(f"{field.removeprefix('num_')}={n}" for field, n in result["blocks"].items())
        ours = [label for label in result["vs_stock"] if label != "stock"]
        lines.append(
            f"| {result['name']} | {blocks} | {result['repeats']} | {median['one process']:.3f}"
            f"{' (after)' if result.get('one_process_after') else ''} | {result['ideal_s']:.3f} | "
            f"{median['stock']:.3f} | " + "<br>".join(f"{median[label]:.3f} ({label})" for label in ours) + " | "
            + "<br>".join(f"{result['vs_stock'][label]:.2f}x [{min(result['vs_stock_rounds'][label]):.2f} - "
                          f"{max(result['vs_stock_rounds'][label]):.2f}]" for label in ours) + " | "
            + "<br>".join(f"{ratio[label]:.2f}x" for label in ours) + " |")
    if any(result.get("quantize") for result in results):
        lines += ["", QUANTIZED_NOTE]
    return "\n".join(lines) + "\n"


def chart(results: list[dict], path: Path) -> None:
    """Seconds per forward and multiples of the ideal, stock TP beside our default plan, one group per family."""
    groups = [(r["name"], r) for r in results]
    plot.paired_bars([
        {"title": "seconds per forward", "unit": "s (median)",
         "groups": [(name, (r["median_s"]["stock"], r["median_s"]["default"])) for name, r in groups]},
        {"title": "x ideal (one process / N)", "unit": "1.0 = perfect scaling",
         "groups": [(name, (r["vs_ideal"]["stock"], r["vs_ideal"]["default"])) for name, r in groups]},
    ], ("stock TP", "our default plan"), f"bench step, TP={results[0]['tp']}", path)


def run(families_: list[str], out: Path | None, command: str = "neuron-diffusers bench step", **options) -> list[dict]:
    """Measure each family (printing its row as soon as it has it), then write step.json / .md / .png into `out`."""
    results = []
    for family in families_:
        results.append(measure_family(family, **options))
        print(markdown(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)  # stdout: the table or JSON
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        header = record.metadata(command)
        (out / "step.json").write_text(json.dumps({**header, "results": results}, indent=2) + "\n")
        (out / "step.md").write_text(markdown(results))
        chart(results, out / "step.png")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", action="append", choices=FAMILIES, help="default: all four image families")
    parser.add_argument("--tp", type=positive_int, default=2)
    parser.add_argument("--blocks", type=positive_int, default=1, help="blocks of each kind (default 1)")
    parser.add_argument("--tokens", type=positive_int, default=4096, help="image tokens, a square (4096: 1024 x 1024)")
    parser.add_argument("--text", type=positive_int, default=512, help="text tokens (default 512)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed forwards of each variant, after one warm-up")
    parser.add_argument("--width", choices=("full", "tiny"), default="full",
                        help="full: the released widths; tiny: the tiny checkpoints' (a quick check of the command)")
    parser.add_argument("--one-process", choices=("auto", "alternate", "after"), default="auto",
                        help="time the one-process model in alternation with the TP ones, or after them once they are "
                             "freed (auto: after only where they would not fit in memory together)")
    parser.add_argument("--control", action="store_true",
                        help=f"also time stock's plan loaded a second time ('{CONTROL}'): its ratio to stock is the "
                             "noise of this machine, beside ours")
    parser.add_argument("--quantize", default=None, metavar="KIND[:BLOCK]",
                        help="also our default plan with fp8 or int8 blocks (through from_pretrained's "
                             "quantization_config), in the same alternation; on CPU its time says little")
    parser.add_argument("--out", type=Path, default=None, help="folder for step.json / .md / .png")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")


def main(args: argparse.Namespace) -> None:
    command = record.command_line(args)
    results = run(args.family or list(FAMILIES), args.out, command, tp=args.tp, blocks=args.blocks, tokens=args.tokens,
                  text=args.text, repeats=args.repeats, width=args.width, one_process=args.one_process,
                  control=args.control, quantize=args.quantize)
    print(json.dumps(results, indent=2) if args.json else markdown(results), end="")
