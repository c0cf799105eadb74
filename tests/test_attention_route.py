"""Processors that call SDPA themselves, routed through diffusers' dispatch for context parallelism
(`compat/attention_route.py`): stock without a parallel config, the same attention through dispatch with one, and a
clear error where a processor has no SDPA call to route. The multi-rank proof (tp=2 x ulysses=2 equal to one
process) is `plan draft --all`'s, in docs/coverage.md; tests/test_coverage.py re-runs one routed class."""

import inspect

import pytest
import torch
from diffusers.models import attention_dispatch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from neuron_diffusers.compat.attention_route import needs_route, route_attention


def _attention(processor) -> Attention:
    torch.manual_seed(0)
    return Attention(query_dim=32, heads=4, dim_head=8, processor=processor).eval()


def _inputs():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2, 6, 32, generator=generator)


def test_a_routed_processor_is_stock_without_a_parallel_config_and_keeps_its_signature():
    stock, routed = _attention(AttnProcessor2_0()), _attention(AttnProcessor2_0())
    assert needs_route(routed) and route_attention(routed) == 1 and not needs_route(routed)
    assert inspect.signature(routed.processor.__call__).parameters.keys() == \
        inspect.signature(stock.processor.__call__).parameters.keys()
    with torch.no_grad():
        assert torch.equal(routed(_inputs()), stock(_inputs()))


def _through_dispatch(monkeypatch) -> list:
    """dispatch_attention_fn recorded, run without a parallel config (one process)."""
    calls, stock = [], attention_dispatch.dispatch_attention_fn

    def recorder(query, key, value, *args, parallel_config=None, **kwargs):
        calls.append((tuple(query.shape), parallel_config))
        return stock(query, key, value, *args, **kwargs)

    monkeypatch.setattr(attention_dispatch, "dispatch_attention_fn", recorder)
    return calls


def test_with_a_parallel_config_the_sdpa_call_goes_through_dispatch_with_the_same_result(monkeypatch):
    calls = _through_dispatch(monkeypatch)
    stock, routed = _attention(AttnProcessor2_0()), _attention(AttnProcessor2_0())
    route_attention(routed)
    routed.processor._parallel_config = config = object()
    with torch.no_grad():
        expected, got = stock(_inputs()), routed(_inputs())
        other = stock(_inputs() * 2)  # control: another input moves the output by far more than the tolerance
    assert calls == [((2, 6, 4, 8), config)]  # [batch, tokens, heads, dim]: dispatch's layout
    assert (got - expected).abs().max() <= 1e-6 < (other - expected).abs().max()


def test_a_processor_without_an_sdpa_call_is_refused_under_context_parallelism(monkeypatch):
    _through_dispatch(monkeypatch)
    routed = _attention(AttnProcessor())  # explicit softmax(QK^T)V: no SDPA call to route
    route_attention(routed)
    routed.processor._parallel_config = object()
    with pytest.raises(ValueError, match="AttnProcessor computes attention without scaled_dot_product_attention"):
        routed(_inputs())


def test_a_mask_that_differs_per_head_is_refused(monkeypatch):
    _through_dispatch(monkeypatch)
    routed = _attention(AttnProcessor2_0())
    route_attention(routed)
    routed.processor._parallel_config = object()
    same = torch.zeros(2, 1, 6)  # prepare_attention_mask repeats it over the 4 heads: every head agrees
    with torch.no_grad():
        routed(_inputs(), attention_mask=same)
        per_head = torch.zeros(2 * 4, 1, 6)  # [batch x heads, 1, keys]: head 1 of sample 0 masks key 0
        per_head[1, 0, 0] = -1.0
        with pytest.raises(ValueError, match="differs per head"):
            routed(_inputs(), attention_mask=per_head)


def test_only_attention_in_the_region_the_plan_splits_is_routed():
    """A text refiner before the blocks runs on the whole sequence on every rank: it must stay local."""
    model = torch.nn.Module()
    model.refiner = _attention(AttnProcessor2_0())
    model.blocks = torch.nn.ModuleList([_attention(AttnProcessor2_0())])
    plan = {"blocks.0": {"hidden_states": object()}, "proj_out": object()}
    assert route_attention(model, plan) == 1
    assert needs_route(model.refiner) and not needs_route(model.blocks[0])
    assert route_attention(model, {"": {"hidden_states": object()}}) == 1  # forward inputs split: everything
    # A list named by an empty rule (it takes the split sequence on: `drafting/context.py`) is routed too.
    model.single = torch.nn.ModuleList([_attention(AttnProcessor2_0())])
    assert route_attention(model, {**plan, "single.0": {}}) == 1 and not needs_route(model.single[0])
