"""`bench device --tiny`: every family's phases as JSON lines, 0 recompiles over 20 prompt lengths, measured figures;
and `load_pipeline(transformer=...)`, which it loads through.

Every family, as `neuron-diffusers bench device --tiny` runs them (its default backend, aot_eager), in two
`device.run` calls side by side (each family is a single-threaded child process, so two use both CI cores): about
1 min on 2 idle CPU cores."""

import statistics
import threading
from types import SimpleNamespace

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from neuron_diffusers import families
from neuron_diffusers.runner import load_pipeline
from neuron_diffusers.tools.bench import device

PHASES = ["build", "load", "warmup", "prompts", "ours", "batch", "stock_cpu_encoder", "stock", "fp8", "done"]


TESTED_FAMILIES = list(families.PIPELINE_FAMILIES)


def _run_side_by_side(names: list[str]) -> list[dict]:
    """`device.run` over every other family in each of two threads; the lines both printed, in family order."""
    halves = [names[0::2], names[1::2]]
    results: list[list[dict]] = [[], []]

    def run(index: int) -> None:
        # Each family's time box is a share of total_s: generous, a shared 2-core machine takes minutes per family.
        device.run(halves[index], tiny=True, total_s=1200, out=results[index].append)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [line for name in names for line in results[0] + results[1] if line["family"] == name]


def test_tiny_run_prints_every_phase_of_every_family_with_measured_figures():
    lines = _run_side_by_side(TESTED_FAMILIES)
    steps = []
    by_family = {name: [line for line in lines if line["family"] == name] for name in TESTED_FAMILIES}
    for name, rows in by_family.items():
        phases = [row["phase"] for row in rows]
        # MiniMax-H3 is modular: no stock pipeline class to put a CPU text encoder into.
        assert phases == [p for p in PHASES if not (name == "h3" and p == "stock_cpu_encoder")], (name, rows)
        row = {r["phase"]: r for r in rows}
        assert row["build"]["device"] == "cpu" and row["load"]["text_encoder_device"] == "cpu"
        assert row["build"]["backend"] == "aot_eager"  # --tiny's default
        prompts = row["prompts"]
        assert prompts["prompts"] == 20 and len(set(prompts["words"])) == 20
        assert prompts["static_shapes"], prompts  # every family's text is bucketed or fixed by default
        assert prompts["prompts_run"] == 20 and prompts["recompiles"] == prompts["graphs"] == 0, prompts
        assert row["warmup"]["graphs"] > 0 and row["warmup"]["seconds"] > 0
        for run in ("ours", "stock"):
            times = row[run]["forward_ms"]
            assert row[run]["forwards"] == len(times) >= 2 and min(times) > 0
            assert row[run]["step_ms"] == pytest.approx(statistics.median(times), abs=0.01)
            steps.append(row[run]["step_ms"])
        assert 0 < row["build"]["peak_gib"] <= row["done"]["peak_gib"]
        _check_batch_and_fp8_rows(name, row)
        steps += [row["batch"]["eager_step_ms"], row["fp8"]["step_ms"]]
    # Measured, not constant: no two runs (ours, stock, eager bf16, fp8; every family) report the same step time.
    assert len(set(steps)) == len(steps), steps
    table = device.summary(lines)
    assert "| flux |" in table and "| batch N / batch 1 (images/s) | bf16 / fp8 (eager step) |" in table
    assert "| refused |" in next(line for line in table.splitlines() if line.startswith("| wan |"))


def _check_batch_and_fp8_rows(name: str, row: dict) -> None:
    """#31's batch row (images/s at batch 1 and 4, 2 on the tiny checkpoints; Wan refuses, with the reason) and #30's
    fp8 row (its eager step beside the bf16 one of the batch row), measured."""
    batch = row["batch"]
    assert batch["images"] == 2 and batch["images_per_s"]["1"] > 0 and batch["eager_step_ms"] > 0
    if name == "wan":
        assert "returns one clip" in batch["refused"] and batch["speedup"] is None
    else:
        assert batch["refused"] is None and batch["images_per_s"]["2"] > 0
        assert batch["speedup"] == pytest.approx(batch["images_per_s"]["2"] / batch["images_per_s"]["1"], rel=1e-2)
    fp8 = row["fp8"]
    assert fp8["ok"] and fp8["quantize"] == "fp8:16", fp8
    assert fp8["forwards"] == len(fp8["forward_ms"]) >= 1 and min(fp8["forward_ms"]) > 0
    assert fp8["bf16_step_ms"] == batch["eager_step_ms"]


def test_load_pipeline_refuses_a_prebuilt_transformer_of_another_class_or_on_several_ranks(tiny_checkpoint):
    folder = tiny_checkpoint("flux")
    with torch.device("meta"):
        other = QwenImageTransformer2DModel(num_layers=1, attention_head_dim=8, num_attention_heads=2,
                                            joint_attention_dim=16, axes_dims_rope=(2, 2, 4))
    with pytest.raises(ValueError, match="holds a FluxTransformer2DModel: pass an instance of the folder's"):
        load_pipeline(folder, transformer=other)
    two_ranks = SimpleNamespace(mesh_dim_names=("dp", "tp"), shape=(1, 2))  # what the check reads of a mesh
    flux = families.get("flux").model_class()
    with torch.device("meta"):
        own = flux.from_config(flux.load_config(folder / "transformer"))
    with pytest.raises(ValueError, match="one-rank image group only"):
        load_pipeline(folder, mesh=two_ranks, transformer=own)


def test_a_full_size_family_that_does_not_fit_is_skipped_with_the_figures():
    """Free memory is checked before the build, on CPU too (the OOM killer would end the run with no line)."""
    from neuron_diffusers.tools.bench.device_family import memory_problem

    reason = memory_problem(7_100_000_000, 20 * 2**30, "cpu")
    assert reason == ("needs ~29.2 GiB (7.1B bf16 parameters + 16 GiB for activations), 20.0 GiB free (cpu)")
    assert memory_problem(7_100_000_000, 139 * 2**30, "cuda") is None
    assert memory_problem(7_100_000_000, None, "cpu") is None  # unknown: tried, as before
