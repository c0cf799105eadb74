"""`load_pipeline(...).generate(...)` checks that run on gloo ranks for tests/test_runner.py (module level, so the rank
pool can import them), and the helpers other rank jobs share: outputs as arrays, the models in memory, the entry
check skipped."""

from __future__ import annotations

import contextlib

PROMPT = "a red fox in the snow"


def _as_arrays(output):
    """A generated image or clip (`VideoWithAudio`) as numpy arrays, so it pickles small and compares: a float image
    (`output_type="np"`, before the 8-bit rounding) as it is, a PIL image in [0, 1]."""
    import numpy as np

    if hasattr(output, "frames"):
        return {"frames": output.frames.numpy(), "audio": None if output.audio is None else output.audio.numpy(),
                "fps": output.fps, "sampling_rate": output.sampling_rate}
    if isinstance(output, np.ndarray):
        return {"image": output.astype(np.float32)}
    return {"image": np.asarray(output, dtype=np.float32) / 255.0}


def float_call(family: str, call: dict) -> dict:
    """`call` asking for the float image, before the 8-bit rounding (MiniMax-H3's and Wan's clips are float
    already)."""
    return dict(call) if family in ("h3", "wan") else {**call, "output_type": "np"}


def _loaded_models():
    """Class names of the text encoders and VAEs alive in this process whose weights are really in memory."""
    import gc

    import transformers
    from diffusers import ModelMixin

    names = set()
    for obj in gc.get_objects():
        if isinstance(obj, transformers.PreTrainedModel) or (
            isinstance(obj, ModelMixin) and type(obj).__name__.startswith("Autoencoder")
        ):
            if any(p.device.type != "meta" for p in obj.parameters()):
                names.add(type(obj).__name__)
    return sorted(names)


@contextlib.contextmanager
def _past_the_entry_check():
    """`generate`'s entry handshake skipped, so per-rank arguments (a seed per rank) reach the checks behind it: the
    latent and CFG-branch checks must still catch what gets past (per-rank noise, nondeterministic kernels)."""
    from neuron_diffusers.consistency import CallEntry

    enter = CallEntry.enter
    CallEntry.enter = lambda self, arguments: None
    try:
        yield
    finally:
        CallEntry.enter = enter


def _refusals(pipe, family: str, call: dict) -> dict:
    """What `generate` says to inputs it owns (prompt embeddings, generator, latents) or cannot run."""
    refused = {}
    for name in ("prompt_embeds", "generator", "latents", "caption_upsample_temperature"):  # owned / cannot run
        try:
            pipe.generate("a red fox", **{name: None}, **call)
            refused[name] = "accepted"
        except ValueError as error:
            refused[name] = str(error)
    if family == "qwenimage":  # its schedule ends at shift_terminal: one step would be 0 / 0, refused up front
        try:
            pipe.generate("a red fox", **{**call, "num_inference_steps": 1})
            refused["one_step"] = "accepted"
        except ValueError as error:
            refused["one_step"] = str(error)
    return refused


def _divergence(pipe, call: dict) -> str:
    """A different seed per rank, past the entry check: the noise diverges across the group, and is caught."""
    import torch.distributed as dist

    from neuron_diffusers.consistency import LatentsDivergedError

    try:
        with _past_the_entry_check():
            pipe.generate(PROMPT, seed=dist.get_rank(), **call)
        return "not caught"
    except LatentsDivergedError as error:
        return str(error)


def runner_checks(family: str, checkpoint, call: dict) -> dict:
    """`load_pipeline(...).generate(...)` at TP=2 for one family, one case a key (`rank_cases.record`): the float
    output, who loaded what, divergence caught, inputs refused. A case that raises fails only its own test."""
    import gc

    from rank_cases import CaseError, record

    import neuron_diffusers as nd

    report = {}
    pipe = record(report, "load", nd.load_pipeline, checkpoint, nd.init_distributed(tp=2))
    if isinstance(pipe, CaseError):  # every case reports the failed load
        return dict.fromkeys(("output", "holds_encoder", "models_in_memory", "divergence", "refused"), pipe)
    del report["load"]
    outputs = record(report, "output", pipe.generate, PROMPT, seed=0, **float_call(family, call))
    if outputs is not None and not isinstance(outputs, CaseError):  # only the TP leader returns images
        record(report, "output", _as_arrays, outputs[0])
    report["holds_encoder"] = pipe.encoder is not None
    record(report, "models_in_memory", _loaded_models)
    record(report, "divergence", _divergence, pipe, call)
    record(report, "refused", _refusals, pipe, family, call)
    del pipe, outputs
    gc.collect()
    return report


def runner_lean_check(checkpoint, call: dict, plan: str = "lean") -> dict:
    """The lean plan (Qwen-Image-2.1), by name or from a plan file: modulation sharded too, the same float image."""
    from torch.distributed.tensor import DTensor

    import neuron_diffusers as nd

    pipe = nd.load_pipeline(checkpoint, nd.init_distributed(tp=2), plan=plan)
    outputs = pipe.generate(PROMPT, seed=0, **float_call("qwenimage21", call))
    modulation = pipe.adapter.transformer_of(pipe.pipe).modulation[1].weight
    return {"output": None if outputs is None else _as_arrays(outputs[0]),
            "modulation_sharded": isinstance(modulation, DTensor)}


def job_latents(argv: list[str]) -> list[dict]:
    """The `generate` job's own configuration, planned from `argv` as the CLI plans it (`plan_job`, on this process
    group), each of this replica's requests made through `load_pipeline(plan.launch)` with `output_type="latent"`:
    what the job's PNGs are decoded from. On a replica's leader, per request: its index, the stock call (prompt,
    negative prompt, seed, kwargs, input image paths) and the latents; elsewhere nothing."""
    import neuron_diffusers as nd
    from neuron_diffusers.cli import _parser
    from neuron_diffusers.distributed import cfg_rank, detect_runtime
    from neuron_diffusers.job import call_kwargs, pair_work, plan_job

    args = _parser().parse_args(["generate", *argv])
    runtime = detect_runtime()
    plan = plan_job(args, runtime.world_size, runtime.device_type)
    mesh = nd.init_distributed(tp=plan.tp, ulysses=plan.ulysses, ring=plan.ring, cfg=plan.cfg, order=plan.mesh_order)
    pipe = nd.load_pipeline(plan.launch, mesh)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    made = []
    for request, with_partner in pair_work(plan.requests[dp_rank::dp], plan, cfg_rank(mesh)):
        kwargs = call_kwargs(request, pipe.adapter)
        outputs = pipe.generate(request.prompt, seed=request.seed, negative_prompt=request.negative_prompt,
                                alone=not with_partner, output_type="latent", **request.image_kwargs(), **kwargs)
        if outputs is not None:
            made.append({"index": request.index, "prompt": request.prompt, "negative_prompt": request.negative_prompt,
                         "seed": request.seed, "kwargs": kwargs, "images": [image.path for image in request.images],
                         "latents": outputs[0].float().numpy()})
    return made
