"""`load_pipeline(...).generate(...)` on 2 CPU ranks equals the stock single-process pipeline, for all five families.

One job a family on the session's pool of ranks (`rank_pool`), its cases recorded one by one (`rank_cases`), so a
failure fails only the tests that read it; the stock references run in this process.
"""

import numpy as np
import pytest
import rank_jobs
import torch
from rank_cases import case

from neuron_diffusers import tiny
from neuron_diffusers.checkpoint import resolve

FAMILIES = tiny.FAMILIES
PROMPT = "a red fox in the snow"


def stock_output(checkpoint, family, call=None):
    """What the stock pipeline, alone in one process, makes of the same prompt, seed, size and steps (`call`,
    default: the family's smallest call)."""
    from diffusers import DiffusionPipeline

    call = tiny.smallest_call(family) if call is None else call
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if family == "h3":
            pipe = resolve(checkpoint).adapter.load_stock(resolve(checkpoint))
            out = pipe(prompt=PROMPT, generator=generator, output_type="pt", output=["videos", "audio"], **call)
            return {"frames": out["videos"][0].numpy(), "audio": out["audio"][0].numpy()}
        if family == "wan":  # video alone, frames first: (num_frames, 3, height, width)
            out = DiffusionPipeline.from_pretrained(checkpoint)(prompt=PROMPT, generator=generator, output_type="pt",
                                                                **call)
            return {"frames": out.frames[0].numpy()}
        image = DiffusionPipeline.from_pretrained(checkpoint)(prompt=PROMPT, generator=generator, **call).images[0]
    return {"image": np.asarray(image, dtype=np.float32) / 255.0}


@pytest.fixture(scope="module")
def runner_reports(tiny_checkpoint, rank_pool):
    """`runner_reports(family)` → both ranks' per-case reports of one job for that family (run on first use), so a
    family whose load fails fails only its own tests, and a failing case only the test that reads it."""
    made = {}

    def get(family):
        if family not in made:
            made[family] = rank_pool.run(rank_jobs.runner_checks, 2, family, tiny_checkpoint(family),
                                         tiny.smallest_call(family), timeout_s=600)
        return made[family]

    return get


@pytest.mark.parametrize("family", [*FAMILIES, ("qwenimage21", "lean")])
def test_tp2_generate_matches_stock_single_process(tiny_checkpoint, rank_pool, runner_reports, family):
    name = family if isinstance(family, str) else family[0]
    reference = stock_output(tiny_checkpoint(name), name)
    if family == ("qwenimage21", "lean"):  # load_pipeline(plan="lean"): the modulation is sharded as well
        leader, other = rank_pool.run(rank_jobs.runner_lean_check, 2, tiny_checkpoint(name),
                                      tiny.smallest_call(name), timeout_s=600)
        assert leader["modulation_sharded"] and other["modulation_sharded"]
        output, other_output = leader["output"], other["output"]
    else:
        output, other_output = case(runner_reports(family), "output")
    assert other_output is None, "only the TP leader returns images"
    assert output.keys() >= reference.keys()
    for name, expected in reference.items():
        assert output[name].shape == expected.shape, name
        assert np.abs(output[name] - expected).mean() < 1 / 255, f"{family} {name} differs from stock"
    if family == "h3":
        assert output["fps"] == 24.0 and output["sampling_rate"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_leader_loads_the_text_encoder(runner_reports, family):
    reports = runner_reports(family)
    leader_holds, other_holds = case(reports, "holds_encoder")
    assert leader_holds and not other_holds
    leader, other = case(reports, "models_in_memory")
    assert any("Autoencoder" not in name for name in leader)
    # Parallel VAE is on by default at TP > 1 (tests/test_parallel_vae.py): every rank holds the image (video) VAE,
    # and only the leader the small audio VAE of MiniMax-H3.
    vaes = [name for name in leader if "Autoencoder" in name and "Audio" not in name]
    # Wan's AutoencoderKLWan is not one parallel VAE splits: the leader alone holds it.
    assert vaes and other == ([] if family == "wan" else vaes)


@pytest.mark.parametrize("family", FAMILIES)
def test_divergent_noise_is_caught_at_the_first_step(runner_reports, family):
    for message in case(runner_reports(family), "divergence"):
        assert "Latents differ across the tensor-parallel group" in message, message
        assert "step 0" in message or "transformer call 0" in message, message
        assert "rank 1" in message and "seed" in message


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_generate_owns_or_cannot_run_are_refused_with_the_reason(runner_reports, family):
    for refused in case(runner_reports(family), "refused"):
        assert "encodes each prompt once on the group leader" in refused["prompt_embeds"]
        assert "pass `seed`" in refused["generator"] and "same noise" in refused["latents"]
        assert "Upsample it beforehand" in refused["caption_upsample_temperature"]
        if family == "qwenimage":
            assert "1 denoising step(s) cannot run" in refused["one_step"], refused["one_step"]
