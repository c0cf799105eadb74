"""`load_pipeline(...).generate(...)` on 2 CPU ranks equals the stock single-process pipeline, for all five families.

One job a family on the session's pool of ranks (`rank_pool`), its cases recorded one by one (`rank_cases`), so a
failure fails only the tests that read it; the stock references run in this process.

Outputs are compared before the 8-bit rounding (the float image, MiniMax-H3's float frames and audio samples): on
the tiny random checkpoints a whole prompt swap moves the mean pixel by only 1e-4 to 4e-3, which a mean-pixel bar
would let through. Each comparison holds its control: stock's output for another prompt must differ from stock's by
more than the tolerance, or the test fails as blind.
"""

import numpy as np
import pytest
import runner_jobs
import torch
from rank_cases import case

from neuron_diffusers import tiny
from neuron_diffusers.checkpoint import resolve

FAMILIES = tiny.FAMILIES
PROMPT, OTHER_PROMPT = runner_jobs.PROMPT, "a blue bird over the sea"
#: Max abs difference allowed per output, from float32 rounding: values are O(1) (pixels and frames in [0, 1]), and
#: TP=2 only reorders the sums of each sharded matmul and all-reduce; eps (1.2e-7) times the few hundred terms a
#: reordered reduction can shift, through two to four steps and the VAE, stays below 1e-5 (measured
#: at most 1.7e-6: FLUX.2's image; another prompt moves the images by 1.8e-3 to 4.5e-2).
#: The audio is compared at a tenth of that, as another prompt moves it by only ~2e-4 (TP=2: 6e-8).
TOLERANCE = {"image": 1e-4, "frames": 1e-4, "audio": 1e-5}
_STOCK = {}
#: Each family's smallest call; Wan's with 9 frames (3 latent frames) instead of its default 81, whose decoding
#: (twice in this process, once on the leader) costs seconds and tells nothing more here.
CALLS = {family: {**tiny.smallest_call(family), **({"num_frames": 9} if family == "wan" else {})}
         for family in tiny.FAMILIES}


def stock_output(checkpoint, family, call=None, prompt=PROMPT):
    """What the stock pipeline, alone in one process, makes of `prompt` with the same seed, size and steps (`call`,
    default: the family's `CALLS` entry): the float image (`output_type="np"`), or MiniMax-H3's float frames and
    audio. Made once per session and argument set (test_parallel_vae.py reuses them)."""
    from diffusers import DiffusionPipeline

    call = CALLS[family] if call is None else call
    key = (str(checkpoint), family, tuple(sorted(call.items())), prompt)
    if key in _STOCK:
        return _STOCK[key]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if family == "h3":
            pipe = resolve(checkpoint).adapter.load_stock(resolve(checkpoint))
            out = pipe(prompt=prompt, generator=generator, output_type="pt", output=["videos", "audio"], **call)
            _STOCK[key] = {"frames": out["videos"][0].numpy(), "audio": out["audio"][0].numpy()}
        elif family == "wan":  # video alone, frames first: (num_frames, 3, height, width)
            out = DiffusionPipeline.from_pretrained(checkpoint)(prompt=prompt, generator=generator, output_type="pt",
                                                                **call)
            _STOCK[key] = {"frames": out.frames[0].numpy()}
        else:
            pipe = DiffusionPipeline.from_pretrained(checkpoint)
            _STOCK[key] = {"image": pipe(prompt=prompt, generator=generator, output_type="np", **call).images[0]}
    return _STOCK[key]


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - b).max())


def assert_equals_stock_with_control(output: dict, reference: dict, control: dict, what: str) -> None:
    """Each array of `output` within `TOLERANCE` of stock's (max abs difference), and stock's output for another
    prompt (`control`) further than that from stock's: the comparison can fail."""
    assert output.keys() >= reference.keys()
    for name, expected in reference.items():
        assert output[name].shape == expected.shape, f"{what} {name}: {output[name].shape} != {expected.shape}"
        moved = max_diff(control[name], expected)
        assert moved > TOLERANCE[name], f"{what} {name}: another prompt moves it by only {moved:.1e}: blind"
        difference = max_diff(output[name], expected)
        assert difference < TOLERANCE[name], f"{what} {name} differs from stock by {difference:.1e}"


