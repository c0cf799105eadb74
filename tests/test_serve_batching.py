"""`serve --max-batch`: compatible queued requests made in one batched `generate` call on a replica, each answered
with the job's image for its seed, and each with its own error.

The scheduler's grouping runs in one process against a fake replica. The server itself runs as its command runs it
(minus uvicorn: the app in process) on the session's pool of 2 ranks at TP=2 (`serve_jobs.batched_server`), beside
the job's images for the same prompts and seeds (`generate`'s own plan and run on the same ranks): no launch of its
own.
"""

import base64
import io
import json
import re
import threading
import uuid

import numpy as np
import pytest
import rank_jobs
import serve_jobs
from PIL import Image
from rank_cases import case
from torch.distributed import HashStore

from neuron_diffusers.cli import main
from neuron_diffusers.media import png_bytes
from neuron_diffusers.serve.channel import Channel
from neuron_diffusers.serve.metrics import Metrics
from neuron_diffusers.serve.scheduler import Scheduler

#: Four requests of different prompt lengths and seeds: compatible (same size, steps, guidance, no LoRA).
BODIES = [{"prompt": "a red fox", "seed": 7},
          {"prompt": "a lighthouse on a cliff at dusk, waves breaking on the rocks below", "seed": 8},
          {"prompt": "a small boat", "seed": 9},
          {"prompt": "an old library with tall shelves, warm lamps and a sleeping cat on a chair", "seed": 10}]
#: The control: the first prompt with another seed (the job's fifth image).
CONTROL = {"prompt": "a red fox", "seed": 11}
SERVE = ["--model", "flux", "--tp", "2", "--steps", "2", "--max-batch", "4", "--batch-wait-ms", "2000"]


def _batches(metrics_text: str) -> dict[tuple[int, int], float]:
    """/metrics' batch counter: (requests, images) -> tasks."""
    pattern = r'neuron_diffusers_batches_total\{images="(\d+)",requests="(\d+)"\} (\S+)'
    return {(int(requests), int(images)): float(count) for images, requests, count in re.findall(pattern, metrics_text)}


def _fake_replica(channel: Channel, tasks: list):
    """A replica's leader that records each task and answers each request with a PNG per prompt, until the stop."""
    number = 0
    while True:
        number += 1
        task = channel.receive_task(number)
        if task.get("stop"):
            return
        tasks.append(task)
        answers = [{"images": [png_bytes(Image.new("RGB", (16, 16)), text) for text in one["texts"]]}
                   for one in task.get("batch", [task])]
        result = {"answers": answers, "together": True} if "batch" in task else answers[0]
        channel.send_result(number, result)


def test_the_scheduler_batches_only_compatible_requests_up_to_max_batch_images():
    store, metrics = HashStore(), Metrics()
    scheduler = Scheduler([Channel(0, store)], max_queue=8, metrics=metrics, max_batch=4, batch_wait_s=0.0)
    scheduler.ready.set()

    def task(name: str, images: int = 1) -> dict:
        return {"prompts": [name] * images, "texts": [{"name": name}] * images}

    # Queued before the dispatcher starts: it finds them all at once (no wait needed).
    futures = [scheduler.submit(task("a1"), 1, "a"), scheduler.submit(task("b1"), 1, "b"),
               scheduler.submit(task("a2", 2), 2, "a"), scheduler.submit(task("x"), 1, None),
               scheduler.submit(task("a3", 2), 2, "a"), scheduler.submit(task("a4"), 1, "a")]
    tasks: list = []
    replica = threading.Thread(target=_fake_replica, args=(Channel(0, store), tasks))
    replica.start()
    scheduler.start()
    answers = [future.result(10) for future in futures]
    scheduler.stop()
    replica.join(10)
    made = [[one["prompts"][0] for one in t["batch"]] if "batch" in t else [t["prompts"][0]] for t in tasks]
    # a1 takes a2 (3 images) and a4 (4); a3 (2 more) does not fit; b1 and x are not compatible with a.
    assert made == [["a1", "a2", "a4"], ["b1"], ["x"], ["a3"]], made
    assert [t.get("batch_size") for t in tasks] == [4, 4, None, 4]  # x (key None) runs as without --max-batch
    assert [len(answer["images"]) for answer in answers] == [1, 1, 2, 1, 2, 1]
    assert [Image.open(io.BytesIO(answer["images"][0])).text["name"] for answer in answers] == \
        ["a1", "b1", "a2", "x", "a3", "a4"], "an answer went to another request"
    assert _batches(metrics.text().decode()) == {(3, 4): 1.0, (1, 1): 2.0, (1, 2): 1.0}


def test_max_batch_is_refused_where_a_call_cannot_batch(capsys):
    assert main(["serve", "--model", "wan", "--max-batch", "2", "--port", "0"]) == 2
    assert "--batch-size 2: Wan's call here returns one clip" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["serve", "--batch-wait-ms", "-1", "--port", "0"])
    assert "must be a number of at least 0" in capsys.readouterr().err


