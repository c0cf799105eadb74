"""Rank jobs for tests/test_quantize.py (module level, so the rank pool can import them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rank_cases import one_thread, record

from neuron_diffusers.parallel.quantize import quantize_model
from neuron_diffusers.tools.plan.cases import predictions

KINDS = ("fp8", "int8")
#: Families whose stock call has an odd joint sequence (MiniMax-H3: 457 rope positions): run under Ulysses with
#: diffusers' `ulysses_anything` (load_pipeline: `cp_any_length=True`) rather than padded.
ANY_LENGTH = ("h3",)
#: The block width per family: 16 divides every tiny family's row shards at TP=2 and 4; Wan 2.1's attention output
#: (48 wide, 24 per rank at TP=2) takes 8.
BLOCKS = {"wan": 8}


def scheme(family: str, kind: str) -> str:
    return f"{kind}:{BLOCKS.get(family, 16)}"


def transformer_class(checkpoint) -> type:
    """The diffusers class of `checkpoint`'s transformer, from its config (a folder may hold only the transformer)."""
    import diffusers

    return getattr(diffusers, json.loads((Path(checkpoint) / "transformer" / "config.json").read_text())["_class_name"])


def quantized_predictions(checkpoint, scheme: str, args, kwargs, parallel_config=None) -> tuple[torch.Tensor, ...]:
    """The transformer of `checkpoint` loaded (sharded by `parallel_config`, or whole), quantized (unless `scheme` is
    None), called once."""
    cls = transformer_class(checkpoint)
    extra = {} if parallel_config is None else {"parallel_config": parallel_config}
    model = cls.from_pretrained(checkpoint, subfolder="transformer", **extra).eval()
    if scheme is not None:
        quantize_model(model, scheme)
    with torch.no_grad():  # cloned: under Ulysses the output is an AsyncCollectiveTensor, waited on by any op
        return tuple(output.clone() for output in predictions(model(*args, **kwargs)))


def api_config(family: str, kind: str):
    """The `quantization_config` a TP job passes to `from_pretrained` for `scheme(family, kind)`: int8 as torchao's
    own config (its groups are the scheme's blocks), fp8 as the package's scheme (torchao's fp8 block is 128, wider
    than a tiny model's shards)."""
    if kind == "int8":
        from diffusers import TorchAoConfig
        from torchao.quantization import Int8WeightOnlyConfig, PerGroup

        return TorchAoConfig(Int8WeightOnlyConfig(granularity=PerGroup(BLOCKS.get(family, 16))))
    return scheme(family, kind)


def api_predictions(checkpoint, quantization_config, args, kwargs, parallel_config) -> tuple[torch.Tensor, ...]:
    """The transformer loaded with diffusers' own `from_pretrained(quantization_config=..., parallel_config=...)`,
    called once."""
    cls = transformer_class(checkpoint)
    model = cls.from_pretrained(checkpoint, subfolder="transformer", quantization_config=quantization_config,
                                parallel_config=parallel_config).eval()
    with torch.no_grad():
        return tuple(output.clone() for output in predictions(model(*args, **kwargs)))


def tp_job(calls: dict, wide=None) -> dict:
    """Every family's call under each scheme at TP=2 (the whole pool one TP group), through `from_pretrained`:
    `{(family, kind): outputs}`; FLUX.1 through `load_pipeline`; `wide` (checkpoint, args, kwargs, config): a
    transformer wide enough for torchao's fp8 config (128-wide blocks), under it."""
    from diffusers import TensorParallelConfig

    from neuron_diffusers import init_distributed

    report = {}
    with one_thread():
        mesh = init_distributed(tp=2)
        config = TensorParallelConfig(mesh=mesh["tp"])
        for family, (checkpoint, args, kwargs) in calls.items():
            for kind in KINDS:
                record(report, (family, kind), api_predictions, checkpoint, api_config(family, kind), args, kwargs,
                       config)
        record(report, "load_pipeline", _through_load_pipeline, mesh, *calls["flux"])
        if wide is not None:
            checkpoint, args, kwargs, quantization_config = wide
            record(report, "torchao_fp8", api_predictions, checkpoint, quantization_config, args, kwargs, config)
    return report


def _through_load_pipeline(mesh, checkpoint, args, kwargs, quantize=None, **options) -> tuple[torch.Tensor, ...]:
    """`load_pipeline(..., quantize=...)` (its recipe's step; default FLUX.1's fp8 scheme), its transformer called
    once."""
    from neuron_diffusers import load_pipeline

    pipe = load_pipeline(checkpoint, mesh=mesh, quantize=quantize or scheme("flux", "fp8"), **options)
    with torch.no_grad():
        transformer = pipe.adapter.transformer_of(pipe.pipe)
        return tuple(output.clone() for output in predictions(transformer(*args, **kwargs)))


def layouts_job(calls: dict, tp4_families=()) -> dict:
    """On 4 ranks, fp8 only: every family of `calls` at tp=2 x ulysses=2 through `from_pretrained` and through
    `load_pipeline` (`{(family, "tp2xulysses2" | "load_pipeline"): outputs}`), and `tp4_families` at TP=4."""
    from diffusers import ContextParallelConfig, ParallelConfig, TensorParallelConfig

    from neuron_diffusers import init_distributed

    report = {}
    with one_thread():
        tp4 = TensorParallelConfig(mesh=init_distributed(tp=4)["tp"])
        mesh = init_distributed(tp=2, ulysses=2)
        for family, (checkpoint, args, kwargs) in calls.items():
            anything = family in ANY_LENGTH  # the stock call's sequence, unpadded, through diffusers' *_anything
            cp = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=2, mesh=mesh,
                                                                              ulysses_anything=anything),
                                tensor_parallel_config=TensorParallelConfig(mesh=mesh["tp"]))
            record(report, (family, "tp2xulysses2"), api_predictions, checkpoint, scheme(family, "fp8"), args, kwargs,
                   cp)
            record(report, (family, "load_pipeline"), _through_load_pipeline, mesh, checkpoint, args, kwargs,
                   scheme(family, "fp8"), cp_any_length=anything)
            if family in tp4_families:
                record(report, (family, "tp4"), api_predictions, checkpoint, scheme(family, "fp8"), args, kwargs, tp4)
    return report


def wide_flux(folder, checkpoint, args, kwargs) -> tuple:
    """A tiny FLUX.1 transformer made wide enough for torchao's fp8 config (16 heads of 16: 128-wide row shards at
    TP=2), one block of each kind, saved to `folder`: (checkpoint, args, kwargs, the torchao config, its unquantized
    predictions of the tiny FLUX.1 call)."""
    from diffusers import FluxTransformer2DModel, TorchAoConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerBlock

    torch.manual_seed(0)
    config = {**FluxTransformer2DModel.load_config(checkpoint, subfolder="transformer"), "num_attention_heads": 16,
              "num_layers": 1, "num_single_layers": 1}
    model = FluxTransformer2DModel.from_config(config).eval()
    model.save_pretrained(folder / "transformer")
    with torch.no_grad():
        unquantized = tuple(predictions(model(*args, **kwargs)))
    quantization_config = TorchAoConfig(Float8DynamicActivationFloat8WeightConfig(
        granularity=[PerBlock([1, 128]), PerBlock([128, 128])]))
    return folder, args, kwargs, quantization_config, unquantized
