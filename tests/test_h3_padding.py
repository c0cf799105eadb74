"""MiniMax-H3's padded packed sequence gives the unpadded transformer output (issue #34, item 3).

`PackedSequencePadding` appends masked rows to the packed sequence so the main blocks run at one shape per text
bucket. Checked at the transformer's output (video and audio predictions, float32), not through decoded frames, which
on the tiny random checkpoint barely move even for another prompt; the control (the prompt's text rows in another
order: another prompt of the same length) must move the output past the tolerance.
"""

import torch

from neuron_diffusers import tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.pipelines.h3 import MiniMaxH3Adapter, PackedSequencePadding
from neuron_diffusers.tools.plan.cases import predictions, reference_call

TOLERANCE = 1e-5  # float32: the padded rows are masked keys, so only the summation order may differ


def _run(transformer, args, kwargs) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return predictions(transformer(*args, **kwargs))


def _max_difference(first, second) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(first, second, strict=True))


def test_h3_padded_packed_sequence_equals_the_unpadded_output():
    checkpoint = tiny.cached_tiny("h3")
    args, kwargs, stock = reference_call(checkpoint, "h3")
    resolved = resolve(checkpoint)
    transformer = resolved.adapter.load_stock(resolved).transformer
    assert _max_difference(_run(transformer, args, kwargs), stock) == 0, "the reference is this transformer's"

    padding = PackedSequencePadding(transformer)
    padding.buckets = MiniMaxH3Adapter.buckets
    rows = []
    transformer.register_forward_pre_hook(  # a test probe, after the padding's: the packed length the blocks see
        lambda m, a, k: rows.append(k["position_ids"].shape[0]), with_kwargs=True)
    padded = _run(transformer, args, kwargs)
    unpadded_rows = kwargs["position_ids"].shape[0]
    text_rows = kwargs["text_indices"].numel()
    assert rows[-1] > unpadded_rows, (rows, unpadded_rows)
    assert rows[-1] - unpadded_rows == min(b for b in padding.buckets if b > text_rows) - text_rows
    assert _max_difference(padded, stock) < TOLERANCE

    # Control: another prompt of the same length (its text rows reversed) moves the output past the tolerance.
    other = {**kwargs, "encoder_hidden_states": kwargs["encoder_hidden_states"].flip(1)}
    assert _max_difference(_run(transformer, args, other), stock) > 10 * TOLERANCE
