"""`generate(batch_size=...)`: several images per stock pipeline call, each equal to the image made alone.

For every family at TP=2, three prompts of different lengths batched give, image by image, the latents of the same
prompt made alone (its seed `seed + i`) within 1e-5 (float32), while another seed moves them by more (the control);
the batch shares its transformer forwards. MiniMax-H3's latents are its video and audio latents, each compared.
Then true CFG on a CFG pair (Qwen-Image) and TP=2 x Ulysses=2 (FLUX.1).
One job per world size on the session's rank pool (`batch_jobs.py`), its cases recorded one by one.
"""

import batch_jobs
import numpy as np
import pytest
from rank_cases import case

from neuron_diffusers import tiny
from neuron_diffusers.batching import check_batch_sizes, padded_count, resolve_batch_size, split, stack_rows

#: Max abs difference between a batched image's latents and the image made alone. A batch only changes the row count
#: of each matmul (and the masked padding of shorter texts; MiniMax-H3: the block-diagonal mask over its packed
#: requests): measured 2.4e-7 to 4.8e-7 at TP=2, 1.4e-6 with true CFG on a CFG pair (Qwen-Image); another seed
#: moves them by 3.5 to 6.1.
TOLERANCE = 1e-5
FAMILIES = ("flux", "flux2", "qwenimage", "qwenimage21", "h3")  # the five families; Wan refuses
#: Stock calls a batch of `batch_jobs.PROMPTS` takes: one, or (Qwen-Image-2.1) one per text length, two here.
CALLS = {"qwenimage21": 2}


#: FLUX.1's classes that take one input image per prompt, batched at TP=2 (`batch_jobs._image_batch`): Kontext with
#: the image group's leader encoding for both ranks, inpainting (a mask per row, its masked image encoded as a batch)
#: with the parallel VAE splitting every encode and decode over both ranks.
IMAGE_CALLS = {
    "FluxKontextPipeline": {"height": 32, "width": 32, "num_inference_steps": 2, "max_area": 32 * 32,
                            "_auto_resize": False, "parallel_vae": False},
    "FluxInpaintPipeline": {"height": 32, "width": 32, "num_inference_steps": 4, "strength": 0.6, "mask": True,
                            "parallel_vae": True},
}


@pytest.fixture(scope="module")
def tp2_reports(tiny_checkpoint, rank_pool):
    checkpoints = {family: tiny_checkpoint(family) for family in FAMILIES}
    calls = {family: tiny.smallest_call(family) for family in FAMILIES}
    return rank_pool.run(batch_jobs.batch_tp2_job, 2, checkpoints, calls, IMAGE_CALLS, timeout_s=900)


def forwards_per_call(family: str) -> int:
    """Transformer forwards of one call of `tiny.smallest_call`: its steps (the stock MiniMaxH3Scheduler counts the
    terminal sigma as a step, tiny/h3.py: one fewer)."""
    steps = tiny.smallest_call(family)["num_inference_steps"]
    return steps - 1 if family == "h3" else steps


@pytest.fixture(scope="module")
def four_rank_reports(tiny_checkpoint, rank_pool):
    return rank_pool.run(batch_jobs.batch_4_ranks_job, 4, tiny_checkpoint("qwenimage"),
                         tiny.smallest_call("qwenimage"), tiny_checkpoint("flux"), tiny.smallest_call("flux"),
                         timeout_s=900)


def parts(latents) -> dict:
    """An image's latents by name: one array, or MiniMax-H3's video and audio latents (or decoded frames and
    audio)."""
    return latents if isinstance(latents, dict) else {"latents": latents}


