"""Recompiles over one prompt set, stock diffusers vs ours, and cold compile seconds of repeated-block vs whole-model.

On Neuron every new graph is minutes of compilation, so what matters is how many graphs a serving loop makes and
when. In one run, on the same checkpoint, backend, size, steps and prompts:

- **stock**: `DiffusionPipeline.from_pretrained` + `transformer.compile_repeated_blocks(fullgraph=True,
  dynamic=False)`, then every prompt through the stock pipeline. Each new text length is a new graph, until dynamo's
  `recompile_limit` (8 per code object) raises `FailOnRecompileLimitHit`; the run stops at that prompt.
- **ours**: `load_pipeline` + `compile.compile_repeated_blocks` + `warmup` (every text-length bucket once), then
  every prompt through `generate`: graphs and recompiles after warm-up.
- **cold compile**: a freshly loaded transformer, after `torch._dynamo.reset()` and with the compiler's on-disk
  caches off, called once on the transformer's first real call of the stock run (captured by a forward pre-hook):
  repeated blocks compiled vs `torch.compile` of the whole model. Both the wall time of that first call and dynamo's
  own compile seconds are reported, and their ratios whole/repeated.

Dynamo's counters and settings are per process, so everything runs in a fresh spawned process (one gloo rank per
`--tp`; stock, which has no TP, runs whole on each), and each phase is a delta of `compile.compile_report()` taken
after a `torch._dynamo.reset()`. Tables show rank 0.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections import Counter

import torch
import torch._dynamo.exc as dynamo_exc
import torch._inductor.config
from diffusers import TensorParallelConfig
from diffusers.utils import logging as diffusers_logging

from ... import tiny
from ...checkpoint import resolve
from ...compile import compile_repeated_blocks, compile_report, resolve_backend, warmup
from ...distributed import init_distributed, mesh_device
from ...parallel.blocks import block_types_of
from ...runner import load_pipeline
from ..plan.cases import recording_first_call
from ..spawn import run_on_cpu_ranks

WORDS = "red fox snow forest light mountain river cloud".split()
# 21 prompts of 1 to 200 words: 21 text lengths, far past stock's recompile limit of 8.
PROMPTS = [" ".join(WORDS[i % len(WORDS)] for i in range(n)) for n in [1, *range(10, 200, 10), 200]]
TIMEOUT_S = 1800.0


def _delta(before: dict, after: dict) -> dict:
    """What dynamo did between two `compile_report()`s."""
    return {
        "graphs": after["graphs"] - before["graphs"],
        "recompiles": after["recompiles"] - before["recompiles"],
        "graph_breaks": after["graph_breaks"] - before["graph_breaks"],
        "compile_seconds": round(after["compile_seconds"] - before["compile_seconds"], 3),
        "recompile_reasons": after["recompile_reasons"][before["recompiles"]:],
    }


def _stock_run(checkpoint, backend: str, prompts: list[str], call: dict) -> tuple[dict, tuple]:
    """The stock way. Also returns the transformer's first call (args, kwargs), for the cold compile."""
    pipe = checkpoint.adapter.load_stock(checkpoint)
    call = {**call, **checkpoint.adapter.stock_output_kwargs}
    pipe.set_progress_bar_config(disable=True)
    torch._dynamo.reset()
    pipe.transformer.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)
    limit = torch._dynamo.config.recompile_limit  # before our `warmup`, which may raise it for its declared shapes
    start = before = compile_report()
    new_graphs, limit_hit_at, error = [], None, None
    began = time.perf_counter()
    # Recorded on the transformer itself, outside the compiled blocks.
    with recording_first_call(pipe.transformer) as captured:
        for index, prompt in enumerate(prompts):
            try:
                with torch.no_grad():
                    pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(0), **call)
            except dynamo_exc.FailOnRecompileLimitHit as exc:
                limit_hit_at, error = index, f"{type(exc).__name__}: " + str(exc).partition("\n")[0]
                break
            after = compile_report()
            new_graphs.append(after["graphs"] - before["graphs"])
            before = after
    seconds = time.perf_counter() - began
    stock = {**_delta(start, compile_report()), "seconds": round(seconds, 3), "prompts_run": len(new_graphs),
             "recompile_limit": limit,
             "new_graphs_per_prompt": new_graphs, "limit_hit_at_prompt": limit_hit_at, "limit_error": error}
    return stock, captured[0]


