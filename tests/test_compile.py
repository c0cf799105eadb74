"""Repeated-block compilation at TP=2 on CPU: no graph breaks, and no recompiles after warm-up.

Covers the families whose text length is static (FLUX.1, FLUX.2 pad to `max_sequence_length`) or bucketed exactly
(Qwen-Image). Qwen-Image-2.1 and MiniMax-H3 cannot be padded without changing the image (see their adapters), so
each new prompt length is a new graph for them: not claimed here.
"""

import pytest

import rank_jobs
from neuron_diffusers import tiny
from neuron_diffusers.compile import resolve_backend
from neuron_diffusers.spawn import run_on_cpu_ranks

STATIC_FAMILIES = ("flux", "flux2", "qwenimage")
WORDS = "red fox snow forest light mountain river cloud".split()
# 20 prompts from 1 to 200 words: every Qwen-Image bucket up to 256 tokens, and truncation for CLIP / T5.
PROMPTS = [" ".join(WORDS[i % len(WORDS)] for i in range(n)) for n in [1, *range(10, 200, 10), 200]]


@pytest.fixture(scope="module")
def compile_report(tiny_checkpoint):
    checkpoints = {family: tiny_checkpoint(family) for family in STATIC_FAMILIES}
    call_kwargs = {}
    for family in STATIC_FAMILIES:
        height, width = tiny.default_size(family)
        call_kwargs[family] = dict(height=height, width=width, num_inference_steps=2)
    return run_on_cpu_ranks(rank_jobs.compile_checks, 2, checkpoints, call_kwargs, PROMPTS, timeout_s=600)


@pytest.mark.parametrize("family", STATIC_FAMILIES)
def test_no_graph_breaks_and_no_recompiles_after_warmup(compile_report, family):
    for rank, report in enumerate(compile_report):
        result = report[family]
        assert result["graph_breaks"] == 0, f"rank {rank}"
        assert result["graphs_after_warmup"] > 0
        assert result["new_graphs"] == 0 and result["new_recompiles"] == 0, f"rank {rank}: {result}"


# One graph per repeated block class (FLUX.1, FLUX.2: double + single stream), times Qwen-Image's 5 length buckets.
# Without contiguous block outputs FLUX.1's second single-stream block compiles a second graph (a stride change).
EXPECTED_GRAPHS = {"flux": 2, "flux2": 2, "qwenimage": 5}


@pytest.mark.parametrize("family", STATIC_FAMILIES)
def test_one_graph_per_block_class_and_declared_shape(compile_report, family):
    for report in compile_report:
        assert report[family]["graphs_after_warmup"] == EXPECTED_GRAPHS[family]


@pytest.mark.parametrize("family", STATIC_FAMILIES)
def test_compiled_output_equals_eager(compile_report, family):
    leader = compile_report[0][family]
    assert leader["diff"] is not None and leader["diff"] < 1e-5


def test_backend_resolution():
    assert resolve_backend("aot_eager") == "aot_eager"
    assert resolve_backend("auto") in ("neuron", "inductor")
    with pytest.raises(ValueError, match="Unknown torch.compile backend 'no-such'.*Registered:.*inductor"):
        resolve_backend("no-such")
