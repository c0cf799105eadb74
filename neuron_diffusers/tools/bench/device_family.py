"""One family of `bench device`, in its own process: each phase prints one JSON line the moment it is measured.

Phases: `build` (the transformer, random bf16 weights made on the device), `load` (`load_pipeline` with that module:
text encoder on CPU, transformer on the device), `warmup` (`compile_repeated_blocks(backend)` + `warmup`),
`prompts` (20 prompt lengths after warm-up: graphs and recompiles), `ours` (median transformer forward of one
`generate`), `stock_cpu_encoder` (the stock pipeline with its text encoder on CPU beside the device transformer),
`stock` (a fresh transformer with the same weights, stock `compile_repeated_blocks` of the same block classes, the
stock pipeline called with the same padded embeddings on the device), `fp8` (`load_pipeline(quantize="fp8")` on
another transformer with the same weights, built once stock's is freed: its median eager step beside `batch`'s
bf16 one; on the tiny checkpoints `fp8:16`, the block their widths divide), then `done`. In between, after `ours`:
`batch` (images per second at batch 1 and at batch 4, the same four images, eager: the compiled graphs are batch
1's, and compiling batch 4's would take minutes of the time box at full size; batch 2 on the tiny checkpoints).
A failure prints an `error` line naming its phase; what was printed before it stands. `batch` reports a pipeline
that cannot batch (Wan) and `fp8` an error of its own (a kernel the device lacks) in their lines instead, and the
family goes on.

Run by `bench device` (`device.py`): `python -m neuron_diffusers.tools.bench.device_family FAMILY [--tiny]`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import resource
import statistics
import sys
import time
import traceback
import warnings
import weakref

import torch
from diffusers.utils import logging as diffusers_logging
from torch._dynamo.exc import FailOnRecompileLimitHit

from ... import families, tiny
from ...batching import batch_refusal
from ...checkpoint import resolve
from ...compat import plans as compat_plans
from ...compile import compile_repeated_blocks, compile_report, compiled_block_classes, resolve_backend, warmup
from ...distributed import init_distributed, mesh_device
from ...runner import load_pipeline
from .compile import PROMPTS
from .device_folder import full_size_folder
from .rss import available_bytes

#: Full size: the image side (MiniMax-H3 makes 124-frame videos, 32 latent frames: half the side, a quarter of the
#: tokens per frame, ~8k tokens in all).
FULL_SIZE = {"h3": (512, 512)}
DEFAULT_FULL_SIZE = (1024, 1024)
#: 20 prompts of 1 to 190 words: 20 text lengths, the issue's check.
LENGTH_PROMPTS = PROMPTS[:20]
#: The prompt of the timed runs, ours and stock: `warmup`'s own, so its shapes are compiled even without buckets.
TIMED_PROMPT = "warm-up"
#: Device memory kept free beyond the weights at full size (activations at ~4-8k tokens, the compiler's workspace).
ACTIVATION_MARGIN_GIB = 16
#: The `batch` phase: this many images at batch 1, then in one call (on the tiny checkpoints 2: the suite runs
#: every family's phases, and a tiny call costs as much as a full-size one on a device).
BATCH, TINY_BATCH = 4, 2
#: The `fp8` phase's scheme: block-wise fp8 with 128-column blocks at full size; 16 on the tiny checkpoints, whose
#: Linears are 32 to 64 columns wide (a block must divide them, `parallel/quantize.check`).
FP8_FULL, FP8_TINY = "fp8", "fp8:16"


def emit(family: str, phase: str, **fields) -> None:
    print(json.dumps({"family": family, "phase": phase, **fields}), flush=True)


def peak_gib(device: torch.device) -> float:
    """Peak device memory so far: `max_memory_allocated` on CUDA, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def forward_times(module: torch.nn.Module, device: torch.device):
    """Seconds of each forward of `module` (device synchronised at both ends), collected into the yielded list."""
    seconds, starts = [], []

    def before(*_):
        _sync(device)
        starts.append(time.perf_counter())

    def after(*_):
        _sync(device)
        seconds.append(time.perf_counter() - starts.pop())

    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield seconds
    finally:
        for handle in handles:
            handle.remove()


def _median_ms(seconds: list[float]) -> float | None:
    return round(statistics.median(seconds) * 1000, 3) if seconds else None


