"""fp8 and int8 weights under tensor parallelism (issue 30): each rank quantizes its own shard with the scales one
process uses, so TP=2 gives the one-process quantized output (float32 compute, 1e-5), while quantizing moves the
output by more than that (the control: the quantization acts)."""

import pytest
import quantize_jobs
from rank_cases import case

from neuron_diffusers import tiny
from neuron_diffusers.tools.plan.cases import reference_call

TOLERANCE = 1e-5


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def calls(tiny_checkpoint):
    """Per family: (checkpoint, the stock pipeline's first transformer call, its unquantized predictions)."""
    return {family: (tiny_checkpoint(family), *reference_call(tiny_checkpoint(family), family))
            for family in tiny.FAMILIES}


@pytest.fixture(scope="module")
def tp2(rank_pool, calls):
    """One job on the 2-rank pool: every family under every scheme at TP=2."""
    return rank_pool.run(quantize_jobs.tp_job, 2, {f: c[:3] for f, c in calls.items()})


@pytest.mark.parametrize("kind", quantize_jobs.KINDS)
@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_tp2_equals_one_process_quantized(calls, tp2, family, kind):
    checkpoint, args, kwargs, unquantized = calls[family]
    one_process = quantize_jobs.quantized_predictions(checkpoint, quantize_jobs.scheme(family, kind), args, kwargs)
    diffs = [_max_diff(outputs, one_process) for outputs in case(tp2, (family, kind))]
    control = _max_diff(one_process, unquantized)
    assert max(diffs) < TOLERANCE
    assert control > TOLERANCE  # the control: quantization moves the output