def _our_run(checkpoint, mesh, backend: str, prompts: list[str], call: dict) -> dict:
    """`load_pipeline` + our `compile_repeated_blocks` + `warmup`, then every prompt: what compiles after warm-up."""
    pipe = load_pipeline(checkpoint, mesh)
    pipe.pipe.set_progress_bar_config(disable=True)
    torch._dynamo.reset()
    compile_repeated_blocks(pipe, backend=backend)
    start = compile_report()
    began = time.perf_counter()
    size = (call["height"], call["width"])
    warmup(pipe, [size], **{k: v for k, v in call.items() if k not in ("height", "width")})
    warm_seconds = time.perf_counter() - began
    warm = compile_report()
    new_graphs = []
    began = time.perf_counter()
    for prompt in prompts:
        before = compile_report()
        pipe.generate(prompt, seed=0, **call)
        new_graphs.append(compile_report()["graphs"] - before["graphs"])
    seconds = time.perf_counter() - began
    return {
        "buckets": list(pipe.buckets),
        "warmup": {**_delta(start, warm), "runs": max(len(pipe.buckets), 1), "seconds": round(warm_seconds, 3)},
        "after_warmup": {**_delta(warm, compile_report()), "seconds": round(seconds, 3), "prompts_run": len(prompts),
                         "new_graphs_per_prompt": new_graphs},
    }


def _fresh_transformer(checkpoint, mesh):
    """The checkpoint's transformer, loaded anew (sharded over `mesh["tp"]` at TP > 1), so nothing is compiled yet."""
    tp_mesh = mesh["tp"]
    parallel = {"parallel_config": TensorParallelConfig(mesh=tp_mesh)} if tp_mesh.size() > 1 else {}
    transformer = checkpoint.transformer_class().from_pretrained(checkpoint.path, subfolder="transformer", **parallel)
    return transformer if parallel else transformer.to(mesh_device(tp_mesh))


def _first_call(model, call) -> float:
    args, kwargs = call
    began = time.perf_counter()
    with torch.no_grad():
        model(*args, **kwargs)
    return time.perf_counter() - began


def _cold_compile(checkpoint, mesh, adapter, backend: str, call: tuple) -> dict:
    """The first transformer forward, eager, then with repeated blocks compiled, then with the whole model compiled.

    Each compile starts from `torch._dynamo.reset()` and a fresh transformer, with the inductor / AOTAutograd
    on-disk caches off, so a second run of the benchmark is as cold as the first. Nothing is subtracted: the first
    call's wall time includes running it (see the eager row for what that costs).
    """
    transformer = _fresh_transformer(checkpoint, mesh)
    block_classes = getattr(adapter, "compiled_blocks", None) or transformer._repeated_blocks
    block_types = block_types_of(transformer, block_classes)
    blocks = Counter(type(m).__name__ for m in transformer.modules() if isinstance(m, block_types))
    result = {"blocks_per_class": dict(blocks), "eager_first_call_s": round(_first_call(transformer, call), 3)}
    for name in ("repeated_blocks", "whole_model"):
        torch._dynamo.reset()
        transformer = _fresh_transformer(checkpoint, mesh)
        if name == "repeated_blocks":
            # Through the adapter, so a family that compiles only some block classes (MiniMax-H3) does so here too.
            compile_repeated_blocks(transformer, backend=backend, blocks=adapter.compiled_blocks)
            model = transformer
        else:
            model = torch.compile(transformer, backend=backend, fullgraph=False, dynamic=False)
        with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "dynamo_pgo force disabled")  # yes: that is the point here
            before = compile_report()
            seconds = _first_call(model, call)
            after = compile_report()
        delta = _delta(before, after)
        result[name] = {"first_call_s": round(seconds, 3), "compile_seconds": delta["compile_seconds"],
                        "graphs": delta["graphs"], "graph_breaks": delta["graph_breaks"]}
    repeated, whole = result["repeated_blocks"], result["whole_model"]
    result["ratio_first_call"] = round(whole["first_call_s"] / repeated["first_call_s"], 2)
    result["ratio_compile_seconds"] = (round(whole["compile_seconds"] / repeated["compile_seconds"], 2)
                                       if repeated["compile_seconds"] > 0 else None)
    return result


