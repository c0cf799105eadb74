"""Rank jobs for tests/test_coalesce.py, one a test (module level, so the rank pool can import them)."""

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


def _tp_mesh():
    import neuron_diffusers as nd

    return nd.init_distributed(tp=2)["tp"]


def _load_ours(checkpoint):
    from diffusers import TensorParallelConfig

    from neuron_diffusers.checkpoint import resolve

    cls = resolve(checkpoint).transformer_class()
    return cls, cls.from_pretrained(checkpoint, subfolder="transformer",
                                    parallel_config=TensorParallelConfig(mesh=_tp_mesh()))


def family_check(checkpoint, call) -> dict:
    """Ours vs one process and vs stock TP for one family, with the collectives each issues, on 2 CPU ranks."""
    from diffusers import TensorParallelConfig

    from neuron_diffusers import stock_plan, using_plan

    args, kwargs, single = call
    cls, ours = _load_ours(checkpoint)
    out = _forward(ours, args, kwargs)
    entry = {"vs_single": _max_diff(out, single), "calls": _count(ours, args, kwargs), "stale": _stale_hoisted(ours)}
    # diffusers has no MiniMax-H3 plan: there the reference is ours with one collective per Linear, as stock does.
    reference_plan = stock_plan(cls) or _uncoalesced(cls._tp_plan)
    with using_plan(cls, reference_plan):
        stock = cls.from_pretrained(checkpoint, subfolder="transformer",
                                    parallel_config=TensorParallelConfig(mesh=_tp_mesh()))
    entry["vs_stock"] = _max_diff(out, _forward(stock, args, kwargs))
    entry["reference_calls"] = _count(stock, args, kwargs)
    return entry


def called_alone_check(flux, call) -> str:
    """A hoisted Linear of a sharded FLUX.1 (after a forward) called on its own."""
    _, model = _load_ours(flux)
    _forward(model, *call[:2])
    try:
        model.transformer_blocks[0].norm1.linear(torch.zeros(1, model.inner_dim))
        return "accepted"
    except RuntimeError as error:
        return str(error)


def third_output_check(flux, call) -> dict:
    """An attention processor returning a third output (FLUX.1's IP-Adapter); then the model still works."""
    _, model = _load_ours(flux)
    report = {}
    attn = model.transformer_blocks[0].attn
    stock_processor = attn.processor
    attn.processor = _ThreeOutputs(stock_processor)
    try:
        _forward(model, *call[:2])
        report["ip_adapter"] = "accepted"
    except ValueError as error:
        report["ip_adapter"] = str(error)
    attn.processor = stock_processor
    report["after_error_stale"] = _stale_hoisted(model)
    report["after_error_diff"] = _max_diff(_forward(model, *call[:2]), call[2])
    return report


def zero_cond_check(qwen, call) -> dict:
    from neuron_diffusers.checkpoint import resolve

    return _zero_cond_qwen(qwen, _tp_mesh(), resolve(qwen).transformer_class()._tp_plan, call)


def misdeclared_check(qwen, call) -> dict:
    """A hoist declared on a Linear whose input is not what it says: its own gather, and a warning."""
    from neuron_diffusers.checkpoint import resolve
    from neuron_diffusers.parallel import coalesce
    from neuron_diffusers.tp_plans import GatheredColwiseParallel

    misdeclared = {**resolve(qwen).transformer_class()._tp_plan,
                   "transformer_blocks.*.txt_mod.1": GatheredColwiseParallel(hoist_from="time_text_embed")}
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger(coalesce.__name__)
    logger.addHandler(handler)
    try:
        return {**_zero_cond_qwen(qwen, _tp_mesh(), misdeclared, call), "warnings": warnings}
    finally:
        logger.removeHandler(handler)


def restore_check(flux, call) -> dict:
    """`enable_parallelism` failing right after `coalesce.install`: classes and hooks restored, model still works."""
    from diffusers import TensorParallelConfig

    from neuron_diffusers.checkpoint import resolve
    from neuron_diffusers.parallel import coalesce

    failing = resolve(flux).transformer_class().from_pretrained(flux, subfolder="transformer")
    classes = [type(m) for m in failing.modules()]
    install = coalesce.install

    def install_then_fail(*args, **kwargs):
        install(*args, **kwargs)
        raise RuntimeError("injected failure after coalesce.install")

    coalesce.install = install_then_fail
    try:
        failing.enable_parallelism(config=TensorParallelConfig(mesh=_tp_mesh()))
    except RuntimeError:
        pass
    finally:
        coalesce.install = install
    restored = classes == [type(m) for m in failing.modules()] and not any(m._forward_hooks for m in failing.modules())
    return {"restored": restored, "restored_diff": _max_diff(_forward(failing, *call[:2]), call[2])}