def test_a_compiled_server_declares_its_batch_shapes():
    """Static shapes: with --compile, --max-batch N declares 1, 2, 4, ..., N (what `load_pipeline` pads a short batch
    up to and `warmup` compiles); without it, none (a batch runs at its own size)."""
    from neuron_diffusers.cli import _parser
    from neuron_diffusers.serve.command import plan_server

    def planned(*argv: str):
        return plan_server(_parser().parse_args(["serve", "--sizes", "32x32", "--max-batch", "6", *argv]), 1, "cpu")

    compiled = planned("--compile", "aot_eager")
    assert compiled.launch.batch_sizes == (1, 2, 4, 6) and compiled.max_batch == 6
    assert planned().launch.batch_sizes is None
    cached = planned("--cache", "first-block:0.1")  # a step cache batches: one decision per batched call
    assert cached.max_batch == 6 and cached.launch.cache is not None


def _job(rank_pool, folder, lines: list[dict], *argv: str) -> dict:
    """`generate --prompts` (one .jsonl line per dict) at TP=2 on the pool's 2 ranks: each image's pixels in line
    order, and the images per call each was made in."""
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    outputs = rank_pool.run(rank_jobs._job_outputs, 2, ["--prompts", str(prompts), "--tp", "2", "--steps", "2",
                                                        "--out", str(folder / "out"), *argv], timeout_s=300)[0]
    images = sorted(outputs["summary"]["images"], key=lambda image: image["index"])
    return {"pixels": [np.asarray(Image.fromarray(outputs["pixels"][image["file"]]).convert("RGB"))
                       for image in images], "batch": [image.get("batch", 1) for image in images]}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, rank_pool):
    """The job's images for the bodies' prompts and seeds: made alone (`alone`: the bodies, then the control), and
    with --batch-size 4 (`batched`: the four bodies in one call, then the last three in one call, as the server's
    first two rounds batch them). A batch changes each image's latents by ~5e-7 (tests/test_batching.py shows them
    within 1e-5 of the image made alone), which can move a decoded pixel by one level: a batched answer is compared
    with the job's image from the same batch, an answer made alone with the job's image made alone."""
    return {"alone": _job(rank_pool, tmp_path_factory.mktemp("alone"), [*BODIES, CONTROL]),
            "batched": _job(rank_pool, tmp_path_factory.mktemp("batched"), [*BODIES, *BODIES[1:]],
                            "--batch-size", "4")}


@pytest.fixture(scope="module")
def served(rank_pool):
    return rank_pool.run(serve_jobs.batched_server, 2, f"test-{uuid.uuid4().hex}", SERVE, BODIES,
                         {"prompt": "a fox", "size": "100000x100000"}, 2**64, timeout_s=600)[0]


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _answered(answers) -> list:
    """Each HTTP answer's image pixels, or its (status, error message)."""
    return [_pixels(base64.b64decode(body["data"][0]["b64_json"])) if status == 200
            else (status, body["error"]["message"]) for status, body in answers]


def test_four_compatible_requests_at_once_are_one_batched_call(served):
    answers, metrics = case([served], "together")[0]
    assert [status for status, _ in answers] == [200] * 4, answers
    assert [body["data"][0]["seed"] for _, body in answers] == [7, 8, 9, 10]
    assert _batches(metrics) == {(4, 4): 1.0}, "not one call of the 4 requests"


def test_the_jobs_batches_are_the_servers(jobs):
    """The premise of comparing with the job's batched images: the job made them in the server's batches."""
    assert jobs["batched"]["batch"] == [4, 4, 4, 4, 3, 3, 3] and jobs["alone"]["batch"] == [1] * 5


def test_each_batched_answer_is_the_jobs_image_for_its_seed(served, jobs):
    answers, _ = case([served], "together")[0]
    images = _answered(answers)
    assert not np.array_equal(images[0], jobs["alone"]["pixels"][4]), "another seed gives the same image: blind"
    for index, image in enumerate(images):
        assert np.array_equal(image, jobs["batched"]["pixels"][index]), f"request {index}: not the job's image"


def test_a_bad_request_among_them_gets_its_400_and_the_others_their_images(served, jobs):
    answers, metrics = case([served], "bad_among")[0]
    images = _answered(answers)
    assert images[3][0] == 400 and "larger than this model" in images[3][1], images[3]
    for index, image in enumerate(images[:3]):
        assert np.array_equal(image, jobs["batched"]["pixels"][4 + index]), f"request {index + 1}: not the job's image"
    assert _batches(metrics) == {(4, 4): 1.0, (3, 3): 1.0}, "the three good requests were not one call"


def test_a_batch_mate_that_fails_on_the_replica_fails_alone(served, jobs):
    """A request refused inside `generate` (not by the front) fails its batch's call; each request is then made
    alone: its error reaches it only, the others get the job's images made alone."""
    results, metrics = case([served], "failing_mate")[0]
    assert results[2]["error"]["status"] == 400 and "seed" in results[2]["error"]["message"], results[2]
    for index in (0, 1, 3):
        assert np.array_equal(_pixels(results[index]["images"][0]), jobs["alone"]["pixels"][index]), f"request {index}"
    assert _batches(metrics) == {(4, 4): 1.0, (3, 3): 1.0, (1, 1): 4.0}, "not made one by one after the failure"


def test_every_rank_left_the_replica_loop_after_the_batches(served):
    # Three tasks (4, 3 and 4 requests): the stop came after them.
    assert served["tasks"] == 3
