"""Rank jobs for tests/test_batching.py: `generate(batch_size=...)` against each image made alone, on one pipeline.

Each job loads once and records its cases one by one (`rank_cases.record`); the leader's latents come back as
float32 numpy arrays, with the transformer forwards each way counted (a batch must share its forwards).
"""

from __future__ import annotations

#: Three prompts of different lengths: the long one crosses Qwen-Image's first text buckets; the first and last
#: tokenize to the same length (Qwen-Image-2.1 batches only rows of one text length into one call).
PROMPTS = ["a red fox in the snow",
           "a lighthouse on a cliff at dusk, waves breaking on black rocks below, gulls circling in a violet sky, "
           "warm light from the lantern room, oil painting with thick brush strokes and a heavy golden frame",
           "a red fox on the snow"]
SEED = 7


def _array(output):
    """An output as float32 numpy: latents (a tensor, or MiniMax-H3's dict of video and audio latents), or
    MiniMax-H3's decoded clip (its frames and audio)."""
    if hasattr(output, "frames"):
        return {"frames": output.frames.float().numpy(), "audio": output.audio.float().numpy()}
    if isinstance(output, dict):
        return {name: value.float().numpy() for name, value in output.items()}
    return output.float().numpy()


def _latents(outputs):
    return None if outputs is None else [_array(output) for output in outputs]


def _counting(pipe):
    """A list that grows by one per transformer forward on this rank, and the hook's handle."""
    calls = []
    transformer = pipe.adapter.transformer_of(pipe.pipe)
    return calls, transformer.register_forward_pre_hook(lambda module, args: calls.append(1))


def alone_and_batched(pipe, call: dict, negative: str | None = None, prompts=None, decoded: bool = False) -> dict:
    """Each prompt made alone (seed + i), the same prompts in one `generate(batch_size=len)`, and a control (prompt 0
    with another seed), all as latents (or `decoded`); the transformer forwards of the alone and the batched calls."""
    prompts = PROMPTS if prompts is None else prompts
    call = {**call, **({} if decoded else {"output_type": "latent"}),
            **({} if negative is None else {"negative_prompt": negative})}
    calls, handle = _counting(pipe)
    try:
        alone = [pipe.generate(prompt, seed=SEED + index, **call) for index, prompt in enumerate(prompts)]
        forwards_alone = len(calls)
        batched = pipe.generate(prompts, seed=SEED, batch_size=len(prompts), **call)
        forwards_batched = len(calls) - forwards_alone
    finally:
        handle.remove()
    control = pipe.generate(prompts[0], seed=SEED + 100, **call)
    return {"alone": None if alone[0] is None else [_latents(a)[0] for a in alone], "batched": _latents(batched),
            "control": _latents(control), "forwards_alone": forwards_alone, "forwards_batched": forwards_batched}