def random_transformer(cls, config: dict, device: torch.device) -> torch.nn.Module:
    """`cls(config)` with its stock random init, built straight on `device` in bf16 (no float32 copy, no Hub)."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            # `.to`: a buffer an `__init__` made from NumPy lands on the CPU whatever the default device.
            return cls.from_config(config).eval().to(device)
    finally:
        torch.set_default_dtype(default)


def free_bytes(device: torch.device) -> int | None:
    """Free memory where the transformer would be built: the device's on CUDA, MemAvailable on CPU (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_bytes()


def memory_problem(params: int, free: int | None, where: str) -> str | None:
    """Why the transformer would not fit (None when it does or `free` is unknown): bf16 weights plus a margin.

    On CPU too: a full-size build on a host without the memory would be ended by the kernel's OOM killer, with no
    line to say why, instead of this `skip`."""
    needed = params * 2 + ACTIVATION_MARGIN_GIB * 2**30
    if free is not None and needed > free:
        return (f"needs ~{needed / 2**30:.1f} GiB ({params / 1e9:.1f}B bf16 parameters + {ACTIVATION_MARGIN_GIB} GiB "
                f"for activations), {free / 2**30:.1f} GiB free ({where})")
    return None


def describe(error: BaseException) -> str:
    """One line: the exception, its first line, and where it was raised (the device run's log is all we get)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]:.300}{where}"


def _device_embeds(embeds: dict, device: torch.device) -> dict:
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in embeds.items()}


class _Run:
    """The phases of one family; `phase` names the one running, for the error line."""

    def __init__(self, family: str, tiny_run: bool, backend: str):
        self.family, self.tiny, self.backend = family, tiny_run, resolve_backend(backend)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.phase = "setup"
        smallest = tiny.smallest_call(family)
        self.size = smallest["height"], smallest["width"]
        if not tiny_run:
            self.size = FULL_SIZE.get(family, DEFAULT_FULL_SIZE)
        self.steps = smallest["num_inference_steps"]  # the fewest that run every step kind
        self.extra = {k: v for k, v in smallest.items() if k not in ("height", "width", "num_inference_steps")}

    def emit(self, phase: str, **fields) -> None:
        emit(self.family, phase, **fields, peak_gib=peak_gib(self.device))

    def call_kwargs(self, steps: int) -> dict:
        return {"height": self.size[0], "width": self.size[1], "num_inference_steps": steps, **self.extra}

    def run(self) -> None:
        self.phase = "build"
        folder = tiny.cached_tiny(self.family) if self.tiny else full_size_folder(self.family)
        checkpoint = resolve(folder)
        cls = checkpoint.transformer_class()
        config = cls.load_config(folder / "transformer")
        with torch.device("meta"):
            params = sum(p.numel() for p in cls.from_config(config).parameters())
        problem = None if self.tiny else memory_problem(params, free_bytes(self.device), self.device.type)
        if problem:
            self.emit("skip", reason=f"not enough device memory: {problem}")
            return
        began = time.perf_counter()
        transformer = random_transformer(cls, config, self.device)
        _sync(self.device)
        self.emit("build", seconds=round(time.perf_counter() - began, 3), params=params, device=str(self.device),
                  dtype="bfloat16", folder=str(folder), size=list(self.size), backend=self.backend,
                  text_encoder="the tiny checkpoint's" if self.tiny else
                  "random stand-in: real output width, a few narrow layers (device_folder.py)")
        pipe = self._ours(checkpoint, transformer)
        del transformer  # `pipe` holds the only reference: the stock phase frees it before building its own
        bf16_step_ms = self._batch(pipe)
        self._stock(checkpoint, cls, config, pipe)
        del pipe
        self._fp8(checkpoint, cls, config, bf16_step_ms)
        self.emit("done")

    def _ours(self, checkpoint, transformer):
        self.phase = "load"
        began = time.perf_counter()
        mesh = init_distributed(tp=1)
        pipe = load_pipeline(checkpoint, mesh, torch.bfloat16, transformer=transformer)
        pipe.pipe.set_progress_bar_config(disable=True)
        self.emit("load", seconds=round(time.perf_counter() - began, 3), transformer_device=str(mesh_device(mesh)),
                  text_encoder_device="cpu", buckets=list(pipe.buckets))
        self.phase = "warmup"
        self.output = {"output_type": "latent"} if "latent" in pipe.adapter.output_types else {}
        call = {**self.call_kwargs(self.steps), **self.output}
        began, before = time.perf_counter(), compile_report()
        compile_repeated_blocks(pipe, backend=self.backend)
        warmup(pipe, [self.size], **{k: v for k, v in call.items() if k not in ("height", "width")})
        warm = compile_report()
        self.emit("warmup", seconds=round(time.perf_counter() - began, 3), graphs=warm["graphs"] - before["graphs"],
                  compile_seconds=round(warm["compile_seconds"] - before["compile_seconds"], 3))
        self.phase = "prompts"
        began, run, failure = time.perf_counter(), 0, None
        try:
            for prompt in LENGTH_PROMPTS:
                pipe.generate(prompt, seed=0, **call)
                run += 1
        except FailOnRecompileLimitHit as error:  # unbucketed text: a graph per length until dynamo refuses
            failure = describe(error)
        after = compile_report()
        static = bool(pipe.buckets) or pipe.adapter.static_text_length
        self.emit("prompts", seconds=round(time.perf_counter() - began, 3), prompts=len(LENGTH_PROMPTS),
                  prompts_run=run, words=[len(p.split()) for p in LENGTH_PROMPTS], static_shapes=static,
                  graphs=after["graphs"] - warm["graphs"], recompiles=after["recompiles"] - warm["recompiles"],
                  recompile_reasons=after["recompile_reasons"][warm["recompiles"]:][:3], failure=failure)
        self.phase = "ours"
        transformer = pipe.adapter.transformer_of(pipe.pipe)
        with forward_times(transformer, self.device) as seconds:
            pipe.generate(TIMED_PROMPT, seed=0, **{**call, "num_inference_steps": self.steps + 2})
        self.emit("ours", step_ms=_median_ms(seconds), forwards=len(seconds),
                  forward_ms=[round(s * 1000, 3) for s in seconds])
        return pipe

    def _batch(self, pipe) -> float | None:
        """Images per second making `BATCH` images (`TINY_BATCH` on the tiny checkpoints) one call each and in one
        call (on a device after one untimed call of the batch: kernel selection, allocator growth), eager; returns the
        median eager bf16 transformer step (ms) of the one-image calls, what `fp8`'s is compared with."""
        self.phase = "batch"
        call, rates, size = {**self.call_kwargs(self.steps), **self.output}, {}, TINY_BATCH if self.tiny else BATCH
        prompts = [TIMED_PROMPT] * size  # one text length: every family makes them in one stock call
        refusal = batch_refusal(pipe.adapter, context_parallel=False)
        with torch.compiler.set_stance("force_eager"):
            if refusal is None and self.device.type != "cpu":
                pipe.generate(prompts, seed=0, batch_size=size, **call)
            with forward_times(pipe.adapter.transformer_of(pipe.pipe), self.device) as seconds:
                began = time.perf_counter()
                for index, prompt in enumerate(prompts):
                    pipe.generate(prompt, seed=index, **call)
                _sync(self.device)
            rates[1] = size / (time.perf_counter() - began)
            if refusal is None:
                began = time.perf_counter()
                pipe.generate(prompts, seed=0, batch_size=size, **call)
                _sync(self.device)
                rates[size] = size / (time.perf_counter() - began)
        self.emit("batch", images=size, images_per_s={str(rows): round(rate, 4) for rows, rate in rates.items()},
                  speedup=round(rates[size] / rates[1], 3) if size in rates else None, refused=refusal,
                  eager_step_ms=_median_ms(seconds))
        return _median_ms(seconds)

    def _fp8(self, checkpoint, cls, config, bf16_step_ms: float | None) -> None:
        """`load_pipeline(quantize=...)` on a fresh transformer with the same weights (stock's freed first): its
        median eager step beside the bf16 one of `batch`. Its own error is reported in its line (the device may
        lack a kernel), not the family's."""
        self.phase = "fp8"
        torch._dynamo.reset()  # stock's compiled blocks hold its transformer
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        scheme = FP8_TINY if self.tiny else FP8_FULL
        try:
            began = time.perf_counter()
            pipe = load_pipeline(checkpoint, init_distributed(tp=1), torch.bfloat16, quantize=scheme,
                                 transformer=random_transformer(cls, config, self.device))
            pipe.pipe.set_progress_bar_config(disable=True)
            load_s = time.perf_counter() - began
            with forward_times(pipe.adapter.transformer_of(pipe.pipe), self.device) as seconds:
                # The tiny run's fewest steps; at full size two more, as `ours` (a first forward's costs aside).
                steps = self.steps if self.tiny else self.steps + 2
                pipe.generate(TIMED_PROMPT, seed=0, **self.call_kwargs(steps), **self.output)
        except Exception as error:  # the point of the phase on a new device: which error, if any
            self.emit("fp8", ok=False, quantize=scheme, error=describe(error))
            return
        step_ms = _median_ms(seconds)
        self.emit("fp8", ok=True, quantize=scheme, load_seconds=round(load_s, 3), step_ms=step_ms,
                  bf16_step_ms=bf16_step_ms, bf16_over_fp8=round(bf16_step_ms / step_ms, 3) if bf16_step_ms else None,
                  forwards=len(seconds), forward_ms=[round(s * 1000, 3) for s in seconds])

    def _stock(self, checkpoint, cls, config, pipe) -> None:
        adapter, encoder = pipe.adapter, pipe.encoder
        # Padded as ours pads it: the same shapes, so the two runtimes are compared (not the padding), and the
        # compiler's on-disk cache compiles stock's graphs from ours in seconds.
        embeds = adapter.pad(adapter.encode(encoder, TIMED_PROMPT, None), pipe.buckets)
        blocks = compiled_block_classes(adapter.transformer_of(pipe.pipe), adapter)
        if hasattr(adapter, "pipeline_cls"):
            self.phase = "stock_cpu_encoder"
            self._stock_cpu_encoder(adapter, pipe)
        self.phase = "stock"
        ours = weakref.ref(adapter.transformer_of(pipe.pipe))
        stock = self._stock_denoiser(adapter, pipe, cls, config)
        del pipe
        compat_plans.compile_blocks(stock.transformer, blocks, backend=self.backend, fullgraph=True,
                               dynamic=False)
        embeds = _device_embeds(embeds, self.device)
        if hasattr(adapter, "pipeline_cls"):
            embeds["output_type"] = "latent"
        else:
            embeds["output"] = ["latents", "audio_latents"]
        began = time.perf_counter()
        with torch.no_grad():
            stock(**embeds, generator=torch.Generator("cpu").manual_seed(0), **self.call_kwargs(self.steps))
            warm_s = time.perf_counter() - began
            with forward_times(stock.transformer, self.device) as seconds:
                stock(**embeds, generator=torch.Generator("cpu").manual_seed(0),
                      **self.call_kwargs(self.steps + 2))
        self.emit("stock", step_ms=_median_ms(seconds), forwards=len(seconds),
                  forward_ms=[round(s * 1000, 3) for s in seconds], first_call_seconds=round(warm_s, 3),
                  compiled_blocks=blocks, ours_freed=ours() is None)

    def _stock_cpu_encoder(self, adapter, pipe) -> None:
        """The stock pipeline whole, its text encoder on CPU and its transformer on the device, called with a
        prompt: where stock pipelines pick one execution device for both."""
        components = {name: value if value is not None else pipe.encoder.components.get(name)
                      for name, value in pipe.pipe.components.items()}
        stock = adapter.pipeline_cls()(**components)
        stock.set_progress_bar_config(disable=True)
        try:  # eager: our compiled blocks would compile again for the unpadded text, minutes on a device
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                stock(prompt=TIMED_PROMPT, generator=torch.Generator("cpu").manual_seed(0), output_type="latent",
                      **self.call_kwargs(1 if self.device.type == "cuda" else self.steps))
            self.emit("stock_cpu_encoder", ok=True)
        except Exception as error:  # the point of the phase: which error stock raises here
            self.emit("stock_cpu_encoder", ok=False, error=describe(error))

    def _stock_denoiser(self, adapter, pipe, cls, config):
        """Stock: the same pipeline around a fresh transformer with the same weights (ours freed first: two
        full-size copies need not fit), none of our hooks on it, called directly with device embeddings."""
        torch._dynamo.reset()  # the compiled code holds ours too
        modular = not hasattr(adapter, "pipeline_cls")
        if modular:  # MiniMax-H3's denoise blocks; our sequence padding hooks the old transformer's blocks only
            stock = pipe.pipe.denoiser
            stock.update_components(transformer=None)
        else:
            stock = adapter.pipeline_cls()(**{name: value for name, value in pipe.pipe.components.items()
                                              if name != "transformer"}, transformer=None)
        pipe.pipe = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        fresh = random_transformer(cls, config, self.device)
        if modular:
            stock.update_components(transformer=fresh)
        else:
            stock.register_modules(transformer=fresh)
        if hasattr(stock, "set_progress_bar_config"):
            stock.set_progress_bar_config(disable=True)
        return stock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=families.PIPELINE_FAMILIES)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)
    diffusers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    run = _Run(args.family, args.tiny, args.backend)
    try:
        run.run()
    except Exception as error:
        emit(args.family, "error", at=run.phase, error=describe(error), peak_gib=peak_gib(run.device))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
