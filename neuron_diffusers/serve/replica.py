"""The loop every rank runs while serving: take its replica's next task, make it together with the replica's other
ranks, and (on the replica's leader) answer with the PNGs or the error.

Every rank of the replica reads the same task and makes the same `generate` call, so the reliability machinery of
`generate` applies as it is: the entry handshake, every argument checked on every rank, and a failure on one rank
(the leader encodes and decodes) raised alike on all of them. A bad request therefore fails on the whole replica
and the replica goes on with the next one; in a batch of requests (`--max-batch`) its batch-mates are then made
again one by one, so they get their images and it its error (`make`). Only a lost peer
(`torch.distributed.DistError`) ends the loop: the process group is then unusable, and the server must exit
(non-zero) rather than answer wrongly.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import PIL.Image
import torch.distributed as dist

from ..distributed import is_replica_leader
from ..media import png_bytes
from ..parallel.lora import LoraSpec
from ..runner import ParallelPipeline
from .channel import Channel


def serve_replica(pipe: ParallelPipeline, channel: Channel, give_up: Callable[[], bool] = lambda: False) -> int:
    """Make tasks until the stop task comes; returns how many were made. `give_up` ends a wait for the next task
    (a `TimeoutError`), e.g. when a SIGTERM came and rank 0 did not say stop in time."""
    leader = is_replica_leader(pipe.mesh)
    number = 0
    while True:
        task = channel.receive_task(number + 1, give_up)
        if task.get("stop"):
            return number
        number += 1
        result = make(pipe, task, leader)
        if leader:
            channel.send_result(number, result)


def make(pipe: ParallelPipeline, task: dict, leader: bool) -> dict | None:
    """One task's `generate` call; the leader returns the answer: PNG bytes (with the task's text chunks) and the
    seconds per phase, or the error every rank raised.

    A batch task (`{"batch": [task, ...], "batch_size": N}`, from `--max-batch`) makes its requests' images in one
    call, each from its own seeds; if that call fails (every rank raises the same error, so every rank sees it), each
    request is made again on its own, so only a request's own error reaches it (its batch-mates get their images).
    The answer is then one per request (`answers`), and `together` says whether they came from the one call."""
    tasks = task.get("batch", [task])
    before = dict(pipe.times.seconds)
    start = time.perf_counter()
    outputs, error = _generate(pipe, _together(tasks, task.get("batch_size")))
    together = error is None or len(tasks) == 1
    if together:
        made, first = [], 0
        for one in tasks:
            made.append((None if outputs is None else outputs[first:first + len(one["prompts"])], error))
            first += len(one["prompts"])
    else:  # a batch-mate's error: each request alone, as without --max-batch
        made = [_generate(pipe, one) for one in tasks]
    if not leader:
        return None
    generated = time.perf_counter()
    answers = [{"error": error_record(failure)} if failure is not None else
               {"images": [png_bytes(image, text) for image, text in zip(images, one["texts"], strict=True)]}
               for one, (images, failure) in zip(tasks, made, strict=True)]
    phases = {name: value - before.get(name, 0.0) for name, value in pipe.times.seconds.items()}
    phases = {"generate": generated - start, "png": time.perf_counter() - generated,
              **{name: round(value, 6) for name, value in phases.items() if value > 0}}
    if "batch" not in task:
        return answers[0] if "error" in answers[0] else {**answers[0], "phases": phases}
    return {"answers": answers, "phases": phases, "together": together}


def _together(tasks: list[dict], batch_size: int | None) -> dict:
    """One `generate` call's task for compatible `tasks` (equal `Work.batch_key`: the same call kwargs and LoRAs, the
    same kind and size of image inputs, all with a negative prompt or none): their prompts in order, each image's own
    seed (`seed + i`, `batching.seeds_for`'s rule, written out here: seeds_for checks, and a bad seed must fail
    inside `generate`'s error handling, its request alone), and (image inputs) each prompt's own input image and mask
    (`per_prompt`)."""
    if len(tasks) == 1:
        return {**tasks[0], "batch_size": batch_size}
    first = tasks[0]
    negatives = None if first["negative_prompt"] is None else [
        one["negative_prompt"] for one in tasks for _ in one["prompts"]]
    per_prompt = None
    if first.get("images"):
        per_prompt = [(one["images"], one.get("mask")) for one in tasks for _ in one["prompts"]]
    return {**first, "prompts": [prompt for one in tasks for prompt in one["prompts"]],
            "seed": [one["seed"] + index for one in tasks for index in range(len(one["prompts"]))],
            "negative_prompt": negatives, "batch_size": batch_size, "per_prompt": per_prompt}


def _generate(pipe: ParallelPipeline, task: dict) -> tuple[list | None, Exception | None]:
    """The task's images (on the leader; None elsewhere), or the error every rank of the replica raised."""
    try:
        _select_loras(pipe, task.get("loras", ()))
        return pipe.generate(task["prompts"], seed=task["seed"], negative_prompt=task["negative_prompt"],
                             batch_size=task.get("batch_size"), **task["kwargs"], **image_inputs(task)), None
    except dist.DistError:  # a peer is gone: nothing is left to agree with
        raise
    except Exception as error:  # the same on every rank of the replica (see `ParallelPipeline.generate`)
        return None, error


def _select_loras(pipe: ParallelPipeline, loras) -> None:
    """Fuse the task's LoRAs when they are not the ones fused now (`set_loras` switches in place, agreed by the
    replica's ranks: a LoRA that fails fails alike on all of them and leaves the previous set)."""
    wanted = [LoraSpec(source, scale) for source, scale in loras]
    if wanted != (pipe.loras.active if pipe.loras is not None else []):
        pipe.set_loras(wanted)


def error_record(error: BaseException) -> dict:
    """What the HTTP side answers for `error`: a bad request (`ValueError`) is the client's (400), anything else is
    the server's (500); the message says which exception it was."""
    client = isinstance(error, ValueError)
    return {"status": 400 if client else 500, "type": "invalid_request_error" if client else "server_error",
            "kind": "invalid_request" if client else type(error).__name__, "message": str(error)}


def image_inputs(task: dict) -> dict:
    """A task's image kwargs for `generate`: one image or a list of reference images, and the mask (each rank decodes
    the same bytes, which rank 0 already decoded once to check them); for batched requests (`per_prompt`), a list with
    each prompt's one image (and mask)."""
    if task.get("per_prompt"):
        rows = [{"image": open_image(images[0]), "mask_image": None if mask is None else open_image(mask)}
                for images, mask in task["per_prompt"]]
        return {"image": [row["image"] for row in rows]} | (
            {} if rows[0]["mask_image"] is None else {"mask_image": [row["mask_image"] for row in rows]})
    images = [open_image(data) for data in task.get("images", ())]
    kwargs = {"image": images[0] if len(images) == 1 else images} if images else {}
    if task.get("mask") is not None:
        kwargs["mask_image"] = open_image(task["mask"])
    return kwargs


def open_image(data: bytes) -> PIL.Image.Image:
    image = PIL.Image.open(io.BytesIO(data))
    image.load()
    return image
