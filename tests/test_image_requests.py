"""Image inputs from the outside: which classes run a folder, bad requests refused before any weight is read, the
job's --pipeline / --image / --mask / --strength and prompt-file keys (metadata, digests), the job at TP=2 on pool
ranks, and the tiny Qwen-Image-Edit-Plus checkpoint."""

import hashlib
import json
import shutil

import cli_jobs
import pytest
import runner_jobs
import torch
from image_jobs import PROMPT, input_image, input_mask
from PIL import Image
from test_runner import LATENT_TOLERANCE, max_diff, png_difference, png_matches, stock_latents

from neuron_diffusers import families, tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.cli import _parser, main
from neuron_diffusers.job import plan_job, settings_text
from neuron_diffusers.pipelines.image_inputs import check_image_kwargs, reads_image
from neuron_diffusers.runner import _check_cfg_parallel_kwargs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Input files: two images, a mask of their size, a mask of another size, a text file, a prompt file."""
    folder = tmp_path_factory.mktemp("inputs")
    input_image(1).save(folder / "in.png")
    input_image(2).save(folder / "other.png")
    input_mask().save(folder / "mask.png")
    input_mask((16, 16)).save(folder / "small-mask.png")
    (folder / "notes.txt").write_text("not an image")
    (folder / "sub").mkdir()
    lines = [{"prompt": "a", "image": "in.png"}, {"prompt": "b", "image": ["in.png", "other.png"]}, {"prompt": "c"}]
    (folder / "sub" / "prompts.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (folder / "sub" / "strength.jsonl").write_text('{"prompt": "d", "image": "in.png", "strength": 0.5}\n')
    shutil.copy(folder / "in.png", folder / "sub" / "in.png")
    shutil.copy(folder / "other.png", folder / "sub" / "other.png")
    return folder


def test_every_family_lists_its_own_class_first_and_tiny_names_are_buildable():
    for family in families.FAMILIES:
        if family.adapter is not None:
            assert family.pipelines[0].name == family.adapter.pipeline_class, family.name
    assert tiny.NAMES == (*tiny.FAMILIES, "qwenimage_edit")


def test_one_flux_folder_runs_the_image_classes_with_the_family_adapter():
    for name in ("FluxKontextPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"):
        checkpoint = resolve("flux", name)
        adapter = checkpoint.adapter
        assert (checkpoint.family.name, checkpoint.pipeline_class, adapter.pipeline_class) == ("flux", name, name)
        assert adapter.text_components == ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
        assert not adapter.own_class and not adapter.names_cfg_branches and not reads_image(adapter.pipeline_cls())
    import diffusers

    assert resolve("flux", diffusers.FluxKontextPipeline).pipeline_class == "FluxKontextPipeline"  # a class works too


def test_a_folder_of_another_class_is_found_by_its_transformer(tmp_path):
    edit = resolve("qwenimage_edit")
    assert (edit.family.name, edit.pipeline_class) == ("qwenimage", "QwenImageEditPlusPipeline")
    assert "processor" in edit.adapter.text_components and edit.adapter.record.references
    assert reads_image(edit.adapter.pipeline_cls())
    # A class no family lists, on a transformer we plan: runs with conservative defaults.
    index = json.loads((resolve("flux").path / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxControlPipeline"}))
    control = resolve(tmp_path)
    assert (control.family.name, control.pipeline_class) == ("flux", "FluxControlPipeline")
    assert not control.adapter.record.references and not control.adapter.names_cfg_branches


def test_classes_that_cannot_run_are_refused_naming_what_is_missing():
    with pytest.raises(ValueError, match="runs a Flux2Transformer2DModel, but .* holds a FluxTransformer2DModel"):
        resolve("flux", "Flux2Pipeline")
    with pytest.raises(ValueError, match=r"needs the component\(s\) processor, which .* does not have"):
        resolve("qwenimage", "QwenImageEditPlusPipeline")
    with pytest.raises(ValueError, match="not a stock diffusers pipeline class"):
        resolve("flux", "FluxKontextPipelin")
    with pytest.raises(ValueError, match="runs as a modular pipeline"):
        resolve("h3").adapter.for_pipeline(families.PipelineClass("FluxPipeline"))


def test_bad_image_kwargs_are_refused_before_anything_runs():
    flux, qwen, kontext = (resolve(*m).adapter for m in (("flux",), ("qwenimage",), ("flux", "FluxKontextPipeline")))
    inpaint, edit = resolve("flux", "FluxInpaintPipeline").adapter, resolve("qwenimage_edit").adapter
    image = input_image(1)
    text_to_image = "is a text-to-image class and takes no `image`: .*"
    cases = [
        (flux, dict(image=image), f"FluxPipeline {text_to_image}='FluxKontextPipeline'"),
        (qwen, dict(image=image), f"QwenImagePipeline {text_to_image}'QwenImageEditPlusPipeline'"),
        (kontext, dict(), "pass `image`"),
        (kontext, dict(image=image, strength=0.5), "takes no `strength`: .*--pipeline FluxImg2ImgPipeline"),
        (kontext, dict(image=[image, image]), "takes one input image, got 2"),
        (kontext, dict(image="in.png"), "must be a PIL image"),
        (inpaint, dict(image=image, strength=0.5), "pass `mask_image`"),
        (inpaint, dict(image=image, mask_image=input_mask((16, 16))), "mask is 16x16 but the image is 32x32"),
        (inpaint, dict(image=image, mask_image=input_mask(), strength=0.0), r"in \(0, 1\]"),
        (inpaint, dict(image=image, mask_image=input_mask(), strength=1.5), r"in \(0, 1\]"),
    ]
    for adapter, kwargs, message in cases:
        with pytest.raises((TypeError, ValueError), match=message):
            check_image_kwargs(adapter, **kwargs)
    assert check_image_kwargs(edit, image=(image, image)) == {"image": [image, image]}
    assert check_image_kwargs(flux) == {}


def test_cfg_parallelism_refuses_classes_that_do_not_name_their_branches():
    with pytest.raises(ValueError, match="calls its transformer outside `cache_context"):
        _check_cfg_parallel_kwargs(resolve("flux", "FluxKontextPipeline").adapter, "blurry", {"true_cfg_scale": 4.0})
    edit = resolve("qwenimage_edit").adapter
    assert _check_cfg_parallel_kwargs(edit, "blurry", {}), "Qwen-Image-Edit-Plus runs true CFG by default (4.0)"
    assert not _check_cfg_parallel_kwargs(edit, None, {}), "without a negative prompt there is no true CFG"


def _plan(tmp_path, *argv, world_size=1):
    args = _parser().parse_args(["generate", "--out", str(tmp_path / "out"), *argv])
    return plan_job(args, world_size, "cpu")


def _text(request, plan):
    return settings_text(request, model=plan.checkpoint.source, pipeline=plan.checkpoint.pipeline_class, tp=plan.tp,
                         dp=1, cfg=1, dtype=plan.dtype, loras=plan.loras, key=plan.keys[request.index])


def test_prompt_file_images_are_relative_to_it_and_recorded_with_their_digest(tmp_path, inputs):
    plan = _plan(tmp_path, "--prompts", str(inputs / "sub" / "prompts.jsonl"), "--model", "qwenimage_edit",
                 "--image", str(inputs / "other.png"))
    first, second, third = plan.requests
    digest = hashlib.sha256((inputs / "in.png").read_bytes()).hexdigest()
    assert [i.path for i in first.images] == [str(inputs / "sub" / "in.png")] and first.images[0].sha256 == digest
    assert [i.path for i in third.images] == [str(inputs / "other.png")]  # the command line's default
    assert len(second.images) == 2
    text = _text(second, plan)
    assert text["pipeline"] == "QwenImageEditPlusPipeline"
    assert json.loads(text["images"]) == [image.record() for image in second.images]
    assert "images" not in _text(_plan(tmp_path, "--prompt", "x").requests[0], plan)
    img2img = _plan(tmp_path, "--prompts", str(inputs / "sub" / "strength.jsonl"), "--pipeline", "FluxImg2ImgPipeline")
    assert img2img.requests[0].strength == 0.5
    assert _text(img2img.requests[0], img2img)["strength"] == "0.5"


BAD_INPUT = {
    "unreadable image": (["--pipeline", "FluxKontextPipeline", "--image", "{d}/missing.png"],
                         "Cannot read the input image"),
    "not an image": (["--pipeline", "FluxKontextPipeline", "--image", "{d}/notes.txt"], "is not an image PIL can read"),
    "mask of another size": (["--pipeline", "FluxInpaintPipeline", "--image", "{d}/in.png", "--mask",
                              "{d}/small-mask.png", "--strength", "0.5"], "mask is 16x16 but the image is 32x32"),
    "strength zero": (["--pipeline", "FluxImg2ImgPipeline", "--image", "{d}/in.png", "--strength", "0"],
                      r"must be a number in (0, 1]"),
    "strength above one": (["--pipeline", "FluxImg2ImgPipeline", "--image", "{d}/in.png", "--strength", "1.5"],
                           r"must be a number in (0, 1]"),
    "image to a text-to-image class": (["--image", "{d}/in.png"], "FluxPipeline is a text-to-image class"),
    "another transformer": (["--pipeline", "Flux2Pipeline"], "runs a Flux2Transformer2DModel"),
    "unknown class": (["--pipeline", "NoSuchPipeline"], "not a stock diffusers pipeline class"),
    "missing component": (["--model", "qwenimage", "--pipeline", "QwenImageEditPlusPipeline"],
                          "needs the component(s) processor"),
    "class needs an image": (["--pipeline", "FluxKontextPipeline"], "pass `image` (the CLI: --image PATH)"),
    "bad image key": (["--prompts", "{d}/bad.jsonl"], "'image' must be a path or a list of paths"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_image_requests_exit_2_before_anything_is_written(tmp_path, capsys, inputs, case):
    argv, message = BAD_INPUT[case]
    (inputs / "bad.jsonl").write_text('{"prompt": "a", "image": 3}\n')
    out = tmp_path / "out"
    argv = [a.format(d=inputs) for a in argv]
    if "--prompts" not in argv:
        argv += ["--prompt", "a fox"]
    assert main(["generate", *argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cfg_parallel_with_a_class_that_does_not_name_its_branches_is_refused(tmp_path, inputs):
    with pytest.raises(ValueError, match="--cfg-parallel cannot split FluxKontextPipeline's true CFG"):
        _plan(tmp_path, "--prompt", "a", "--pipeline", "FluxKontextPipeline", "--image", str(inputs / "in.png"),
              "--negative-prompt", "blurry", "--true-cfg-scale", "4", "--cfg-parallel", world_size=2)


def _kontext_argv(inputs, out) -> list[str]:
    return ["--pipeline", "FluxKontextPipeline", "--image", str(inputs / "in.png"), "--prompt", PROMPT, "--tp", "2",
            "--steps", "2", "--out", str(out)]


@pytest.fixture(scope="module")
def stock_kontext():
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline.from_pretrained(resolve("flux").path)


@pytest.fixture(scope="module")
def kontext_latents(rank_pool, inputs, tmp_path_factory):
    """The Kontext job's request as `load_pipeline` makes it from the same arguments at TP=2, as latents."""
    out = tmp_path_factory.mktemp("kontext-latents") / "out"
    leader, other = rank_pool.run(runner_jobs.job_latents, 2, _kontext_argv(inputs, out), timeout_s=600)
    assert other == [], "only the TP leader returns the latents"
    (made,) = leader
    return made