def _measure_on_rank(model: str, backend: str, prompts: list[str], size, steps: int, tp: int) -> dict:
    """All three phases in this (fresh, spawned) process; every rank of the TP group runs them alike."""
    # Stock Qwen-Image warns on every call that `true_cfg_scale` needs a negative prompt: one line per call.
    diffusers_logging.set_verbosity_error()
    checkpoint = resolve(model)
    adapter = checkpoint.adapter
    backend = resolve_backend(backend)
    # The tiny family's own extra call kwargs (MiniMax-H3: its clip length), at the requested size and steps.
    extra = tiny.smallest_call(checkpoint.family.name) if checkpoint.family.has_tiny else {}
    call = {**extra, "height": size[0], "width": size[1], "num_inference_steps": steps}
    mesh = init_distributed(tp=tp)
    try:
        stock, captured = _stock_run(checkpoint, backend, prompts, call)
        ours = _our_run(checkpoint, mesh, backend, prompts, call)
        cold = _cold_compile(checkpoint, mesh, adapter, backend, captured)
    finally:
        torch._dynamo.reset()
    return {"model": str(model), "checkpoint": str(checkpoint.path), "pipeline": adapter.pipeline_class,
            "backend": backend, "size": list(size), "steps": steps, "tp": tp, "torch": torch.__version__,
            "recompile_limit_after": torch._dynamo.config.recompile_limit,
            "prompt_words": [len(p.split()) for p in prompts], "stock": stock, "ours": ours, "cold_compile": cold}


def measure(model: str = "qwenimage", backend: str = "aot_eager", prompts: list[str] | None = None,
            size: tuple[int, int] | None = None, steps: int = 2, tp: int = 1) -> dict:
    """Run the benchmark in a fresh spawned process (`tp` gloo ranks) and return rank 0's figures.

    `model` is a tiny family name or a checkpoint folder (then `size` is required); `prompts` default to `PROMPTS`.
    """
    prompts = PROMPTS if prompts is None else list(prompts)
    if not prompts:
        raise ValueError("Give at least one prompt.")
    if size is None:
        if str(model) not in tiny.FAMILIES:
            raise ValueError(f"Give a size (--height, --width) for the checkpoint folder {model}; only tiny families "
                             f"({', '.join(tiny.FAMILIES)}) have a default.")
        size = tiny.default_size(str(model))
    return run_on_cpu_ranks(_measure_on_rank, tp, model, backend, prompts, size, steps, tp, timeout_s=TIMEOUT_S)[0]


def _limit_cell(stock: dict, total: int) -> str:
    if stock["limit_hit_at_prompt"] is None:
        return f"{stock['recompile_limit']}: not hit"
    return (f"{stock['recompile_limit']}: hit at prompt {stock['limit_hit_at_prompt'] + 1} of {total} "
            f"({stock['limit_error'].split(':')[0]})")