def _refusal(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except ValueError as error:
        return str(error)
    return "accepted"


def _argument_refusals(pipe, call: dict, checkpoint, mesh) -> dict:
    """What a bad `batch_size`, a seed list of the wrong length and bad `batch_sizes` are told."""
    import neuron_diffusers as nd

    return {"batch_size": _refusal(pipe.generate, PROMPTS, batch_size=0, **call),
            "seeds": _refusal(pipe.generate, PROMPTS, seed=[1, 2], **call),
            "batch_sizes": _refusal(nd.load_pipeline, checkpoint, mesh, batch_sizes=(0, 2))}


def batch_tp2_job(checkpoints: dict, calls: dict, image_calls: dict | None = None) -> dict:
    """At TP=2, per family: alone vs batched (`<family>`); the argument checks (`arguments`); MiniMax-H3's clips
    decoded (`h3/decoded`, under its default parallel VAE) and its batch refused under Ulysses=2 (`h3/ulysses`); the
    image families' batches decoded by the parallel VAE (`<family>/decoded`); FLUX.2's reference images refused in a
    batch (`flux2/references`); `image_calls` (FLUX.1 class -> call): prompts with their own input images, alone vs
    batched (`images/<class>`), and input images of two sizes refused (`images/sizes`)."""
    import gc

    from rank_cases import CaseError, one_thread, record

    import neuron_diffusers as nd

    report = {}
    with one_thread():
        mesh = nd.init_distributed(tp=2)
        for family, checkpoint in checkpoints.items():
            pipe = record(report, family, nd.load_pipeline, checkpoint, mesh)
            if isinstance(pipe, CaseError):
                continue
            record(report, family, alone_and_batched, pipe, calls[family])
            record(report, f"{family}/decoded", _decoded, pipe, calls[family])
            if family == "flux2":
                record(report, "flux2/references", _references_refusal, pipe, calls[family])
            if family == "flux":
                record(report, "arguments", _argument_refusals, pipe, calls[family], checkpoint, mesh)
            del pipe
            gc.collect()
        if "h3" in checkpoints:
            record(report, "h3/ulysses", _context_parallel_refusal, checkpoints["h3"], calls["h3"])
        for name, call in (image_calls or {}).items():
            record(report, f"images/{name}", _image_batch, checkpoints["flux"], mesh, name, call)
    return report


# -- image inputs: each prompt its own input image --------------------------------------------------------------

#: `image_jobs.input_image` seeds: one input image per prompt (all 32 x 32), and row 0's other image (the control).
IMAGE_SEEDS, CONTROL_IMAGE = (1, 2, 3), 11


def _masks(count: int) -> list:
    """A different inpainting mask per row: white (repaint) on the lower half, the upper half, the lower half..."""
    from image_jobs import input_mask
    from PIL import ImageOps

    return [input_mask() if index % 2 == 0 else ImageOps.flip(input_mask()) for index in range(count)]


def _image_batch(checkpoint, mesh, pipeline_class: str, call: dict) -> dict:
    """`pipeline_class` (`load_pipeline(pipeline_class=...)`; `parallel_vae` from the call): each prompt with its own
    input image (and mask) made alone, the same in one `generate(image=[...], batch_size=3)`, and the control (prompt
    0 with another input image); latents and the transformer's first-call `hidden_states` (noise and image latents)
    per row. Then input images of two sizes in one batch, refused."""
    from image_jobs import first_call_inputs, input_image

    import neuron_diffusers as nd

    call = dict(call)
    pipe = nd.load_pipeline(checkpoint, mesh, pipeline_class=pipeline_class, parallel_vae=call.pop("parallel_vae"))
    images = [input_image(seed) for seed in IMAGE_SEEDS]
    masks = _masks(len(images)) if "mask" in call else None
    call = {k: v for k, v in call.items() if k != "mask"} | {"output_type": "latent"}
    transformer = pipe.adapter.transformer_of(pipe.pipe)

    def make(prompts, seed, rows, **extra):
        kwargs = {"image": [images[i] if i >= 0 else input_image(CONTROL_IMAGE) for i in rows]}
        if masks is not None:
            kwargs["mask_image"] = [masks[max(i, 0)] for i in rows]
        if len(rows) == 1:
            kwargs = {name: value[0] for name, value in kwargs.items()}
        with first_call_inputs(transformer) as seen:
            made = pipe.generate(prompts, seed=seed, **kwargs, **call, **extra)
        return _latents(made), seen[0].float().numpy()

    alone = [make(prompt, SEED + index, [index]) for index, prompt in enumerate(PROMPTS)]
    batched = make(PROMPTS, SEED, list(range(len(PROMPTS))), batch_size=len(PROMPTS))
    control = make(PROMPTS[0], SEED, [-1])
    sizes = _refusal(pipe.generate, PROMPTS[:2], image=[images[0], input_image(1, (48, 32))], batch_size=2,
                     **({} if masks is None else {"mask_image": [masks[0], masks[1].resize((48, 32))]}), **call)
    leader = alone[0][0] is not None
    return {"alone": [a[0][0] for a in alone] if leader else None, "batched": batched[0],
            "control": control[0], "inputs_alone": [a[1][0] for a in alone], "inputs_batched": list(batched[1]),
            "inputs_control": control[1][0], "sizes": sizes,
            "vae_splits": pipe.parallel_vae is not None and pipe.parallel_vae.enabled}


def _references_refusal(pipe, call: dict) -> str:
    """What a batch of FLUX.2 prompts with reference images is told (stock gives every row the same references)."""
    from image_jobs import input_image

    return _refusal(pipe.generate, PROMPTS, image=input_image(1, (64, 64)), batch_size=3, **call)


# -- the parallel VAE: a batch decoded across the group ---------------------------------------------------------

#: Two prompts of one text length (Qwen-Image-2.1 makes them in one call): the batch its decode splits.
DECODED_PROMPTS = [PROMPTS[0], PROMPTS[2]]


def _decoded(pipe, call: dict) -> dict:
    """Images decoded by the parallel VAE (`pipe.parallel_vae` told to split every size), alone vs batched, as
    float tensors (MiniMax-H3: its clips, frames and audio); per decode on this rank, the decoder's input rows and
    batch and the rows its first convolution got (a band of them: split), FLUX.1 / FLUX.2 / Qwen-Image /
    Qwen-Image-2.1."""
    h3 = pipe.parallel_vae is not None and pipe.parallel_vae.strategy == "turns"
    if h3:  # MiniMax-H3 splits every clip by default; the three prompts of the latent case
        made = alone_and_batched(pipe, call, decoded=True)
        return {**made, "parallel_vae": pipe.parallel_vae.enabled}
    handle, vae = pipe.parallel_vae, pipe.adapter.vae(pipe.pipe)
    minimum, handle.min_pixels = handle.min_pixels, 0  # a tiny image splits too
    seen = []
    hooks = [vae.decoder.register_forward_pre_hook(lambda m, args: seen.append(["entry", *args[0].shape])),
             vae.decoder.conv_in.register_forward_pre_hook(lambda m, args: seen.append(["band", *args[0].shape]))]
    try:
        made = alone_and_batched(pipe, {**call, "output_type": "pt"}, prompts=DECODED_PROMPTS, decoded=True)
    finally:
        handle.min_pixels = minimum
        for hook in hooks:
            hook.remove()
    # Per decode: (batch, rows at the decoder's entry, rows its first convolution got on this rank).
    decodes = [(entry[1], entry[-2], band[-2]) for entry, band in zip(seen[::2], seen[1::2], strict=True)]
    return {**made, "decodes": decodes, "parallel_vae": handle.enabled}


def _context_parallel_refusal(checkpoint, call: dict) -> str:
    """What a batch of MiniMax-H3 on a Ulysses=2 mesh is told (its block-diagonal mask is not verified there)."""
    import neuron_diffusers as nd

    pipe = nd.load_pipeline(checkpoint, nd.init_distributed(ulysses=2))
    return _refusal(pipe.generate, PROMPTS, batch_size=3, **call)


def batch_4_ranks_job(cfg_checkpoint, cfg_call: dict, cp_checkpoint, cp_call: dict) -> dict:
    """On 4 ranks: true CFG on a CFG pair of TP=2 groups (`cfg`, with a negative prompt) and TP=2 x Ulysses=2
    (`ulysses`), alone vs batched."""
    import gc

    from rank_cases import CaseError, one_thread, record

    import neuron_diffusers as nd

    report = {}
    with one_thread():
        for name, checkpoint, call, layout, negative in (
                ("cfg", cfg_checkpoint, cfg_call, {"tp": 2, "cfg": 2}, "blurry, dark"),
                ("ulysses", cp_checkpoint, cp_call, {"tp": 2, "ulysses": 2}, None)):
            pipe = record(report, name, nd.load_pipeline, checkpoint, nd.init_distributed(**layout))
            if not isinstance(pipe, CaseError):
                record(report, name, alone_and_batched, pipe, call, negative)
            del pipe
            gc.collect()
    return report


#: Batches of 1 to 4 prompts of both text lengths (buckets 64 and 128 for Qwen-Image), after warm-up.
COMPILED_BATCHES = [[PROMPTS[0]], [PROMPTS[0], PROMPTS[1]], [PROMPTS[1], PROMPTS[2], PROMPTS[0]],
                    [PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[1]]]


def batch_compile_job(checkpoints: dict, calls: dict, buckets: dict, backend: str = "aot_eager") -> dict:
    """Per family (a case each): `load_pipeline(batch_sizes=(1, 2, 4), buckets=...)`, compiled and warmed up (a
    recompile raises), then `COMPILED_BATCHES`: graphs, recompiles and graph breaks counted from the family's start
    (dynamo reset first)."""
    from rank_cases import one_thread, record

    import neuron_diffusers as nd

    report = {}
    with one_thread():
        mesh = nd.init_distributed(tp=2)
        for family, checkpoint in checkpoints.items():
            record(report, family, _compiled_batches, mesh, checkpoint, calls[family], buckets[family], backend)
    return report


def _compiled_batches(mesh, checkpoint, call: dict, buckets: tuple, backend: str) -> dict:
    import torch

    import neuron_diffusers as nd
    from neuron_diffusers.compile import compile_repeated_blocks, compile_report, warmup

    torch._dynamo.reset()
    start = compile_report()
    pipe = nd.load_pipeline(checkpoint, mesh, buckets=buckets, batch_sizes=(1, 2, 4))
    compile_repeated_blocks(pipe, backend=backend)
    sizes = [(call["height"], call["width"])]
    steps = {k: v for k, v in call.items() if k not in ("height", "width")}
    guard = warmup(pipe, sizes, on_recompile="raise", **steps)
    try:
        warm = compile_report()
        made = [pipe.generate(batch, seed=SEED, output_type="latent", **call) for batch in COMPILED_BATCHES]
    finally:
        guard.remove()
    after = compile_report()
    return {"graphs_after_warmup": warm["graphs"] - start["graphs"], "new_graphs": after["graphs"] - warm["graphs"],
            "new_recompiles": after["recompiles"] - warm["recompiles"],
            "graph_breaks": after["graph_breaks"] - start["graph_breaks"],
            "images": None if made[0] is None else [len(images) for images in made]}


def _failing_batch(argv: list[str]) -> str:
    """The job with every multi-image stock call failing: what every rank is told."""
    from rank_jobs import _job_outputs

    from neuron_diffusers.pipelines.base import StockPipelineAdapter

    call = StockPipelineAdapter.__call__

    def failing(self, pipe, embeds, *, generator, **kwargs):
        if isinstance(generator, list):
            raise RuntimeError("injected failure")
        return call(self, pipe, embeds, generator=generator, **kwargs)

    StockPipelineAdapter.__call__ = failing
    try:
        _job_outputs(argv)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    finally:
        StockPipelineAdapter.__call__ = call
    return "no failure"


def _resumed(argv: list[str]) -> list[int]:
    """The requests a `--batch-size` job planned over a folder an unbatched job filled finds already done."""
    from neuron_diffusers.cli import _parser
    from neuron_diffusers.distributed import detect_runtime
    from neuron_diffusers.job import plan_job

    args = _parser().parse_args(["generate", *argv])
    return sorted(plan_job(args, detect_runtime().world_size, "cpu").done)


def batch_job_checks(out_root: str, base: list[str]) -> dict:
    """The `generate` job at TP=2 over the same prompts: unbatched (`alone`), with --batch-size 3 (`batched`), each
    with its latents per image (`cfg_jobs.job_with_latents`); the batched plan over the unbatched folder (`resume`);
    a failing batch (`failure`)."""
    from cfg_jobs import job_with_latents
    from rank_cases import one_thread, record

    report = {}
    with one_thread():
        record(report, "alone", job_with_latents, [*base, "--out", f"{out_root}/alone"])
        record(report, "batched", job_with_latents, [*base, "--out", f"{out_root}/batched", "--batch-size", "3"])
        record(report, "resume", _resumed, [*base, "--out", f"{out_root}/alone", "--batch-size", "3"])
        record(report, "failure", _failing_batch, [*base, "--out", f"{out_root}/failing", "--batch-size", "2"])
    return report
