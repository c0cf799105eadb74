"""Stock pipelines no family of ours runs (SD3, Chroma, LTX-Video), on plans drafted at load, through one generic
adapter: `load_pipeline(...).generate(...)` at TP=2 equals the stock single-process pipeline at the latent level
(another prompt moves the latents by far more than the tolerance), the text encoders live on the leader only, the job
writes the image and the video, a server request is the job's image, and a class with no plan is refused before any
weight is read.

Why these three (`generic_pipelines.py`): three text encoders with pooled embeddings and per-block plan rules (SD3),
attention masks and a pipeline that packs its latents (Chroma), video frames from a 3-D VAE (LTX-Video).
"""

import json

import generic_jobs
import numpy as np
import pytest
import torch
from generic_jobs import PROMPT
from generic_pipelines import PIPELINES
from PIL import Image
from rank_cases import case

from neuron_diffusers import load_pipeline

#: float32, TP=2 against one process (measured: 7e-7 to 4e-6).
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("generic")
    built = {}
    for name, (build, _, _) in PIPELINES.items():
        build(root / name)
        built[name] = root / name
    return built


@pytest.fixture(scope="module")
def reports(checkpoints, rank_pool):
    calls = {name: call for name, (_, _, call) in PIPELINES.items()}
    return rank_pool.run(generic_jobs.generic_checks, 2, checkpoints, calls, timeout_s=900)


