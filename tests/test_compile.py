"""Repeated-block compilation at TP=2 on CPU: no graph breaks, and no recompiles after warm-up, all five families.

FLUX.1 and FLUX.2 pad text to `max_sequence_length` themselves; Qwen-Image, Qwen-Image-2.1 and MiniMax-H3 pad
exactly into length buckets (their defaults: nothing is passed to `load_pipeline`).

One job a family on the session's pool of 2 ranks (`rank_pool`), the family its case (`rank_cases`): a family that
fails fails only its own tests.
"""

import compile_jobs
import pytest
import torch
from rank_cases import case

from neuron_diffusers import tiny
from neuron_diffusers.compile import resolve_backend

FAMILIES = tiny.FAMILIES
WORDS = "red fox snow forest light mountain river cloud".split()


def prompts_of(word_counts) -> list[str]:
    return [" ".join(WORDS[i % len(WORDS)] for i in range(n)) for n in word_counts]


# 20 prompts of 1 to 95 words: 1 to ~250 tokens depending on the family's tokenizer, over several buckets.
PROMPTS = prompts_of([1, *range(5, 100, 5)])
# Qwen-Image-2.1, the seed's own example: 20 prompts of 1 to 200 words (10 to 584 tokens), all five buckets.
PROMPTS_TO_200_WORDS = prompts_of([1 + round(i * 199 / 19) for i in range(20)])


#: Wan's smallest call decodes its default 81 frames, each of its 22 generates here: 9 frames (3 latent frames) give
#: the compiled blocks the same graphs for a seventh of the decoding.
SHORT_CLIPS = {"wan": {"num_frames": 9}}
CALLS = {family: {**tiny.smallest_call(family), **SHORT_CLIPS.get(family, {})} for family in FAMILIES}


@pytest.fixture(scope="module")
def compile_report(tiny_checkpoint, rank_pool):
    """`compile_report(family)` → both ranks' results for that family on `aot_eager` (its job runs on first use)."""
    made = {}

    def get(family):
        if family not in made:
            prompts = PROMPTS_TO_200_WORDS if family == "qwenimage21" else PROMPTS
            reports = rank_pool.run(compile_jobs.compile_checks, 2, {family: tiny_checkpoint(family)},
                                    {family: CALLS[family]}, {}, prompts, "aot_eager", timeout_s=900)
            made[family] = case(reports, family)
        return made[family]

    return get


@pytest.fixture(scope="module")
def inductor_report(tiny_checkpoint, rank_pool):
    """The same on a real compiler backend (C++ codegen on CPU), for one family: FLUX.2, the cheapest to build."""
    reports = rank_pool.run(compile_jobs.compile_checks, 2, {"flux2": tiny_checkpoint("flux2")},
                            {"flux2": tiny.smallest_call("flux2")}, {}, PROMPTS[::4], "inductor", timeout_s=900)
    return case(reports, "flux2")


@pytest.mark.parametrize("family", FAMILIES)
def test_no_graph_breaks_and_no_recompiles_after_warmup(compile_report, family):
    for rank, result in enumerate(compile_report(family)):
        assert result["graph_breaks"] == 0, f"rank {rank}"
        assert result["graphs_after_warmup"] > 0
        assert result["new_graphs"] == 0 and result["new_recompiles"] == 0, f"rank {rank}: {result}"


# One graph per repeated block class (FLUX.1, FLUX.2: double + single stream) and length bucket (Qwen-Image 5,
# Qwen-Image-2.1 5, x2 for its KV-cache prefill vs cached steps; H3 5, x2 for its first step's two noise levels;
# Wan one block class, its text padded to 512 by the pipeline).
# Without row-major block inputs FLUX.1's second single-stream block compiles again (a stride change), as does
# Qwen-Image-2.1's first block on cached steps.
EXPECTED_GRAPHS = {"flux": 2, "flux2": 2, "qwenimage": 5, "qwenimage21": 10, "h3": 10, "wan": 1}


@pytest.mark.parametrize("family", FAMILIES)
def test_one_graph_per_block_class_and_declared_shape(compile_report, family):
    for result in compile_report(family):
        assert result["graphs_after_warmup"] == EXPECTED_GRAPHS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_output_equals_eager(compile_report, family):
    leader = compile_report(family)[0]
    assert leader["diff"] is not None and leader["diff"] < 1e-5


def test_inductor_backend_no_breaks_no_recompiles_equals_eager(inductor_report):
    for result in inductor_report:
        assert result["graph_breaks"] == 0 and result["new_graphs"] == 0 and result["new_recompiles"] == 0
    assert inductor_report[0]["diff"] < 1e-5


def test_backend_resolution():
    assert resolve_backend("aot_eager") == "aot_eager"
    assert resolve_backend("auto") in ("neuron", "inductor")
    with pytest.raises(ValueError, match="Unknown torch.compile backend 'no-such'.*Registered:.*inductor"):
        resolve_backend("no-such")


def test_block_classes_are_matched_by_class_not_by_name():
    """Names resolve to the classes the model's own module defines; a same-named class elsewhere does not match."""
    from neuron_diffusers.parallel.blocks import block_types_of
    from neuron_diffusers.tools.plan.meta import meta_transformer

    model = meta_transformer("flux").module
    types = block_types_of(model, ["FluxTransformerBlock", "NoSuchBlock"])
    assert [cls.__module__ for cls in types] == ["diffusers.models.transformers.transformer_flux"]
    impostor = type("FluxTransformerBlock", (torch.nn.Module,), {})
    assert sum(isinstance(m, types) for m in model.modules()) == len(model.transformer_blocks)
    assert not isinstance(impostor(), types)
