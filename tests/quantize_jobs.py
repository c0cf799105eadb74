"""Rank jobs for tests/test_quantize.py (module level, so the rank pool can import them)."""

from __future__ import annotations

import torch
from rank_cases import one_thread, record

from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.parallel.quantize import quantize_model
from neuron_diffusers.tools.plan.cases import predictions

KINDS = ("fp8", "int8")
#: The block width per family: 16 divides every tiny family's row shards at TP=2 and 4; Wan 2.1's attention output
#: (48 wide, 24 per rank at TP=2) takes 8.
BLOCKS = {"wan": 8}


def scheme(family: str, kind: str) -> str:
    return f"{kind}:{BLOCKS.get(family, 16)}"


def quantized_predictions(checkpoint, scheme: str, args, kwargs, parallel_config=None) -> tuple[torch.Tensor, ...]:
    """The transformer of `checkpoint` loaded (sharded by `parallel_config`, or whole), quantized (unless `scheme` is
    None), called once."""
    cls = resolve(checkpoint).transformer_class()
    extra = {} if parallel_config is None else {"parallel_config": parallel_config}
    model = cls.from_pretrained(checkpoint, subfolder="transformer", **extra).eval()
    if scheme is not None:
        quantize_model(model, scheme)
    with torch.no_grad():  # cloned: under Ulysses the output is an AsyncCollectiveTensor, waited on by any op
        return tuple(output.clone() for output in predictions(model(*args, **kwargs)))


def tp_job(calls: dict) -> dict:
    """Every family's call under each scheme at TP=2 (the whole pool one TP group): `{(family, kind): outputs}`."""
    from diffusers import TensorParallelConfig

    from neuron_diffusers import init_distributed

    report = {}
    with one_thread():
        mesh = init_distributed(tp=2)
        config = TensorParallelConfig(mesh=mesh["tp"])
        for family, (checkpoint, args, kwargs) in calls.items():
            for kind in KINDS:
                record(report, (family, kind), quantized_predictions, checkpoint, scheme(family, kind), args, kwargs,
                       config)
        record(report, "load_pipeline", _through_load_pipeline, mesh, *calls["flux"])
    return report


def _through_load_pipeline(mesh, checkpoint, args, kwargs) -> tuple[torch.Tensor, ...]:
    """FLUX.1 through `load_pipeline(..., quantize=...)` (its recipe's step), its transformer called once."""
    from neuron_diffusers import load_pipeline

    pipe = load_pipeline(checkpoint, mesh=mesh, quantize=scheme("flux", "fp8"))
    with torch.no_grad():
        return tuple(output.clone() for output in predictions(pipe.pipe.transformer(*args, **kwargs)))


def layouts_job(calls: dict) -> dict:
    """On 4 ranks, fp8 only: every family of `calls` at TP=4 and at tp=2 x ulysses=2: `{(family, layout): outputs}`."""
    from diffusers import ContextParallelConfig, ParallelConfig, TensorParallelConfig

    from neuron_diffusers import init_distributed

    report = {}
    with one_thread():
        tp4 = TensorParallelConfig(mesh=init_distributed(tp=4)["tp"])
        mesh = init_distributed(tp=2, ulysses=2)
        cp = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=2, mesh=mesh),
                            tensor_parallel_config=TensorParallelConfig(mesh=mesh["tp"]))
        for family, (checkpoint, args, kwargs) in calls.items():
            for layout, config in (("tp4", tp4), ("tp2xulysses2", cp)):
                record(report, (family, layout), quantized_predictions, checkpoint, scheme(family, "fp8"), args,
                       kwargs, config)
    return report
