"""Image inputs: shared test data and the rank jobs (run on the tests' rank pool), one a case or check."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from PIL import Image
from rank_cases import one_thread
from runner_jobs import _past_the_entry_check

PROMPT = "make the fox red"
NEGATIVE = "blurry"
# Qwen-Image-Edit-Plus resizes every input image to a 1024x1024 area for its VAE (the stock module's
# `VAE_IMAGE_SIZE`), ~10 s per image on one CPU thread. A test-only speed knob, set the same for the stock
# reference and the parallel run; the package never touches it.
EDIT_VAE_AREA = 64 * 64
# Kontext's own call kwargs: keep the 32x32 input and output instead of resizing both to ~1 MP (the CLI test runs
# the defaults). `_auto_resize` is stock's call parameter, passed through, not a private name we touch.
KONTEXT_SMALL = {"max_area": 32 * 32, "_auto_resize": False}

CASES = {
    "kontext": {"model": "flux", "class": "FluxKontextPipeline", "images": [1],
                "call": {"height": 32, "width": 32, "num_inference_steps": 2, **KONTEXT_SMALL}},
    "img2img": {"model": "flux", "class": "FluxImg2ImgPipeline", "images": [1],
                "call": {"height": 32, "width": 32, "num_inference_steps": 4, "strength": 0.5}},
    "inpaint": {"model": "flux", "class": "FluxInpaintPipeline", "images": [1], "mask": True,
                "call": {"height": 32, "width": 32, "num_inference_steps": 4, "strength": 0.6}},
    "edit_plus": {"model": "qwenimage_edit", "class": "QwenImageEditPlusPipeline", "images": [1, 2],
                  "call": {"height": 32, "width": 32, "num_inference_steps": 2}},
    # FLUX.2 refuses reference images under 64 px.
    "flux2": {"model": "flux2", "class": "Flux2Pipeline", "images": [1, 2], "size": (64, 64),
              "call": {"height": 32, "width": 32, "num_inference_steps": 2}},
    # `output_resolution` sizes the input image the VAE and the vision encoder see (default: 1 MP).
    "qwenimage21": {"model": "qwenimage21", "class": "QwenImage21Pipeline", "images": [1],
                    "call": {"height": 32, "width": 32, "num_inference_steps": 2, "output_resolution": 32}},
    # True CFG over a CFG pair (cfg=2, tp=1).
    "edit_plus_cfg": {"model": "qwenimage_edit", "class": "QwenImageEditPlusPipeline", "images": [1], "cfg": 2,
                      "negative": NEGATIVE,
                      "call": {"height": 32, "width": 32, "num_inference_steps": 2, "true_cfg_scale": 4.0}},
    # Parallel VAE (`load_pipeline(parallel_vae=True)`; the other cases pass False): every rank encodes a band of the
    # input image and decodes a band of the output. FLUX.1's AutoencoderKL, and Qwen-Image's causal 3D VAE with two
    # images and a vision-language encoder that reads them.
    "kontext_pvae": {"model": "flux", "class": "FluxKontextPipeline", "images": [1], "parallel_vae": True,
                     "call": {"height": 32, "width": 32, "num_inference_steps": 2, **KONTEXT_SMALL}},
    "edit_plus_pvae": {"model": "qwenimage_edit", "class": "QwenImageEditPlusPipeline", "images": [1, 2],
                       "parallel_vae": True, "call": {"height": 32, "width": 32, "num_inference_steps": 2}},
    # Rank 1 is given another image: both ranks must refuse.
    "diverged": {"model": "flux", "class": "FluxKontextPipeline", "images": [1], "other_image_on": [1],
                 "call": {"height": 32, "width": 32, "num_inference_steps": 2, **KONTEXT_SMALL}},
}
COMPARED = ("kontext", "img2img", "inpaint", "edit_plus", "flux2", "qwenimage21", "edit_plus_cfg", "kontext_pvae",
            "edit_plus_pvae")


def input_image(seed: int, size=(32, 32)) -> Image.Image:
    """A deterministic RGB picture with structure (gradients plus noise), so the VAE sees more than flat colour."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:size[1], 0:size[0]] / max(size)
    base = np.stack([x, y, (x + y) / 2], axis=-1) + 0.3 * rng.rand(size[1], size[0], 3)
    return Image.fromarray((np.clip(base, 0, 1) * 255).astype("uint8"))