@pytest.fixture(scope="module")
def runner_reports(tiny_checkpoint, rank_pool):
    """`runner_reports(family)` → both ranks' per-case reports of one job for that family (run on first use), so a
    family whose load fails fails only its own tests, and a failing case only the test that reads it."""
    made = {}

    def get(family):
        if family not in made:
            made[family] = rank_pool.run(runner_jobs.runner_checks, 2, family, tiny_checkpoint(family),
                                         CALLS[family], timeout_s=600)
        return made[family]

    return get


#: A plan file as `plan draft --out` writes one (run as a module of `tp_plans`), holding Qwen-Image-2.1's lean plan.
LEAN_PLAN_FILE = 'from .qwenimage21 import LEAN_PLAN as PLAN\n\nMODEL_CLASS = "QwenImage21Transformer2DModel"\n'


@pytest.mark.parametrize("family", [*FAMILIES, ("qwenimage21", "lean"), ("qwenimage21", "lean.py")], ids=str)
def test_tp2_generate_matches_stock_single_process(tiny_checkpoint, rank_pool, runner_reports, family, tmp_path):
    name = family if isinstance(family, str) else family[0]
    reference = stock_output(tiny_checkpoint(name), name)
    control = stock_output(tiny_checkpoint(name), name, prompt=OTHER_PROMPT)
    if not isinstance(family, str):  # plan="lean" or a plan file holding it: the modulation is sharded as well
        plan = family[1]
        if plan.endswith(".py"):
            (tmp_path / plan).write_text(LEAN_PLAN_FILE)
            plan = str(tmp_path / plan)
        leader, other = rank_pool.run(runner_jobs.runner_lean_check, 2, tiny_checkpoint(name),
                                      tiny.smallest_call(name), plan, timeout_s=600)
        assert leader["modulation_sharded"] and other["modulation_sharded"]
        output, other_output = leader["output"], other["output"]
    else:
        output, other_output = case(runner_reports(family), "output")
    assert other_output is None, "only the TP leader returns images"
    assert_equals_stock_with_control(output, reference, control, str(family))
    if family == "h3":
        assert output["fps"] == 24.0 and output["sampling_rate"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_leader_loads_the_text_encoder(runner_reports, family):
    reports = runner_reports(family)
    leader_holds, other_holds = case(reports, "holds_encoder")
    assert leader_holds and not other_holds
    leader, other = case(reports, "models_in_memory")
    assert any("Autoencoder" not in name for name in leader)
    # Parallel VAE is on by default at TP > 1 (tests/test_parallel_vae.py): every rank holds the image (video) VAE
    # (Wan's causal 3-D VAE too, split by rows),
    # and only the leader the small audio VAE of MiniMax-H3.
    vaes = [name for name in leader if "Autoencoder" in name and "Audio" not in name]
    assert vaes and other == vaes


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


# -- shared with the job tests (test_cli.py, test_image_requests.py, test_lora.py, test_cache.py) ------------------

#: Latents are O(1) (noise-scale; up to ~4 on the tiny checkpoints): the same float32 rounding bar as the images'.
LATENT_TOLERANCE = 1e-4


def stock_latents(pipe, made: dict, prompt: str | None = None, images=None):
    """The stock pipeline `pipe`'s latents (`output_type="latent"`) for one request `runner_jobs.job_latents` made,
    optionally with another `prompt` or other input `images` (paths): the control."""
    from PIL import Image

    paths = made["images"] if images is None else images
    inputs = [Image.open(path) for path in paths]
    image_kwargs = {"image": inputs[0] if len(inputs) == 1 else inputs} if inputs else {}
    with torch.no_grad():
        latents = pipe(prompt=made["prompt"] if prompt is None else prompt, negative_prompt=made["negative_prompt"],
                       generator=torch.Generator().manual_seed(made["seed"]), output_type="latent",
                       **made["kwargs"], **image_kwargs).images[0]
    return latents.float().numpy()


def png_difference(a, b) -> tuple[int, float]:
    """Two 8-bit images: the largest difference in levels, and the fraction of values that differ at all."""
    a, b = (np.asarray(x, dtype=np.int16) for x in (a, b))
    assert a.shape == b.shape, (a.shape, b.shape)
    difference = np.abs(a - b)
    return int(difference.max()), float((difference > 0).mean())


def png_matches(a, b) -> bool:
    """The bar for a PNG against another run's: no value more than one level apart (a float within rounding of the
    other's can round the other way), and at most 0.5% of the values differing."""
    levels, fraction = png_difference(a, b)
    return levels <= 1 and fraction <= 0.005
