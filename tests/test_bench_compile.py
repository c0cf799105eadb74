"""`bench_compile`: stock diffusers recompiles per prompt length until dynamo's limit, ours not after warm-up."""

import argparse
import json

import pytest

from neuron_diffusers import tiny
from neuron_diffusers.tools.bench import compile as bench_compile

# 9 prompts of distinct text lengths: one more than dynamo's default recompile_limit of 8, so stock reaches it.
PROMPTS = bench_compile.PROMPTS[:9]


@pytest.fixture(scope="module")
def result(tiny_checkpoint):
    # Two denoising steps, the fewest that run: stock Qwen-Image's latents come out NaN after a single step (its
    # sigma schedule), which `generate` now raises as NonFiniteLatentsError. The counts do not depend on the steps.
    return bench_compile.measure(tiny_checkpoint("qwenimage"), backend="aot_eager", prompts=PROMPTS,
                                 size=tiny.default_size("qwenimage"), steps=2)


def test_stock_recompiles_for_every_new_prompt_length_until_the_limit(result):
    stock = result["stock"]
    assert stock["recompiles"] > 0 and stock["graph_breaks"] == 0
    assert stock["new_graphs_per_prompt"] == [1] * stock["prompts_run"]
    # The prompt after `recompile_limit` graphs is refused under fullgraph=True.
    assert stock["limit_hit_at_prompt"] == stock["recompile_limit"] == stock["prompts_run"]
    assert stock["limit_error"].startswith("FailOnRecompileLimitHit")


def test_ours_compiles_only_in_warmup(result):
    ours = result["ours"]
    assert ours["warmup"]["graphs"] == ours["warmup"]["runs"] == len(ours["buckets"]) > 0
    after = ours["after_warmup"]
    assert after["prompts_run"] == len(PROMPTS)
    assert after["graphs"] == 0 and after["recompiles"] == 0 and after["graph_breaks"] == 0, after


def test_cold_compile_times_both_ways(result):
    cold = result["cold_compile"]
    for name in ("repeated_blocks", "whole_model"):
        assert cold[name]["first_call_s"] > 0 and cold[name]["compile_seconds"] > 0 and cold[name]["graphs"] >= 1
    assert cold["ratio_first_call"] > 0 and cold["ratio_compile_seconds"] > 0
    assert cold["blocks_per_class"] == {"QwenImageTransformerBlock": 2}


def test_main_prints_the_table_or_json(result, monkeypatch, capsys):
    monkeypatch.setattr(bench_compile, "measure", lambda *args, **kwargs: result)
    parser = argparse.ArgumentParser()
    bench_compile.add_arguments(parser)
    bench_compile.main(parser.parse_args([]))
    table = capsys.readouterr().out
    assert "| stock: `compile_repeated_blocks` + pipeline call | 8 | 8 |" in table
    assert "FailOnRecompileLimitHit" in table and "| ours: every prompt after warm-up | 9 | 0 | 0 | 0 |" in table
    assert "whole / repeated:" in table and "caveat:" in table
    bench_compile.main(parser.parse_args(["--json"]))
    assert json.loads(capsys.readouterr().out)["ours"]["after_warmup"]["recompiles"] == 0