def test_kontext_job_configuration_gives_stock_latents(kontext_latents, stock_kontext, inputs):
    """The job's request at latent level within float32 rounding of stock's; another input image moves stock's
    latents by more (the control)."""
    stock = stock_latents(stock_kontext, kontext_latents)
    moved = max_diff(stock_latents(stock_kontext, kontext_latents, images=[inputs / "other.png"]), stock)
    assert moved > LATENT_TOLERANCE, f"blind: another input image moves the latents by only {moved:.1e}"
    difference = max_diff(kontext_latents["latents"], stock)
    assert difference < LATENT_TOLERANCE, f"latents differ from stock by {difference:.1e}"


def test_kontext_job_at_tp2_matches_stock_and_records_its_input(tmp_path, inputs, stock_kontext, kontext_latents,
                                                                rank_pool):
    """The job at TP=2 (its body on 2 pool ranks, `cli_jobs.on_pool`) with Kontext's defaults (the input is resized
    to ~1 MP for the VAE, as stock does): its PNG within one level per value (at most 0.5% differing) of stock's,
    which another input image falls outside."""
    out = tmp_path / "out"
    result = cli_jobs.on_pool(rank_pool, ["generate", *_kontext_argv(inputs, out)], 2)
    assert result["code"] == 0, result["err"][-4000:]
    png = Image.open(out / "00000-make-the-fox-red.png")
    assert png.text["pipeline"] == "FluxKontextPipeline" and png.text["tp"] == "2"
    digest = hashlib.sha256((inputs / "in.png").read_bytes()).hexdigest()
    assert json.loads(png.text["images"]) == [{"path": str(inputs / "in.png"), "sha256": digest}]

    def stock(image):
        with torch.no_grad():
            return stock_kontext(prompt=PROMPT, image=Image.open(image), **kontext_latents["kwargs"],
                                 generator=torch.Generator().manual_seed(0)).images[0]

    assert kontext_latents["kwargs"] == {"height": 32, "width": 32, "num_inference_steps": 2, "max_area": 32 * 32}
    reference, control = stock(inputs / "in.png"), stock(inputs / "other.png")
    assert not png_matches(control, reference), f"blind: another input image {png_difference(control, reference)}"
    ours = png.convert("RGB")
    assert png_matches(ours, reference), f"{png_difference(ours, reference)} (levels, fraction differing)"