def assert_each_image_alone(made: dict, what: str) -> None:
    """Batched latents (each part of them) equal each image made alone, within `TOLERANCE`; another seed moves
    image 0 by more."""
    for part, control in parts(made["control"][0]).items():
        moved = float(np.abs(control - parts(made["alone"][0])[part]).max())
        assert moved > TOLERANCE, f"{what}: another seed moves the {part} by only {moved:.1e}: blind"
    assert len(made["batched"]) == len(made["alone"]) == len(batch_jobs.PROMPTS)
    for index, (batched, alone) in enumerate(zip(made["batched"], made["alone"], strict=True)):
        assert parts(batched).keys() == parts(alone).keys()
        for part, expected in parts(alone).items():
            assert parts(batched)[part].shape == expected.shape
            difference = float(np.abs(parts(batched)[part] - expected).max())
            assert difference < TOLERANCE, (f"{what}: image {index}'s {part} differ from the image made alone by "
                                            f"{difference:.1e}")


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_batch_of_three_lengths_equals_each_image_alone(tp2_reports, family):
    leader, other = case(tp2_reports, family)
    assert other["batched"] is None and other["alone"] is None, "only the TP leader returns images"
    assert_each_image_alone(leader, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_batch_shares_its_transformer_forwards(tp2_reports, family):
    leader, other = case(tp2_reports, family)
    forwards = forwards_per_call(family)
    assert leader["forwards_alone"] == other["forwards_alone"] == 3 * forwards
    assert leader["forwards_batched"] == other["forwards_batched"] == CALLS.get(family, 1) * forwards


def test_h3_decoded_batch_under_the_parallel_vae_equals_each_clip_alone(tp2_reports):
    leader, other = case(tp2_reports, "h3/decoded")
    assert leader["parallel_vae"] and other["parallel_vae"], "the parallel VAE split none of the decodes: blind"
    assert other["batched"] is None and other["alone"] is None, "only the TP leader returns clips"
    assert_each_image_alone(leader, "h3 decoded under the parallel VAE")


#: Max abs difference of a batch's decoded float image (values in [0, 1]) from the image decoded alone, both by the
#: parallel VAE over 2 ranks: measured 6.0e-7 (Qwen-Image-2.1), 9.2e-7 (Qwen-Image), 1.7e-6 (FLUX.1), 2.3e-6 (FLUX.2):
#: the latents' rounding (about 5e-7) carried through the decoder; another seed moves it by 0.45 to 0.92.
DECODE_TOLERANCE = 1e-5


@pytest.mark.parametrize("family", ("flux", "flux2", "qwenimage", "qwenimage21"))
def test_parallel_vae_decodes_a_batch_across_the_group_each_image_as_alone(tp2_reports, family):
    """The batch of two is one decode split over both ranks (each rank's first convolution gets a band of the rows,
    the bands adding up to the whole), and each decoded image equals the image made and decoded alone."""
    leader, other = case(tp2_reports, f"{family}/decoded")
    assert leader["parallel_vae"] and other["parallel_vae"]
    assert other["batched"] is None and other["alone"] is None, "only the TP leader returns images"
    # Per decode (alone, alone, the batch, the control): its batch, its rows, and each rank's band of them.
    assert [d[0] for d in leader["decodes"]] == [d[0] for d in other["decodes"]] == [1, 1, 2, 1]
    for mine, theirs in zip(leader["decodes"], other["decodes"], strict=True):
        assert mine[1] == theirs[1] and 0 < mine[2] < mine[1] and mine[2] + theirs[2] == mine[1], (mine, theirs)
    moved = float(np.abs(leader["control"][0] - leader["alone"][0]).max())
    assert moved > DECODE_TOLERANCE, f"another seed moves the decoded image by only {moved:.1e}: blind"
    for index, (batched, alone) in enumerate(zip(leader["batched"], leader["alone"], strict=True)):
        assert batched.shape == alone.shape and batched.ndim == 3
        difference = float(np.abs(batched - alone).max())
        assert difference < DECODE_TOLERANCE, f"{family}: decoded image {index} differs by {difference:.1e}"


@pytest.mark.parametrize("pipeline_class", IMAGE_CALLS)
def test_prompts_with_their_own_input_images_batch_each_as_alone(tp2_reports, pipeline_class):
    """Three prompts, each with its own input image (inpainting: its own mask), in one stock call: each row's
    transformer inputs (noise and image latents) and final latents equal the prompt made alone with its image; another
    input image for row 0 moves both by more (the control)."""
    leader, other = case(tp2_reports, f"images/{pipeline_class}")
    assert other["alone"] is None and other["batched"] is None, "only the TP leader returns images"
    assert leader["vae_splits"] == other["vae_splits"] == IMAGE_CALLS[pipeline_class]["parallel_vae"]
    moved_inputs = float(np.abs(leader["inputs_control"] - leader["inputs_alone"][0]).max())
    moved = float(np.abs(leader["control"][0] - leader["alone"][0]).max())
    assert moved_inputs > 1e-2 and moved > TOLERANCE, (f"another input image moves the inputs by {moved_inputs:.1e}, "
                                                       f"the latents by {moved:.1e}: blind")
    assert len(leader["batched"]) == len(leader["inputs_batched"]) == len(batch_jobs.PROMPTS)
    for index, alone in enumerate(leader["alone"]):
        inputs = float(np.abs(leader["inputs_batched"][index] - leader["inputs_alone"][index]).max())
        difference = float(np.abs(leader["batched"][index] - alone).max())
        assert inputs < TOLERANCE and difference < TOLERANCE, (f"row {index}: inputs {inputs:.1e}, latents "
                                                                f"{difference:.1e} from the image made alone")


def test_a_batch_of_input_images_of_two_sizes_is_refused_on_every_rank(tp2_reports):
    for name in IMAGE_CALLS:
        leader, other = case(tp2_reports, f"images/{name}")
        assert leader["sizes"] == other["sizes"], name
        assert "the batch's input images differ in size (32x32, 48x32)" in leader["sizes"], leader["sizes"]


def test_reference_images_are_refused_in_a_batch_on_every_rank(tp2_reports):
    refusals = case(tp2_reports, "flux2/references")
    assert refusals[0] == refusals[1], refusals
    assert "Flux2Pipeline takes one set of input images for the whole call" in refusals[0]
    assert "Generate with batch_size=1" in refusals[0]


def test_h3_batch_is_refused_under_context_parallelism_on_every_rank(tp2_reports):
    refusals = case(tp2_reports, "h3/ulysses")
    assert refusals[0] == refusals[1], refusals
    assert "block-diagonal attention mask, which is not verified under context parallelism" in refusals[0]
    assert "Generate with batch_size=1" in refusals[0]


def test_bad_batch_arguments_are_refused_with_the_fix(tp2_reports):
    leader, other = case(tp2_reports, "arguments")
    assert leader == other
    assert "positive integer" in leader["batch_size"]
    assert "Got 2 seeds for 3 prompts" in leader["seeds"]
    assert "positive integers" in leader["batch_sizes"]


def test_cfg_pair_true_cfg_batch_equals_each_image_alone(four_rank_reports):
    made = case(four_rank_reports, "cfg")
    assert all(m["batched"] is None for m in made[1:]), "only the pair's leader returns images"
    assert_each_image_alone(made[0], "qwenimage tp=2 x cfg=2 (true CFG)")
    assert made[0]["forwards_batched"] == tiny.smallest_call("qwenimage")["num_inference_steps"]


def test_tp2_ulysses2_batch_equals_each_image_alone(four_rank_reports):
    made = case(four_rank_reports, "ulysses")
    assert all(m["batched"] is None for m in made[1:]), "only the image group's leader returns images"
    assert_each_image_alone(made[0], "flux tp=2 x ulysses=2")


def test_static_batch_sizes_pad_up_or_split():
    declared = check_batch_sizes([4, 1, 2])
    assert declared == (1, 2, 4)
    assert [padded_count(n, declared) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert resolve_batch_size(None, declared) == 4 and resolve_batch_size(8, declared) == 4
    assert resolve_batch_size(None, None) == 1
    assert split(list(range(5)), 2) == [[0, 1], [2, 3], [4]]


def test_rows_of_different_lengths_stack_right_padded_and_masked():
    import torch

    short = {"prompt_embeds": torch.ones(1, 2, 3), "prompt_embeds_mask": torch.ones(1, 2, dtype=torch.long)}
    long = {"prompt_embeds": torch.full((1, 4, 3), 2.0), "prompt_embeds_mask": torch.ones(1, 4, dtype=torch.long)}
    stacked = stack_rows([short, long])
    assert stacked["prompt_embeds"].shape == (2, 4, 3)
    assert stacked["prompt_embeds_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert stacked["prompt_embeds"][0, 2:].abs().sum() == 0


#: The compiled families and their buckets: Qwen-Image's prompts span two; MiniMax-H3's one (its text is 6 and
#: 114 rows: still two lengths a batch pads to one), which halves its warm-up's graphs (a minute at 2 CPU ranks).
COMPILED_BUCKETS = {"qwenimage": (64, 128), "h3": (128,)}


@pytest.fixture(scope="module")
def compiled_reports(tiny_checkpoint, rank_pool):
    return rank_pool.run(batch_jobs.batch_compile_job, 2,
                         {family: tiny_checkpoint(family) for family in COMPILED_BUCKETS},
                         {family: tiny.smallest_call(family) for family in COMPILED_BUCKETS}, COMPILED_BUCKETS,
                         timeout_s=900)


@pytest.mark.parametrize("family", COMPILED_BUCKETS)
def test_compiled_batches_of_one_to_four_compile_nothing_after_warmup(compiled_reports, family):
    leader, other = case(compiled_reports, family)
    assert leader["images"] == [1, 2, 3, 4] and other["images"] is None
    for report in (leader, other):
        assert report["graphs_after_warmup"] > 0, "nothing was compiled: the check is blind"
        assert report["new_graphs"] == 0 and report["new_recompiles"] == 0, report
        assert report["graph_breaks"] == 0, report


# -- the job: --batch-size ---------------------------------------------------------------------------------------

#: Four requests: 0, 1 and 3 compatible (packed into one call of 3), 2 with other steps (made alone).
JOB_LINES = [{"prompt": batch_jobs.PROMPTS[0]}, {"prompt": batch_jobs.PROMPTS[1], "seed": 40},
             {"prompt": batch_jobs.PROMPTS[2], "steps": 3}, {"prompt": "a small boat", "seed": 11}]


@pytest.fixture(scope="module")
def job_reports(tiny_checkpoint, rank_pool, tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("batch_job")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in JOB_LINES))
    call = tiny.smallest_call("flux")
    base = ["--model", str(tiny_checkpoint("flux")), "--prompts", str(prompts), "--tp", "2",
            "--steps", str(call["num_inference_steps"]), "--height", str(call["height"]), "--width", str(call["width"])]
    return rank_pool.run(batch_jobs.batch_job_checks, 2, str(root), base, timeout_s=900)


def test_pack_groups_compatible_items_in_order():
    from neuron_diffusers.batching import pack

    items = ["a1", "b1", "a2", "x", "a3", "b2", "x"]
    key = lambda item: None if item == "x" else item[0]  # noqa: E731
    assert pack(items, 2, key) == [["a1", "a2"], ["b1", "b2"], ["x"], ["a3"], ["x"]]
    assert pack(items, 1, key) == [[item] for item in items]


def test_job_batch_size_makes_each_image_as_the_unbatched_job(job_reports):
    alone = case(job_reports, "alone")[0]
    batched = case(job_reports, "batched")[0]
    by_file = {image["file"]: image for image in batched["outputs"]["summary"]["images"]}
    assert [image.get("batch", 1) for image in sorted(by_file.values(), key=lambda i: i["index"])] == [3, 3, 1, 3]
    # Calls in order: requests 0, 1, 3 in one call of 3 rows, then request 2 alone; unbatched: 0, 1, 2, 3.
    rows = {0: batched["latents"][0][0][0], 1: batched["latents"][0][0][1], 3: batched["latents"][0][0][2],
            2: batched["latents"][1][0][0]}
    moved = float(np.abs(alone["latents"][0][0][0] - alone["latents"][3][0][0]).max())
    assert moved > TOLERANCE, f"another request moves the latents by only {moved:.1e}: blind"
    for index, latents in rows.items():
        difference = float(np.abs(latents - alone["latents"][index][0][0]).max())
        assert difference < TOLERANCE, f"request {index}: {difference:.1e} from the unbatched job's"


def test_job_batch_size_keeps_files_settings_and_summary(job_reports):
    alone = case(job_reports, "alone")[0]["outputs"]
    batched = case(job_reports, "batched")[0]["outputs"]
    assert alone["settings"] == batched["settings"], "the settings inside each output (and its resume key) change"
    timing = {"seconds", "save_seconds", "batch"}
    records = [[{k: v for k, v in image.items() if k not in timing} for image in sorted(
        outputs["summary"]["images"], key=lambda i: i["index"])] for outputs in (alone, batched)]
    assert records[0] == records[1]


def test_job_batch_size_resumes_an_unbatched_folder(job_reports):
    assert case(job_reports, "resume")[0] == [0, 1, 2, 3]


def test_a_failing_batch_names_its_images_on_every_rank(job_reports):
    messages = case(job_reports, "failure")
    assert messages[0] == messages[1], messages
    assert "BatchError: A batch of 2 images failed (00000-a-red-fox-in-the-snow.png, 00001-a-lighthouse" in messages[0]
    assert "injected failure" in messages[0]


def test_job_packs_image_requests_of_one_kind_and_size():
    """Requests with input images share a call only on a class that takes one image per prompt, with images of one
    size, a mask each or none, one strength; a class that takes one set of images for the whole call makes each
    alone. A size the parallel VAE splits no longer matters (its batch decode is tested above)."""
    from neuron_diffusers.families import get, pipeline_record
    from neuron_diffusers.job import Request, batch_key
    from neuron_diffusers.media import InputImage

    def adapter(family, name):
        return get(family).adapter().for_pipeline(pipeline_record(get(family), name))

    def request(index, size=(32, 32), mask=False, strength=0.6):
        image = InputImage(f"{index}.png", f"{index:064d}", *size)
        return (Request(index=index, prompt="a fox", negative_prompt=None, seed=index, height=32, width=32, steps=3,
                        guidance=None, images=(image,), mask=image if mask else None, strength=strength), False)

    inpaint = adapter("flux", "FluxInpaintPipeline")
    first = batch_key(request(0, mask=True), inpaint)
    assert first is not None and batch_key(request(1, mask=True), inpaint) == first
    assert batch_key(request(2, size=(48, 32), mask=True), inpaint) != first
    assert batch_key(request(3, mask=True, strength=0.5), inpaint) != first
    assert batch_key(request(4), inpaint) != first
    assert batch_key(request(5), adapter("flux2", "Flux2Pipeline")) is None
    text = Request(index=0, prompt="a fox", negative_prompt=None, seed=0, height=32, width=32, steps=3, guidance=None)
    assert batch_key((text, False), get("h3").adapter()) is not None


def test_served_batch_gives_each_prompt_its_own_image():
    """The replica's one call for compatible image requests: a list with each prompt's image and mask, in order."""
    import io

    from image_jobs import input_image
    from PIL import Image

    from neuron_diffusers.serve.replica import _together, image_inputs

    def png(seed, size=(32, 32)):
        data = io.BytesIO()
        input_image(seed, size).save(data, format="PNG")
        return data.getvalue()

    tasks = [{"prompts": ["a", "b"], "seed": 5, "negative_prompt": None, "kwargs": {"strength": 0.6},
              "images": (png(1),), "mask": png(7)},
             {"prompts": ["c"], "seed": 9, "negative_prompt": None, "kwargs": {"strength": 0.6},
              "images": (png(2),), "mask": png(8)}]
    task = _together(tasks, 4)
    assert task["prompts"] == ["a", "b", "c"] and task["seed"] == [5, 6, 9]
    kwargs = image_inputs(task)
    expected = [input_image(seed) for seed in (1, 1, 2)]
    assert [image.tobytes() for image in kwargs["image"]] == [image.tobytes() for image in expected]
    assert [mask.tobytes() for mask in kwargs["mask_image"]] == [input_image(seed).tobytes() for seed in (7, 7, 8)]
    assert all(isinstance(image, Image.Image) for image in kwargs["image"])


def test_job_batch_size_is_refused_where_a_call_cannot_batch(generate_refuses):
    generate_refuses(["--model", "wan", "--prompt", "a fox", "--batch-size", "2"],
                     "--batch-size 2: Wan's call here returns one clip")


def test_a_step_cache_batches_in_the_job_and_load_pipeline():
    """A step cache is no reason to refuse a batch (it decides once per batched call, as stock does over the same
    batch: tests/test_cache.py), where the job and `load_pipeline(batch_sizes=...)` used to refuse it; Wan's
    refusal (the control) still stands."""
    from diffusers import FirstBlockCacheConfig

    from neuron_diffusers.cli import _parser
    from neuron_diffusers.launch import plan_launch, spec_for

    argv = ["generate", "--model", "flux", "--prompt", "a fox", "--out", "unused", "--batch-size", "2", "--compile",
            "aot_eager", "--cache", "first-block:0.1"]
    assert plan_launch(_parser().parse_args(argv), 1, "cpu").batch_sizes == (1, 2)  # the job's and the server's
    assert check_batch_sizes((2, 1), spec_for("flux", cache=FirstBlockCacheConfig(threshold=0.1))) == (1, 2)
    with pytest.raises(ValueError, match="Wan's call here returns one clip"):
        check_batch_sizes((1, 2), spec_for("wan"))


# -- bench throughput ----------------------------------------------------------------------------------------------

def test_bench_throughput_measures_batch_1_2_4_in_one_run(rank_pool, monkeypatch):
    """`bench throughput`'s path at tiny size, through its slice of a family's transformer (`--width tiny --blocks
    1`: the path `--width full` takes at the real width, built and loaded the same way): the ranks' measurements (on
    the session's pool instead of spawned ranks) become one table with images/s for batch 1, 2 and 4 side by side."""
    from neuron_diffusers.tools.bench import throughput

    def on_pool(fn, ranks, *args, timeout_s):
        return rank_pool.run(fn, ranks, *args, timeout_s=timeout_s)

    monkeypatch.setattr(throughput, "run_on_cpu_ranks", on_pool)
    with pytest.raises(ValueError, match="--model must be one of flux, flux2"):
        throughput.measure("h3", 2, steps=1, size=32, images=4, batches=[1], rounds=1, width="full")
    result = throughput.measure("flux", 2, steps=1, size=32, images=4, batches=[1, 2, 4], rounds=1, width="tiny",
                                blocks=1)
    assert list(result["batches"]) == ["1", "2", "4"]
    for row in result["batches"].values():
        assert row["images_per_second"] > 0 and row["latency_p95_s"] >= row["latency_p50_s"] > 0
    assert (result["width"], result["blocks"]) == ("tiny", 1) and result["transformer_params"] > 0
    table = throughput.format_table(result)
    assert "tiny-width slice, 1 block(s) of each kind" in table.splitlines()[0]
    assert [line.split("|")[1].strip() for line in table.splitlines()[3:]] == ["1", "2", "4"]