def stock_latents(checkpoint, name: str, prompt: str, call: dict | None = None) -> torch.Tensor:
    """The stock pipeline, alone in this process, loaded back with its own `from_pretrained`."""
    _, cls, default = PIPELINES[name]
    call = default if call is None else call
    torch.set_num_threads(1)
    pipe = cls.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(prompt, generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    return (out.frames if hasattr(out, "frames") else out.images)[0]


@pytest.mark.parametrize("name", list(PIPELINES))
def test_tp2_generate_equals_stock_single_process_latents(checkpoints, reports, name):
    reference = stock_latents(checkpoints[name], name, PROMPT)
    leader, other = case(reports, f"{name}/latents")
    control, _ = case(reports, f"{name}/control")
    assert other is None  # the leader returns the outputs
    assert (leader - reference).abs().max().item() < TOLERANCE
    # The control: another prompt through the same path moves the latents by far more than the tolerance.
    assert (control - reference).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("name", list(PIPELINES))
def test_drafted_plan_shards_the_transformer_and_only_the_leader_encodes(reports, name):
    leader, other = case(reports, f"{name}/roles")
    assert leader["family"] == other["family"] == f"{PIPELINES[name][1].__name__} (drafted plan)"
    assert leader["sharded"] > 0 and leader["sharded"] == other["sharded"]
    assert leader["encoder"] and not other["encoder"]
    assert not leader["holds_text_encoder"] and not other["holds_text_encoder"]


@pytest.mark.parametrize("name", list(PIPELINES))
def test_leader_decodes_what_the_pipeline_returns(reports, name):
    leader, other = case(reports, f"{name}/decoded")
    assert other is None
    output = leader[0]
    if name == "ltx":  # a video: the stock call's frames, 9 of them at 32 x 32
        assert len(output) == PIPELINES[name][2]["num_frames"] and output[0].size == (32, 32)
    else:
        assert isinstance(output, Image.Image) and output.size == (32, 32)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_divergent_noise_is_caught_at_the_first_step(reports, name):
    for message in case(reports, f"{name}/divergence"):
        assert "Latents differ across the tensor-parallel group" in message, message
        assert "rank 1" in message and "seed" in message


def test_inputs_generate_owns_are_refused_on_every_rank(reports):
    for refused in case(reports, "ltx/refused"):
        assert "encodes each prompt once on the group leader" in refused["prompt_embeds"]
        assert "repeat the prompt" in refused["num_images_per_prompt"]
        assert "`num_videos_per_prompt`: repeat the prompt" in refused["num_videos_per_prompt"]


#: SD3 under context parallelism: its joint attention splits the text with the image, and the text is CLIP's 77
#: positions plus T5's `max_sequence_length`: 77 + 19 = 96 splits over ulysses=2 (the default 256 does not).
CP_CALL = {**PIPELINES["sd3"][2], "max_sequence_length": 19}


@pytest.fixture(scope="module")
def cp_report(checkpoints, rank_pool):
    return rank_pool.run(generic_jobs.generic_cp_checks, 4, checkpoints["sd3"], CP_CALL, timeout_s=900)


def test_tp2_ulysses2_generate_on_routed_attention_equals_stock_single_process_latents(checkpoints, cp_report):
    """SD3's joint attention calls SDPA itself: the runner routes it through diffusers' dispatch (as the coverage
    table's proof does), so Ulysses splits it; the leader's latents equal one stock process, and another prompt moves
    them by far more than the tolerance."""
    reference = stock_latents(checkpoints["sd3"], "sd3", PROMPT, CP_CALL)
    latents, control = case(cp_report, "latents"), case(cp_report, "control")
    assert latents[1:] == [None] * 3 and control[1:] == [None] * 3  # the replica's leader returns the outputs
    assert (latents[0] - reference).abs().max().item() < TOLERANCE
    assert (control[0] - reference).abs().max().item() > 100 * TOLERANCE
    for routed, processors in case(cp_report, "routed"):
        assert routed == processors == 2  # both blocks' attention, through dispatch, with the parallel config


def test_a_text_length_that_does_not_split_is_named_on_every_rank(cp_report):
    for message in case(cp_report, "odd_text"):
        assert "encoder_hidden_states" in message and "333" in message, message


def test_the_job_writes_the_image_and_the_video(checkpoints, rank_pool, tmp_path):
    from neuron_diffusers.media import read_video_text

    outs = {}
    for name, extra in (("sd3", []), ("ltx", [])):
        outs[name] = tmp_path / name
        summary, _ = rank_pool.run(generic_jobs.generic_job, 2, [
            "--model", str(checkpoints[name]), "--prompt", PROMPT, "--out", str(outs[name]), "--tp", "2",
            "--height", "32", "--width", "32", "--steps", "2", *extra], timeout_s=900)
        assert len(summary["images"]) == 1
    png = Image.open(outs["sd3"] / json.loads((outs["sd3"] / "summary.json").read_text())["images"][0]["file"])
    assert png.size == (32, 32) and png.text["model"] == str(checkpoints["sd3"])
    mp4 = next(outs["ltx"].glob("*.mp4"))
    assert read_video_text(mp4, audio=False)["pipeline"] == "LTXPipeline"


def test_a_server_request_is_the_jobs_image(checkpoints, rank_pool):
    leader, other = rank_pool.run(generic_jobs.served_and_generated, 2, str(checkpoints["sd3"]), timeout_s=600)
    assert other is None
    served, generated = leader
    assert np.array_equal(served, generated)


def _json_only_folder(path, pipeline: str, component: str, model_class: str):
    """A `pipeline` folder with `component` (a `model_class`'s default config on the meta device), JSON files only
    and a weights file that is garbage: reading it would fail otherwise than the refusal."""
    import diffusers

    with torch.device("meta"):
        getattr(diffusers, model_class)().save_config(path / component)
    (path / component / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": pipeline, "_diffusers_version": "0.42.1", component: ["diffusers", model_class]}))
    return path


@pytest.mark.parametrize("pipeline, component, model_class, message", [
    # Its attention's Q/K/V are one fused projection with no declared packed layout: nothing can be split by heads.
    ("PRXPipeline", "transformer", "PRXTransformer2DModel",
     "PRXPipeline runs a PRXTransformer2DModel, for which no tensor-parallel plan can be drafted: .*to_q"),
    ("PixArtSigmaPipeline", "transformer", "PixArtTransformer2DModel",
     "PixArtSigmaPipeline takes no `callback_on_step_end`, which the check that every rank holds the same latents"),
    ("StableDiffusionPipeline", "unet", "UNet2DConditionModel",
     "StableDiffusionPipeline, which neuron_diffusers does not run: it splits a stock diffusers pipeline's "
     "`transformer`"),
])
def test_a_class_with_no_plan_is_refused_before_any_weight_is_read(tmp_path, monkeypatch, pipeline, component,
                                                                   model_class, message):
    import safetensors

    def no_reading(*args, **kwargs):
        raise AssertionError("a weight file was opened")

    monkeypatch.setattr(safetensors, "safe_open", no_reading)
    with pytest.raises(ValueError, match=message):
        load_pipeline(_json_only_folder(tmp_path, pipeline, component, model_class))


def test_the_job_refuses_a_degree_the_drafted_plan_does_not_split(checkpoints, tmp_path, generate_refuses,
                                                                   monkeypatch):
    # The tiny Chroma folder with full-size Chroma's transformer config: 24 heads, which 3 divides, but its drafted
    # rules split evenly over 1, 2, 4 and 8 ranks only. 3 ranks are not launched for a refusal: the world size is
    # faked (the check runs on the same path), and the weights (the tiny ones) are never read.
    import shutil

    from diffusers import ChromaTransformer2DModel

    monkeypatch.setenv("WORLD_SIZE", "3")
    folder = shutil.copytree(checkpoints["chroma"], tmp_path / "chroma")
    with torch.device("meta"):
        ChromaTransformer2DModel().save_config(folder / "transformer")
    generate_refuses(["--model", str(folder), "--prompt", "a fox", "--tp", "3"],
                     "splits evenly over 1, 2, 4, 8 ranks only, not tp=3")


def test_context_parallelism_is_refused_before_any_weight_where_no_cp_plan_was_verified(tmp_path, monkeypatch,
                                                                                        checkpoints):
    # Sana's linear attention has no SDPA call to route: no CP plan matched one process, and the table says why.
    import safetensors

    from neuron_diffusers.checkpoint import resolve
    from neuron_diffusers.launch import runner_mode

    def no_reading(*args, **kwargs):
        raise AssertionError("a weight file was opened")

    monkeypatch.setattr(safetensors, "safe_open", no_reading)
    folder = _json_only_folder(tmp_path, "SanaPipeline", "transformer", "SanaTransformer2DModel")
    index = json.loads((folder / "model_index.json").read_text())
    index.update(tokenizer=["transformers", "GemmaTokenizer"], text_encoder=["transformers", "Gemma2Model"],
                 vae=["diffusers", "AutoencoderDC"], scheduler=["diffusers", "DPMSolverMultistepScheduler"])
    (folder / "model_index.json").write_text(json.dumps(index))
    sana = resolve(folder)
    assert runner_mode(sana, (), 1, 1, False) is None  # tensor parallelism alone runs
    with pytest.raises(ValueError, match="SanaPipeline .drafted plan. cannot run with context parallelism .*"
                                         "SanaLinearAttnProcessor2_0 computes attention without scaled_dot_product"):
        runner_mode(sana, (), 2, 1, False)
    # Control: SD3's joint attention is routed, and its verified CP plan runs (tp2 x ulysses2 above).
    sd3 = resolve(str(checkpoints["sd3"]))
    assert runner_mode(sd3, (), 2, 1, False) is not None
    assert sd3.family.routes_attention and "transformer_blocks.0" in sd3.family.cp_plan
