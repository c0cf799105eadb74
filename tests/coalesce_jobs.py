"""Rank jobs for tests/test_coalesce.py (module level, so `spawn` can import them)."""

from __future__ import annotations

import logging

import torch

from neuron_diffusers.tools.plan.cases import predictions


def _forward(model, args, kwargs) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return predictions(model(*args, **kwargs))


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _stale_hoisted(model) -> list[str]:
    """Hoisted Linears still holding an output outside a forward (there must be none)."""
    return [n for n, m in model.named_modules() if getattr(getattr(m, "_nd_hoist", None), "output", None) is not None]


def _count(model, args, kwargs) -> dict:
    from neuron_diffusers.tools.bench.collectives import CollectiveCounter

    counter = CollectiveCounter()
    with torch.no_grad(), counter:
        model(*args, **kwargs)
    return dict(counter.calls)


def _zero_cond_qwen(checkpoint, mesh, plan, call) -> dict:
    """Qwen-Image with `zero_cond_t` (txt_mod and norm_out read half of temb's batch), sharded in memory."""
    from diffusers import QwenImageTransformer2DModel, TensorParallelConfig

    from neuron_diffusers import using_plan

    config = {**QwenImageTransformer2DModel.load_config(checkpoint, subfolder="transformer"), "zero_cond_t": True}
    torch.manual_seed(0)
    reference = QwenImageTransformer2DModel.from_config(config).eval()
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel.from_config(config).eval()
    args, kwargs, _ = call
    expected = _forward(reference, args, kwargs)
    with using_plan(QwenImageTransformer2DModel, plan):
        model.enable_parallelism(config=TensorParallelConfig(mesh=mesh))
    return {"diff": _max_diff(_forward(model, args, kwargs), expected), "calls": _count(model, args, kwargs)}


def _uncoalesced(plan: dict) -> dict:
    """`plan` with every coalescing style replaced by its one-collective-per-Linear twin."""
    from neuron_diffusers.tp_plans import GatheredColwiseParallel, PartialRowwiseParallel

    return {rule: "rowwise" if isinstance(style, PartialRowwiseParallel)
            else GatheredColwiseParallel() if isinstance(style, GatheredColwiseParallel) else style
            for rule, style in plan.items()}


class _ThreeOutputs:
    """Stands in for FLUX.1's IP-Adapter processor, which returns a third (unsharded) output."""

    def __init__(self, stock):
        self.stock = stock

    def __call__(self, attn, *args, **kwargs):
        first, second = self.stock(attn, *args, **kwargs)
        return first, second, torch.zeros_like(first)


def coalesce_checks(checkpoints: dict, calls: dict) -> dict:
    """Ours vs stock TP for every family, and the coalescing styles' guards, on 2 CPU ranks."""
    from diffusers import TensorParallelConfig

    import neuron_diffusers as nd
    from neuron_diffusers import stock_plan, using_plan
    from neuron_diffusers.checkpoint import resolve
    from neuron_diffusers.parallel import coalesce
    from neuron_diffusers.tp_plans import GatheredColwiseParallel

    mesh = nd.init_distributed(tp=2)["tp"]
    report = {}
    models = {}
    for family, checkpoint in checkpoints.items():
        args, kwargs, single = calls[family]
        cls = resolve(checkpoint).transformer_class()
        ours = cls.from_pretrained(checkpoint, subfolder="transformer", parallel_config=TensorParallelConfig(mesh=mesh))
        out = _forward(ours, args, kwargs)
        entry = {"vs_single": _max_diff(out, single), "calls": _count(ours, args, kwargs),
                 "stale": _stale_hoisted(ours)}
        # diffusers has no MiniMax-H3 plan: there the reference is ours with one collective per Linear, as stock does.
        reference_plan = stock_plan(cls) or _uncoalesced(cls._tp_plan)
        with using_plan(cls, reference_plan):
            stock = cls.from_pretrained(checkpoint, subfolder="transformer",
                                        parallel_config=TensorParallelConfig(mesh=mesh))
        stock_out = _forward(stock, args, kwargs)
        entry["vs_stock"] = _max_diff(out, stock_out)
        entry["reference_calls"] = _count(stock, args, kwargs)
        report[family] = entry
        models[family] = ours

    flux = models["flux"]
    try:
        flux.transformer_blocks[0].norm1.linear(torch.zeros(1, flux.inner_dim))
        report["called_alone"] = "accepted"
    except RuntimeError as error:
        report["called_alone"] = str(error)

    attn = flux.transformer_blocks[0].attn
    stock_processor = attn.processor
    attn.processor = _ThreeOutputs(stock_processor)
    args, kwargs, _ = calls["flux"]
    try:
        _forward(flux, args, kwargs)
        report["ip_adapter"] = "accepted"
    except ValueError as error:
        report["ip_adapter"] = str(error)
    attn.processor = stock_processor
    report["after_error_stale"] = _stale_hoisted(flux)
    report["after_error_diff"] = _max_diff(_forward(flux, *calls["flux"][:2]), calls["flux"][2])

    qwen_cls = resolve(checkpoints["qwenimage"]).transformer_class()
    report["zero_cond_t"] = _zero_cond_qwen(checkpoints["qwenimage"], mesh, qwen_cls._tp_plan, calls["qwenimage"])
    misdeclared = {**qwen_cls._tp_plan,
                   "transformer_blocks.*.txt_mod.1": GatheredColwiseParallel(hoist_from="time_text_embed")}
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger(coalesce.__name__).addHandler(handler)
    report["misdeclared"] = {**_zero_cond_qwen(checkpoints["qwenimage"], mesh, misdeclared, calls["qwenimage"]),
                             "warnings": warnings}

    failing = resolve(checkpoints["flux"]).transformer_class().from_pretrained(checkpoints["flux"],
                                                                               subfolder="transformer")
    classes = [type(m) for m in failing.modules()]
    install = coalesce.install

    def install_then_fail(*args, **kwargs):
        install(*args, **kwargs)
        raise RuntimeError("injected failure after coalesce.install")

    coalesce.install = install_then_fail
    try:
        failing.enable_parallelism(config=TensorParallelConfig(mesh=mesh))
    except RuntimeError:
        pass
    finally:
        coalesce.install = install
    report["restored"] = classes == [type(m) for m in failing.modules()] and not any(
        m._forward_hooks for m in failing.modules())
    report["restored_diff"] = _max_diff(_forward(failing, *calls["flux"][:2]), calls["flux"][2])
    return report
