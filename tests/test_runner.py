"""`load_pipeline(...).generate(...)` on 2 CPU ranks equals the stock single-process pipeline, for all five families.

One spawn runs every family (each spawn costs seconds of imports); the stock references run in this process.
"""

import numpy as np
import pytest
import rank_jobs
import torch

from neuron_diffusers import tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.tools.spawn import run_on_cpu_ranks

FAMILIES = tiny.FAMILIES
PROMPT = "a red fox in the snow"


def stock_output(checkpoint, family):
    """What the stock pipeline, alone in one process, makes of the same prompt, seed, size and steps."""
    from diffusers import DiffusionPipeline

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if family == "h3":
            pipe = resolve(checkpoint).adapter.load_stock(resolve(checkpoint))
            out = pipe(prompt=PROMPT, generator=generator, output_type="pt", output=["videos", "audio"],
                       **tiny.smallest_call(family))
            return {"frames": out["videos"][0].numpy(), "audio": out["audio"][0].numpy()}
        image = DiffusionPipeline.from_pretrained(checkpoint)(prompt=PROMPT, generator=generator,
                                                              **tiny.smallest_call(family)).images[0]
    return {"image": np.asarray(image, dtype=np.float32) / 255.0}


@pytest.fixture(scope="module")
def runner_report(tiny_checkpoint):
    checkpoints = {family: tiny_checkpoint(family) for family in FAMILIES}
    reports = run_on_cpu_ranks(rank_jobs.runner_checks, 2, checkpoints,
                               {family: tiny.smallest_call(family) for family in FAMILIES}, timeout_s=600)
    return checkpoints, reports


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_generate_matches_stock_single_process(runner_report, family):
    checkpoints, (leader, other) = runner_report
    reference = stock_output(checkpoints[family], family)
    output = leader[family]["output"]
    assert other[family]["output"] is None, "only the TP leader returns images"
    assert output.keys() >= reference.keys()
    for name, expected in reference.items():
        assert output[name].shape == expected.shape, name
        assert np.abs(output[name] - expected).mean() < 1 / 255, f"{family} {name} differs from stock"
    if family == "h3":
        assert output["fps"] == 24.0 and output["sampling_rate"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_leader_loads_text_encoder_and_vae(runner_report, family):
    _, (leader, other) = runner_report
    assert leader[family]["holds_encoder"] and not other[family]["holds_encoder"]
    assert other[family]["models_in_memory"] == [], "a non-leader rank loaded a text encoder or VAE"
    assert any("Autoencoder" in name for name in leader[family]["models_in_memory"])
    assert any("Autoencoder" not in name for name in leader[family]["models_in_memory"])


@pytest.mark.parametrize("family", FAMILIES)
def test_divergent_noise_is_caught_at_the_first_step(runner_report, family):
    _, reports = runner_report
    for report in reports:
        message = report[family]["divergence"]
        assert "Latents differ across the tensor-parallel group" in message, message
        assert "step 0" in message or "transformer call 0" in message, message
        assert "rank 1" in message and "seed" in message


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_generate_owns_or_cannot_run_are_refused_with_the_reason(runner_report, family):
    _, reports = runner_report
    for report in reports:
        refused = report[family]["refused"]
        assert "encodes each prompt once on the group leader" in refused["prompt_embeds"]
        assert "pass `seed`" in refused["generator"] and "same noise" in refused["latents"]
        assert "Upsample it beforehand" in refused["caption_upsample_temperature"]