def format_table(result: dict) -> str:
    """Markdown tables of `measure`'s result: recompiles per run, then cold compile seconds."""
    words = result["prompt_words"]
    stock, ours, cold = result["stock"], result["ours"], result["cold_compile"]
    warm, after = ours["warmup"], ours["after_warmup"]
    buckets = (f"one run per text bucket ({', '.join(map(str, ours['buckets']))})" if ours["buckets"]
               else "one run (static text length)")
    refused = (", stock's including the one refused at the limit" if stock["limit_hit_at_prompt"] is not None
               else "")
    lines = [
        f"{result['model']} ({result['pipeline']}), {result['size'][0]}x{result['size'][1]}, {result['steps']} steps, "
        f"backend {result['backend']}, TP={result['tp']}, torch {result['torch']}; {len(words)} prompts of "
        f"{min(words)}-{max(words)} words",
        "",
        "| run | prompts run | graphs | recompiles | graph breaks | recompile limit | seconds |",
        "|---|---:|---:|---:|---:|---|---:|",
        f"| stock: `compile_repeated_blocks` + pipeline call | {stock['prompts_run']} | {stock['graphs']} | "
        f"{stock['recompiles']} | {stock['graph_breaks']} | {_limit_cell(stock, len(words))} | "
        f"{stock['seconds']:.2f} |",
        f"| ours: `warmup`, {buckets} | {warm['runs']} | "
        f"{warm['graphs']} | {warm['recompiles']} | {warm['graph_breaks']} | - | {warm['seconds']:.2f} |",
        f"| ours: every prompt after warm-up | {after['prompts_run']} | {after['graphs']} | {after['recompiles']} | "
        f"{after['graph_breaks']} | - | {after['seconds']:.2f} |",
        "",
        f"(recompiles: dynamo recompilations as `compile_report()` counts them{refused}; our `warmup` leaves "
        f"dynamo's recompile_limit at {result['recompile_limit_after']})",
        "",
        "| cold compile, first transformer forward | first call wall s | dynamo compile s | graphs | graph breaks |",
        "|---|---:|---:|---:|---:|",
        f"| eager (no compile) | {cold['eager_first_call_s']:.3f} | - | - | - |",
    ]
    for name, label in (("repeated_blocks", "repeated blocks"), ("whole_model", "whole model (fullgraph=False)")):
        row = cold[name]
        lines.append(f"| {label} | {row['first_call_s']:.3f} | {row['compile_seconds']:.3f} | {row['graphs']} | "
                     f"{row['graph_breaks']} |")
    ratio_compile = "n/a" if cold["ratio_compile_seconds"] is None else f"{cold['ratio_compile_seconds']:.2f}x"
    blocks = ", ".join(f"{count} {name}" for name, count in cold["blocks_per_class"].items())
    lines += [
        "",
        f"whole / repeated: {cold['ratio_first_call']:.2f}x first-call wall time, {ratio_compile} dynamo compile "
        "seconds (`compile_report()['compile_seconds']` deltas)",
        f"caveat: this transformer has {blocks}; whole-model compile grows with the block count, repeated-block "
        "compile does not, so a real model (FLUX.1: 57 blocks) shows a far larger ratio than this one.",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwenimage",
                        help="tiny family name or checkpoint folder (default: qwenimage, whose text length varies)")
    parser.add_argument("--backend", default="aot_eager",
                        help="torch.compile backend, or 'auto' (neuron if installed, else inductor); default aot_eager")
    parser.add_argument("--prompts", type=int, choices=range(1, len(PROMPTS) + 1), default=len(PROMPTS), metavar="N",
                        help=f"use the first N of the {len(PROMPTS)} built-in prompts (1 to 200 words)")
    parser.add_argument("--height", type=int, default=None, help="default: the tiny family's size")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2, help="denoising steps per prompt (default: 2)")
    parser.add_argument("--tp", type=int, default=1,
                        help="TP degree (gloo CPU ranks) of our run and the cold compile; stock runs whole on each "
                             "(default: 1)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of the tables")


def main(args: argparse.Namespace) -> None:
    if (args.height is None) != (args.width is None):
        raise ValueError("Give both --height and --width, or neither.")
    size = None if args.height is None else (args.height, args.width)
    result = measure(args.model, args.backend, PROMPTS[:args.prompts], size, args.steps, args.tp)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