def test_tiny_qwenimage_edit_builds_from_the_cli_and_its_vision_tower_reads_the_images(tmp_path):
    from diffusers import QwenImageEditPlusPipeline
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLProcessor

    assert main(["tiny", "qwenimage_edit", str(tmp_path / "edit")]) == 0
    pipe = QwenImageEditPlusPipeline.from_pretrained(tmp_path / "edit")
    assert isinstance(pipe.processor, Qwen2VLProcessor)
    assert isinstance(pipe.text_encoder, Qwen2_5_VLForConditionalGeneration)
    images = [input_image(1), input_image(2, size=(48, 32))]
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt("make it red", image=images, device="cpu")
        swapped, _ = pipe.encode_prompt("make it red", image=images[::-1], device="cpu")
        text_only, _ = pipe.encode_prompt("make it red", device="cpu")
    grid = pipe.processor.image_processor(images=[images[0].resize((384, 384))])["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]  # the condition size the pipeline uses -> 2x2 merged vision tokens
    assert embeds.shape[1] >= text_only.shape[1] + 2 * 4 and not torch.allclose(embeds, swapped)
    cached = load_file(next((resolve("qwenimage_edit").path / "transformer").glob("*.safetensors")))
    built = load_file(next((tmp_path / "edit" / "transformer").glob("*.safetensors")))
    assert cached.keys() == built.keys() and all(torch.equal(cached[k], built[k]) for k in cached)  # deterministic