def input_mask(size=(32, 32)) -> Image.Image:
    """White (repaint) on the lower half."""
    mask = np.zeros((size[1], size[0]), dtype="uint8")
    mask[size[1] // 2:] = 255
    return Image.fromarray(mask)


def case_inputs(case: dict, first_image: int | None = None) -> dict:
    """The image kwargs a case names (`first_image` replaces the first image's seed: the control)."""
    seeds = list(case["images"])
    if first_image is not None:
        seeds[0] = first_image
    images = [input_image(seed, case.get("size", (32, 32))) for seed in seeds]
    kwargs = {"image": images[0] if len(images) == 1 else images}
    if case.get("mask"):
        kwargs["mask_image"] = input_mask()
    return kwargs


def shrink_edit_vae_area() -> None:
    """The test-only speed knob (see `EDIT_VAE_AREA`)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    pipeline_qwenimage_edit_plus.VAE_IMAGE_SIZE = EDIT_VAE_AREA


@contextmanager
def counted_calls(module):
    """How often `module` runs (a list that grows by one per call); nothing counted where `module` is None."""
    calls = []
    handle = None if module is None else module.register_forward_pre_hook(lambda *_: calls.append(1))  # test probe
    try:
        yield calls
    finally:
        if handle is not None:
            handle.remove()


@contextmanager
def first_call_inputs(transformer):
    """What the transformer gets at its first call: `hidden_states` (noise and image latents) and
    `encoder_hidden_states` (the prompt embeddings, which the vision-language encoders compute from the images)."""
    seen = []

    def hook(module, args, kwargs):  # a test probe: a plain torch hook, removed below
        if not seen:
            seen.extend(kwargs[name].detach().cpu().clone() for name in ("hidden_states", "encoder_hidden_states"))

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def image_case_check(checkpoints: dict, case: dict) -> dict:
    """One case through `load_pipeline(..., pipeline_class=...)` and `generate(image=...)`: TP = world size, or
    cfg=2 x tp=world/2 for a case with `cfg`."""
    with one_thread():
        shrink_edit_vae_area()
        return _image_case(checkpoints, case)


def _image_case(checkpoints: dict, case: dict) -> dict:
    import torch.distributed as dist

    import neuron_diffusers as nd

    mesh = nd.init_distributed(cfg=case.get("cfg", 1))
    pipe = nd.load_pipeline(checkpoints[case["model"]], mesh, pipeline_class=case["class"],
                            parallel_vae=case.get("parallel_vae", False))
    kwargs = case_inputs(case, first_image=99 if dist.get_rank() in case.get("other_image_on", ()) else None)
    vae = getattr(pipe.pipe, "vae", None)
    entry = {"holds_vae": vae is not None, "holds_encoder": pipe.encoder is not None}
    call = {"seed": 0, "negative_prompt": case.get("negative"), "output_type": "np", **kwargs, **case["call"]}
    if "other_image_on" in case:  # the entry handshake refuses another image on every rank before anything runs
        try:
            pipe.generate([PROMPT], **call)
        except Exception as error:
            entry["entry_error"] = f"{type(error).__name__}: {error}"
    try:
        # Past the handshake (skipped for the case of another image), the shared VAE encoding still catches it.
        skipped = _past_the_entry_check() if "other_image_on" in case else nullcontext()
        with first_call_inputs(pipe.adapter.transformer_of(pipe.pipe)) as seen, skipped, \
                counted_calls(None if vae is None else vae.encoder) as encodes:
            images = pipe.generate([PROMPT], **call)
        entry["inputs"] = [t.numpy() for t in seen] if dist.get_rank() == 0 else None
        entry["vae_encoder_calls"] = len(encodes)
        entry["output"] = None if images is None else np.asarray(images[0], dtype=np.float32)
    except Exception as error:  # reported, so the test can assert every rank raised the same
        entry["error"] = f"{type(error).__name__}: {error}"
    vae = getattr(pipe.pipe, "vae", None)
    entry["vae_after_call"] = None if vae is None else type(vae).__name__
    if pipe.follower_vae is not None:  # what a rank without a VAE read: no encoder or decoder weight
        entry["follower_vae_real"] = sorted(n for n, t in pipe.follower_vae().state_dict().items() if not t.is_meta)
    entry["encode_prompt_restored"] = "encode_prompt" not in vars(pipe.pipe)
    return entry


def leader_failure_check() -> str:
    """A failure on the encoding rank (the leader) reaches every rank of the group."""
    import torch.distributed as dist

    from neuron_diffusers.pipelines.image_inputs import Group

    def fail():
        raise MemoryError("out of memory in the VAE")

    try:
        Group(dist.group.WORLD, None, torch.device("cpu")).share(fail)
        return "no error"
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def pair_share_check() -> dict:
    """A CFG pair of one-rank TP groups whose TP group computes itself (parallel VAE): CFG rank 0 computes, its
    partner receives over the pair and never computes."""
    import torch.distributed as dist

    from neuron_diffusers.pipelines.image_inputs import Group

    own_tp = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    computed = []

    def compute():
        computed.append(dist.get_rank())
        return torch.full((2, 3), float(dist.get_rank() + 1)), None

    shared, nothing = Group(own_tp, dist.group.WORLD, torch.device("cpu"), tp_computes=True).share(compute)
    return {"computed": computed, "shared": shared.tolist(), "none": nothing is None}
