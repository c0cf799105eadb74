"""`neuron-diffusers serve`: request checks and the HTTP layer in one process, then the real server under torchrun
(TP=2) in one fat test: the job's image for the same seed, concurrency, refusals, a full queue, SIGTERM."""

import asyncio
import base64
import dataclasses
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import lora_files
import numpy as np
import pytest
import rank_jobs
import serve_jobs
from fastapi.testclient import TestClient
from PIL import Image
from rank_cases import case
from torch.distributed import HashStore

from neuron_diffusers import tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.cli import main
from neuron_diffusers.job import Request, build_requests, settings_text
from neuron_diffusers.launch import check_guidance
from neuron_diffusers.media import png_bytes
from neuron_diffusers.outputs import model_identity, settings_key
from neuron_diffusers.parallel.lora import LoraSpec
from neuron_diffusers.serve import liveness
from neuron_diffusers.serve.app import EDITS, GENERATIONS, build_app
from neuron_diffusers.serve.channel import Channel
from neuron_diffusers.serve.files import ImageFiles
from neuron_diffusers.serve.liveness import Liveness
from neuron_diffusers.serve.metrics import Metrics
from neuron_diffusers.serve.request import EditRequest, ImageRequest, ServeConfig, Upload, plan_work
from neuron_diffusers.serve.scheduler import Scheduler
from neuron_diffusers.tools.bench.serve import ServerProcess

#: Every probe's client: `httpx.get` builds a client, and its SSL context, per call (~25 ms of CPU), and the waits
#: below probe every 50-200 ms. No keep-alive: each probe opens its own connection, as a fresh `httpx.get` does.
PROBES = httpx.Client(timeout=5, limits=httpx.Limits(max_keepalive_connections=0))


def _config(model="flux", sizes=None, cfg=1, pipeline=None):
    checkpoint = resolve(model, pipeline)
    return ServeConfig(checkpoint, checkpoint.adapter.size_limits(checkpoint), (32, 32), 2, 50, 2048 * 2048, 2, 1,
                       cfg, "float32", sizes=sizes)


@pytest.mark.parametrize("body, message", [
    ({"prompt": "a fox", "size": "100000x100000"}, "larger than this model"),
    ({"prompt": "a fox", "size": "33x32"}, "multiples of 16"),
    ({"prompt": "a fox", "num_inference_steps": 51}, "--max-steps"),
    ({"prompt": "a \ud800 fox"}, "unicode string"),  # pydantic refuses it itself
    ({"prompt": "a \x00 fox"}, "NUL"),
    ({"prompt": "   "}, "empty"),
    ({"prompt": "a fox", "seed": 2**64 - 1, "n": 2}, "64-bit"),
])
def test_bad_requests_are_refused_before_they_queue(body, message):
    with pytest.raises(ValueError, match=message):
        plan_work(ImageRequest.model_validate(body), _config())


def test_family_rules_and_compiled_sizes():
    with pytest.raises(ValueError, match="guidance-distilled"):
        plan_work(ImageRequest(prompt="a fox", negative_prompt="blur"), _config("flux2"))
    with pytest.raises(ValueError, match="request: 1 denoising step.*shift_terminal=0.02"):
        plan_work(ImageRequest(prompt="a fox", num_inference_steps=1), _config("qwenimage"))
    with pytest.raises(ValueError, match="compiled for 64x32 only"):
        plan_work(ImageRequest(prompt="a fox", size="32x32"), _config(sizes=((32, 64),)))
    work = plan_work(ImageRequest(prompt="a fox", size="64x32"), _config(sizes=((32, 64),)))
    assert work.kwargs == {"height": 32, "width": 64, "num_inference_steps": 2}
    # Qwen-Image's guidance_scale is its true_cfg_scale (the job's `guidance`); on a CFG-pair mesh it runs as a pair.
    work = plan_work(ImageRequest(prompt="a fox", negative_prompt="blur", guidance_scale=3.0),
                     _config("qwenimage", cfg=2))
    assert work.kwargs["true_cfg_scale"] == 3.0 and work.texts[0]["cfg"] == "2"


def _job_guidance(model, guidance=None, true_cfg_scale=None):
    """The job's rule on its flags (`generate --guidance G --true-cfg-scale T`)."""
    return check_guidance(resolve(model).adapter, {"--negative-prompt": None, "--guidance": guidance,
                                                   "--true-cfg-scale": true_cfg_scale})


def _server_guidance(model, guidance=None, true_cfg_scale=None):
    return plan_work(ImageRequest(prompt="a fox", guidance_scale=guidance, true_cfg_scale=true_cfg_scale),
                     _config(model)).kwargs


@pytest.mark.parametrize("apply, guidance, true_cfg", [(_job_guidance, "--guidance", "--true-cfg-scale"),
                                                       (_server_guidance, "guidance_scale", "true_cfg_scale")])
def test_the_job_and_the_server_refuse_two_different_qwenimage_guidances_by_one_rule(apply, guidance, true_cfg):
    """Qwen-Image's true CFG scale has two names (guidance, and stock's true_cfg_scale): given different values in
    one call they are refused with the same message in each one's own names. Controls: the same value twice is
    taken, and FLUX.1 (where the two are different settings) takes different values."""
    with pytest.raises(ValueError, match=f"QwenImagePipeline, {guidance} and {true_cfg} both set true_cfg_scale "
                                         r"and differ \(3 vs 4\): give one of them"):
        apply("qwenimage", guidance=3.0, true_cfg_scale=4.0)
    apply("qwenimage", guidance=3.0, true_cfg_scale=3.0)
    apply("flux", guidance=3.0, true_cfg_scale=4.0)


def _job_digest(tmp_path, *argv, line: dict | None = None) -> str:
    """The settings digest of `generate --model qwenimage ARGV` (or of one .jsonl `line`), planned on one rank: no
    weight is read, nothing is written."""
    from neuron_diffusers.cli import _parser
    from neuron_diffusers.job import plan_job

    prompts = ["--prompt", "a fox"]
    if line is not None:
        (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "a fox", **line}) + "\n")
        prompts = ["--prompts", str(tmp_path / "prompts.jsonl")]
    args = _parser().parse_args(["generate", "--model", "qwenimage", *prompts, "--negative-prompt", "blur",
                                 "--out", str(tmp_path / "out"), *argv])
    return plan_job(args, 1, "cpu").job_digest


def _server_digest(**guidance) -> str:
    work = plan_work(ImageRequest(prompt="a fox", negative_prompt="blur", seed=0, **guidance), _config("qwenimage"))
    return work.texts[0]["settings_digest"]


def _digests(tmp_path, where: str) -> list[str]:
    """Settings digests of true_cfg_scale 4, guidance 4 and guidance 5, as the job's flags, a job's line or a
    request."""
    if where == "job flags":
        return [_job_digest(tmp_path, flag, value) for flag, value in
                (("--true-cfg-scale", "4"), ("--guidance", "4"), ("--guidance", "5"))]
    if where == "job line":
        return [_job_digest(tmp_path, line={key: value}) for key, value in
                (("true_cfg_scale", 4.0), ("guidance", 4.0), ("guidance", 5.0))]
    return [_server_digest(**{key: value}) for key, value in
            (("true_cfg_scale", 4.0), ("guidance_scale", 4.0), ("guidance_scale", 5.0))]


@pytest.mark.parametrize("where", ["job flags", "job line", "server"])
def test_qwenimage_takes_true_cfg_scale_as_another_name_for_its_guidance(tmp_path, where):
    """Stock QwenImagePipeline's own kwarg name, true_cfg_scale, makes the same settings (digest) as the guidance
    option; control: another guidance makes another digest."""
    true_cfg, guidance, other = _digests(tmp_path, where)
    assert true_cfg == guidance
    assert other != guidance


def test_a_request_is_the_jobs_request_with_the_same_text_chunks():
    work = plan_work(ImageRequest(prompt="a red fox", n=3, seed=7, guidance_scale=3.5), _config())
    assert [r.seed for r in work.requests] == [7, 8, 9]
    job_request = Request(index=1, prompt="a red fox", negative_prompt=None, seed=8, height=32, width=32, steps=2,
                          guidance=3.5)
    assert work.requests[1] == job_request
    key = settings_key(job_request, model=model_identity("flux"), dtype="float32")
    assert work.texts[1] == settings_text(job_request, model="flux", pipeline="FluxPipeline", tp=2, dp=1, cfg=1,
                                          dtype="float32", loras=[], key=key)
    task = work.task()
    assert task["prompts"] == ["a red fox"] * 3 and task["seed"] == 7
    assert task["kwargs"] == {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 3.5}


def _fake_replica(channel: Channel, count: int):
    """Answers `count` tasks as a replica's leader would: one PNG per prompt, with the task's text chunks."""
    for number in range(1, count + 1):
        task = channel.receive_task(number)
        image = Image.new("RGB", (task["kwargs"]["width"], task["kwargs"]["height"]), "red")
        channel.send_result(number, {"images": [png_bytes(image, text) for text in task["texts"]],
                                     "phases": {"generate": 0.01}})


def test_health_says_how_often_torchrun_restarted_the_group(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    scheduler = Scheduler([Channel(0, HashStore())], max_queue=1, metrics=Metrics())
    client = TestClient(build_app(_config(), scheduler, Metrics(), request_timeout_s=0.5))
    assert client.get("/health").json() == {"status": "ok", "restarts": 2}


def test_http_layer_answers_refuses_and_queues_in_one_process():
    store = HashStore()
    metrics = Metrics()
    scheduler = Scheduler([Channel(0, store)], max_queue=1, metrics=metrics)
    client = TestClient(build_app(_config(), scheduler, metrics, request_timeout_s=0.5))
    assert client.get("/health").json() == {"status": "ok", "restarts": 0}
    assert client.get("/ready").status_code == 503
    assert client.post(GENERATIONS, json={"prompt": "a fox"}).status_code == 503  # still loading
    scheduler.ready.set()

    for body, expected in [('{"prompt": "a fox"', "not valid JSON"), ('{"prompt": "a fox", "colour": 1}', "colour"),
                           ('{"prompt": "a fox", "n": "2"}', "n: Input should be a valid integer"),
                           ('{"prompt": "a fox", "guidance_scale": NaN}', "finite"),
                           ('{"prompt": "a fox", "size": "big"}', "size")]:
        response = client.post(GENERATIONS, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, body
        assert expected in response.json()["error"]["message"] and response.json()["error"]["type"] == \
            "invalid_request_error"

    # No dispatcher runs yet: the first request waits in the queue (504 after the request timeout), the next finds
    # the queue full.
    assert client.post(GENERATIONS, json={"prompt": "a fox"}).status_code == 504
    full = client.post(GENERATIONS, json={"prompt": "a fox"})
    assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1

    replica = threading.Thread(target=_fake_replica, args=(Channel(0, store), 2))
    replica.start()
    scheduler.start()
    for _ in range(100):  # the queued request is taken (its client is gone: it still runs, nothing breaks)
        if scheduler.queued() == 0:
            break
        time.sleep(0.05)
    answer = client.post(GENERATIONS, json={"prompt": "a fox", "seed": 5, "response_format": "url"})
    replica.join(10)
    assert answer.status_code == 200, answer.text
    item = answer.json()["data"][0]
    assert item["seed"] == 5 and item["url"].startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(item["url"].partition(",")[2])))
    assert image.size == (32, 32) and image.text["seed"] == "5"
    metrics_text = client.get("/metrics").text
    assert "neuron_diffusers_images_total 1.0" in metrics_text
    assert 'neuron_diffusers_errors_total{kind="queue_full"} 1.0' in metrics_text
    scheduler.stop()
    assert Channel(0, store).receive_task(3) == {"stop": True}


def test_a_silent_rank_fails_health_the_queue_and_every_rank(monkeypatch):
    monkeypatch.setattr(liveness, "BEAT_S", 0.02)
    monkeypatch.setattr(liveness, "EXIT_GRACE_S", 0.2)
    store, metrics = HashStore(), Metrics()
    scheduler = Scheduler([Channel(0, store)], max_queue=2, metrics=metrics)
    scheduler.ready.set()
    client = TestClient(build_app(_config(), scheduler, metrics, request_timeout_s=5))
    exits = {0: [], 1: [], 2: [], 3: []}
    # Rank 2 leaves normally (its silence is no death); rank 1 beats, then goes silent as a killed process would;
    # rank 3 lives on and hears of it from rank 0.
    watchers = {rank: Liveness(store, rank, 4, 0.3, exit_process=exits[rank].append) for rank in (1, 2, 3)}
    watchers[0] = Liveness(store, 0, 4, 0.3, on_failure=scheduler.fail, exit_process=exits[0].append)
    for watcher in watchers.values():
        watcher.start()
    time.sleep(0.2)
    watchers[2].leave()
    time.sleep(0.6)
    assert watchers[0].failure is None and not any(exits.values())
    waiting = scheduler.submit({"prompts": ["a fox"]}, 1)  # no dispatcher runs: it waits in the queue
    watchers[1]._stop.set()  # rank 1 dies: no goodbye
    deadline = time.monotonic() + 10
    while not (exits[0] and exits[3]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert exits == {0: [1], 1: [], 2: [], 3: [1]}, exits
    assert "rank 1 is gone" in watchers[0].failure and watchers[3].failure == watchers[0].failure
    health = client.get("/health")
    assert health.status_code == 503 and "rank 1 is gone" in health.json()["error"]["message"]
    assert waiting.result(1)["error"]["status"] == 503
    refused = client.post(GENERATIONS, json={"prompt": "a fox"})
    assert refused.status_code == 503 and "rank 1 is gone" in refused.json()["error"]["message"]


def test_url_answers_are_kept_files_bounded_by_keep(tmp_path):
    store, metrics = HashStore(), Metrics()
    scheduler = Scheduler([Channel(0, store)], max_queue=4, metrics=metrics)
    scheduler.ready.set()
    (tmp_path / f"{'0' * 32}.png").write_bytes(b"an earlier run's image")  # counts toward --keep, oldest
    client = TestClient(build_app(_config(), scheduler, metrics, request_timeout_s=30,
                                  files=ImageFiles(tmp_path, keep=2)))
    replica = threading.Thread(target=_fake_replica, args=(Channel(0, store), 2))
    replica.start()
    scheduler.start()
    first = client.post(GENERATIONS, json={"prompt": "a fox", "seed": 1, "response_format": "url"}).json()
    second = client.post(GENERATIONS, json={"prompt": "a fox", "seed": 2, "n": 1, "response_format": "url"}).json()
    replica.join(10)
    scheduler.stop()
    urls = [first["data"][0]["url"], second["data"][0]["url"]]
    assert all(url.startswith("http://testserver/v1/images/files/") for url in urls), urls
    assert client.get(f"/v1/images/files/{'0' * 32}.png").status_code == 404  # dropped: over --keep 2
    for url, seed in zip(urls, (1, 2), strict=True):
        kept = client.get(url)
        assert kept.status_code == 200 and kept.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(kept.content)).text["seed"] == str(seed)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(url.rsplit("/", 1)[1] for url in urls)
    for name in ("..%2Fsecret.png", "x.png", "%2E%2E"):
        assert client.get(f"/v1/images/files/{name}").status_code == 404


def _png(size=(32, 32), colour="red") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def edits():
    """`POST /v1/images/edits` (multipart, OpenAI's) on an img2img server, with the queue it feeds."""
    store, metrics = HashStore(), Metrics()
    img2img = _config(pipeline="FluxImg2ImgPipeline")
    scheduler = Scheduler([Channel(0, store)], max_queue=4, metrics=metrics)
    scheduler.ready.set()
    return img2img, store, scheduler, metrics


def test_bad_edits_are_refused_before_they_queue(edits):
    img2img, _, scheduler, metrics = edits
    client = TestClient(build_app(img2img, scheduler, metrics, request_timeout_s=30))
    text_only = TestClient(build_app(_config(), scheduler, metrics, request_timeout_s=30))
    inpaint = TestClient(build_app(_config(pipeline="FluxInpaintPipeline"), scheduler, metrics, request_timeout_s=30))
    image = ("fox.png", _png(), "image/png")

    def refused(app_client, path, expected, **kwargs):
        response = app_client.post(path, **kwargs)
        assert response.status_code == 400, response.text
        assert expected in response.json()["error"]["message"], response.json()
        return response

    refused(text_only, EDITS, "FluxPipeline is a text-to-image class and takes no `image`",
            data={"prompt": "a fox"}, files={"image": image})
    refused(client, GENERATIONS, "/v1/images/edits", json={"prompt": "a fox"})
    refused(client, EDITS, "multipart/form-data", json={"prompt": "a fox"})
    refused(client, EDITS, "no `image` file", data={"prompt": "a fox"}, files={"mask": ("m.png", _png(), "image/png")})
    refused(client, EDITS, "unexpected file field 'other'", data={"prompt": "a fox"},
            files=[("image", image), ("other", ("x", b"x", "text/plain"))])
    refused(client, EDITS, "not an image PIL can read", data={"prompt": "a fox"},
            files={"image": ("fox.png", b"not a png", "image/png")})
    refused(client, EDITS, "colour", data={"prompt": "a fox", "colour": "red"}, files={"image": image})
    refused(client, EDITS, "(0, 1]", data={"prompt": "a fox", "strength": "2"}, files={"image": image})
    refused(client, EDITS, "finite", data={"prompt": "a fox", "strength": "nan"}, files={"image": image})
    refused(client, EDITS, "holds it as JSON", data={"prompt": "a fox", "loras": "ink"}, files={"image": image})
    refused(client, EDITS, "unknown LoRA 'ink'", data={"prompt": "a fox", "loras": '[{"name": "ink"}]'},
            files={"image": image})
    refused(client, EDITS, "takes one input image", data={"prompt": "a fox"}, files=[("image", image)] * 2)
    refused(TestClient(build_app(_config(sizes=((32, 32),)), scheduler, metrics, request_timeout_s=30)), EDITS,
            "compiled (--compile) for text-to-image", data={"prompt": "a fox"}, files={"image": image})
    refused(inpaint, EDITS, "give a mask of the image's size", data={"prompt": "a fox"},
            files={"image": image, "mask": ("mask.png", _png((16, 16), "white"), "image/png")})
    assert scheduler.queued() == 0  # nothing reached a replica


def test_a_good_edit_travels_to_the_replica_with_its_strength_and_image(edits):
    img2img, store, scheduler, metrics = edits
    client = TestClient(build_app(img2img, scheduler, metrics, request_timeout_s=30))
    replica = threading.Thread(target=_fake_replica, args=(Channel(0, store), 1))  # a fake replica answers here
    replica.start()
    scheduler.start()
    # 0.8, not FluxImg2ImgPipeline's default 0.6: a strength lost on the way would show in the image below.
    answer = client.post(EDITS, data={"prompt": "a red fox", "seed": "3", "strength": "0.8", "n": "1"},
                         files={"image": ("fox.png", _png(), "image/png")})
    replica.join(10)
    scheduler.stop()
    assert answer.status_code == 200, answer.text
    _, text = _b64_pixels(answer.json()["data"][0])
    assert text["strength"] == "0.8" and text["pipeline"] == "FluxImg2ImgPipeline" and "sha256" in text["images"]


@pytest.fixture(scope="module")
def edit_works(edits, tmp_path_factory):
    """The job's Request for an input file, and the server's work for the same upload: without a LoRA, and with the
    server's LoRA "ink" (--lora ink=PATH:0.5) picked by name at its own scale (1.5)."""
    img2img = edits[0]
    folder = tmp_path_factory.mktemp("edits")
    (folder / "fox.png").write_bytes(_png())
    job_request = build_requests([{"prompt": "a red fox", "_where": "line 1"}], seed=3, height=32, width=32, steps=2,
                                 guidance=None, negative_prompt=None, limits=img2img.limits,
                                 adapter=img2img.checkpoint.adapter, images=[folder / "fox.png"], strength=0.8)[0]
    work = plan_work(EditRequest(prompt="a red fox", seed=3, strength=0.8), img2img, (Upload("fox.png", _png()),))
    transformer = resolve("flux").transformer_class().from_pretrained(str(tiny.cached_tiny("flux")),
                                                                      subfolder="transformer")
    lora_path = lora_files.save_peft(folder / "ink.safetensors",
                                     lora_files.factors(lora_files.linears(transformer), 4, seed=1), alpha=4)
    with_lora = dataclasses.replace(img2img, loras={"ink": LoraSpec(lora_path, 0.5).record()})
    inked = plan_work(EditRequest(prompt="a red fox", seed=3, strength=0.8, loras=[{"name": "ink", "scale": 1.5}]),
                      with_lora, (Upload("fox.png", _png()),))
    return {"job_request": job_request, "plain": work, "lora": inked, "lora_path": lora_path, "with_lora": with_lora}


def test_an_edit_has_the_jobs_settings_digest(edit_works):
    job_request = edit_works["job_request"]
    key = settings_key(job_request, model=model_identity("flux"), dtype="float32", pipeline="FluxImg2ImgPipeline")
    assert edit_works["plain"].texts[0]["settings_digest"] == settings_text(
        job_request, model="flux", pipeline="FluxImg2ImgPipeline", tp=2, dp=1, cfg=1, dtype="float32", loras=[],
        key=key)["settings_digest"]


def test_a_request_picks_a_served_lora_by_name_with_the_jobs_settings(edit_works):
    with pytest.raises(ValueError, match="unknown LoRA 'oil': this server offers ink"):
        plan_work(EditRequest(prompt="a fox", loras=[{"name": "oil"}]), edit_works["with_lora"],
                  (Upload("fox.png", _png()),))
    job_request, record = edit_works["job_request"], LoraSpec(edit_works["lora_path"], 1.5).record()
    key = settings_key(job_request, model=model_identity("flux"), dtype="float32", pipeline="FluxImg2ImgPipeline",
                       loras=[{"sha256": record["sha256"], "scale": 1.5}])
    job_text = settings_text(job_request, model="flux", pipeline="FluxImg2ImgPipeline", tp=2, dp=1, cfg=1,
                             dtype="float32", loras=[record], key=key)
    # Everything alike but the input's path (the upload's name; the key holds its sha256 only).
    assert {**edit_works["lora"].texts[0], "images": None} == {**job_text, "images": None}


@pytest.fixture(scope="module")
def replica_made(edit_works, rank_pool):
    """The replica loop on a pool rank makes each edit (with the LoRA, without), and the job's call its image."""
    cases = {"lora": (edit_works["lora"].task(), [(edit_works["lora_path"], 1.5)]),
             "plain": (edit_works["plain"].task(), [])}
    return rank_pool.run(serve_jobs.replica_and_job, 1, "flux", "FluxImg2ImgPipeline", cases,
                         edit_works["job_request"], timeout_s=300)


@pytest.mark.parametrize("name", ["lora", "plain"])
def test_the_replica_makes_the_jobs_image_for_an_edit(replica_made, edit_works, name):
    served, job_pixels = case(replica_made, name)[0]
    served_image = Image.open(io.BytesIO(served))
    assert np.array_equal(np.asarray(served_image.convert("RGB")), job_pixels), "not the job's image"
    assert served_image.text["settings_digest"] == edit_works[name].texts[0]["settings_digest"]


def test_a_requests_lora_changes_the_replicas_image(replica_made):
    """The control of the test above: with and without the LoRA differ, so equal images there prove something."""
    images = [np.asarray(Image.open(io.BytesIO(case(replica_made, name)[0][0])).convert("RGB"))
              for name in ("lora", "plain")]
    assert not np.array_equal(*images), "the LoRA changed nothing: the comparison above would prove nothing"


@pytest.mark.parametrize("argv, message", [
    (["serve", "--compile", "--port", "0"], "--sizes"),
    (["serve", "--model", "h3", "--port", "0"], "generate"),
    (["serve", "--sizes", "32x33", "--port", "0"], "multiples of 16"),
    (["serve", "--ulysses", "2", "--port", "0"], "does not divide the world size 1"),
    (["serve", "--peer-timeout", "700", "--port", "0"], "Lower --peer-timeout"),
    (["serve", "--lora", "a=x.safetensors", "--lora", "a=y.safetensors", "--port", "0"], "a given twice"),
    (["serve", "--lora", "a=missing.safetensors", "--port", "0"], "missing.safetensors"),
    (["serve", "--pipeline", "FluxKontextPipeline", "--compile", "--sizes", "32x32", "--port", "0"],
     "change the compiled shapes"),
    (["bench", "serve", "--requests", "2000"], "bounded"),
])
def test_bad_command_lines_exit_2_before_anything_starts(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def _b64_pixels(item) -> tuple[np.ndarray, dict]:
    image = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
    return np.asarray(image.convert("RGB")), image.text


@pytest.fixture(scope="module")
def job_image(tmp_path_factory, rank_pool):
    """The job's image at TP=2, to compare the servers' with: `generate`'s own plan and run on the session's 2 ranks,
    as torchrun's ranks run them (no launch of its own: each costs seconds of imports)."""
    out = tmp_path_factory.mktemp("job")
    rank_pool.run(rank_jobs._job_outputs, 2, ["--prompt", "a red fox", "--seed", "7", "--steps", "2", "--tp", "2",
                                              "--out", str(out)], timeout_s=300)
    return Image.open(out / "00000-a-red-fox.png")


def test_server_under_torchrun_tp2(job_image):
    server = ServerProcess(2, ["--tp", "2", "--steps", "2", "--max-queue", "5"])
    try:
        server.wait_ready()
        url = server.url + GENERATIONS
        with httpx.Client(timeout=120) as client:
            first = client.post(url, json={"prompt": "a red fox", "seed": 7})
            assert first.status_code == 200, first.text
            pixels, text = _b64_pixels(first.json()["data"][0])
            assert np.array_equal(pixels, np.asarray(job_image.convert("RGB"))), "not the job's image"
            assert text["settings_digest"] == job_image.text["settings_digest"] and text["tp"] == "2"

            refused = [client.post(url, content=b'{"prompt": "a fox",', headers={"content-type": "application/json"}),
                       client.post(url, json={"prompt": "a fox", "size": "100000x100000"}),
                       client.post(url, json={"prompt": "a fox", "steps": 2})]
            assert [r.status_code for r in refused] == [400, 400, 400]
            assert all(r.json()["error"]["message"] for r in refused)
            assert client.post(url, json={"prompt": "a fox", "seed": 1}).status_code == 200

        # As many at once as the queue holds (5): all fit even if none has left the queue for the replica yet.
        async_answers = _concurrent(url, [{"prompt": f"fox {i}", "seed": i} for i in range(5)])
        assert [r.status_code for r in async_answers] == [200] * 5
        seeds = [r.json()["data"][0]["seed"] for r in async_answers]
        assert seeds == list(range(5))

        # A slow request keeps the replica busy while a burst fills the queue (5): the rest are answered 429.
        burst = _concurrent(url, [{"prompt": "slow fox", "num_inference_steps": 40}]
                            + [{"prompt": f"fox {i}"} for i in range(11)], stagger_s=0.3)
        codes = [r.status_code for r in burst]
        assert codes[0] == 200 and 429 in codes and set(codes) == {200, 429}, codes
        assert all(r.headers["retry-after"].isdigit() for r in burst if r.status_code == 429)
        metrics = PROBES.get(server.url + "/metrics").text
        assert 'neuron_diffusers_errors_total{kind="queue_full"}' in metrics

        # SIGTERM while a request is in flight: it is answered, and every rank exits 0 (so does torchrun).
        in_flight = []
        sender = threading.Thread(target=lambda: in_flight.extend(
            _concurrent(url, [{"prompt": "last fox", "num_inference_steps": 20}])))
        sender.start()
        _wait_busy(server.url)
        code = server.stop(ranks_only=True)
        sender.join(60)
        assert [r.status_code for r in in_flight] == [200]
        assert code == 0, "".join(server.lines[-40:])
    finally:
        if server.process.poll() is None:
            server.process.kill()


def _concurrent(url, bodies, stagger_s=0.0):
    """POST every body at once (the first `stagger_s` ahead of the others), answers in order."""
    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            first = asyncio.ensure_future(client.post(url, json=bodies[0]))
            await asyncio.sleep(stagger_s)
            rest = await asyncio.gather(*(client.post(url, json=body) for body in bodies[1:]))
            return [await first, *rest]

    return asyncio.run(run())


def _wait_busy(base_url, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "neuron_diffusers_busy_replicas 1.0" in PROBES.get(base_url + "/metrics").text:
            return
        time.sleep(0.05)
    raise AssertionError("no request became busy")



def _ranks_without_torchrun(serve_args: list[str]) -> tuple[list, list, list]:
    """Two `serve` ranks started one process each (as one pod per rank would be: no agent that stops the others):
    (the processes, rank 0's output lines as they come, when rank 0 logged that rank 1 is gone)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        master_port = probe.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
        ranks.append(subprocess.Popen([sys.executable, "-m", "neuron_diffusers", "serve", "--port", "0", *serve_args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    lines, failure_seen = [], []

    def read():
        for line in ranks[0].stdout:
            lines.append(line)
            if "rank 1 is gone" in line:
                failure_seen.append(time.monotonic())

    threading.Thread(target=read, daemon=True).start()
    return ranks, lines, failure_seen


def test_server_with_ulysses_and_a_rank_killed_while_idle(job_image):
    """Two ranks started without torchrun, serving with Ulysses: the job's TP=2 image, then rank 1 is SIGKILLed
    while the server idles. Rank 0 must notice it from the heartbeats alone, answer /health 503 (or be gone) and
    exit 1."""
    ranks, lines, failure_seen = _ranks_without_torchrun(["--tp", "1", "--ulysses", "2", "--steps", "2",
                                                          "--peer-timeout", "2"])
    try:
        url = _wait_ready(lines, ranks[0])
        with httpx.Client(timeout=120) as client:
            answer = client.post(url + GENERATIONS, json={"prompt": "a red fox", "seed": 7})
            assert answer.status_code == 200, answer.text
            pixels, text = _b64_pixels(answer.json()["data"][0])
            difference = np.abs(pixels.astype(int) - np.asarray(job_image.convert("RGB")).astype(int))
            assert difference.max() <= 1, difference.max()  # fp32 sums in another order: within one level
            assert (text["tp"], text["ulysses"], text["settings_digest"]) == \
                ("1", "2", job_image.text["settings_digest"])
            # 48x48 is 9 image tokens: Ulysses over 2 ranks cannot split them, refused before it queues.
            odd = client.post(url + GENERATIONS, json={"prompt": "a fox", "size": "48x48"})
            assert odd.status_code == 400 and "48x64" in odd.json()["error"]["message"], odd.text
            assert client.get(url + "/health").status_code == 200

        ranks[1].kill()
        killed = time.monotonic()
        health = []  # (when the request was sent, what came back)
        while time.monotonic() - killed < 60:
            exited = ranks[0].poll() is not None  # so the last request is sent after the exit, hence after the log
            asked = time.monotonic()
            try:
                health.append((asked, PROBES.get(url + "/health", timeout=2).status_code))
            except httpx.HTTPError:
                health.append((asked, "gone"))
            if exited:
                break
            time.sleep(0.05)
        assert ranks[0].wait(5) == 1, "".join(lines[-30:])
        assert time.monotonic() - killed < 2 + liveness.EXIT_GRACE_S + 10
        time.sleep(0.5)  # the reader thread takes the last lines
        assert failure_seen, "".join(lines[-30:])
        # Rank 0 logs the death only once /health says so: no request sent after that line may find it healthy.
        after = [status for asked, status in health if asked > failure_seen[0]]
        assert after and 200 not in after, health
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()


def _post(url: str, body: dict):
    """POST `body`: the response, or the transport error that came instead (a connection closed mid-request)."""
    try:
        return httpx.post(url, json=body, timeout=300)
    except httpx.HTTPError as error:
        return error


def test_a_rank_killed_while_a_request_is_in_flight_ends_every_rank_non_zero():
    """Two ranks started without torchrun, TP=2: rank 1 is SIGKILLed while the replica makes a long request, inside
    the denoising loop's collectives with rank 0. Every rank must exit non-zero within the documented bound,
    --peer-timeout + `EXIT_GRACE_S` (docs/serving.md), and the request in flight must be answered 503 with the reason
    (not a reset connection, and not a 500 as if the request itself had failed)."""
    peer_timeout = 30.0  # the default; a loaded machine stalls a loading rank's heartbeat thread for over 10 s
    ranks, lines, _ = _ranks_without_torchrun(["--tp", "2", "--steps", "2", "--max-steps", "100000",
                                               "--peer-timeout", str(peer_timeout)])
    try:
        url = _wait_ready(lines, ranks[0])
        answers = []
        sender = threading.Thread(target=lambda: answers.append(
            _post(url + GENERATIONS, {"prompt": "a red fox", "num_inference_steps": 20000})))
        sender.start()
        _wait_steps(lines, 2, "20000", ranks[0])  # rank 0's progress bar: both ranks are in the denoising loop
        assert not answers, f"the request was answered before the kill, so it was not in flight: {answers}"
        ranks[1].kill()
        killed = time.monotonic()
        bound = peer_timeout + liveness.EXIT_GRACE_S
        exits = _exit_times(ranks, killed, limit_s=bound + 60)
        sender.join(30)
        print(f"exit codes and seconds after the kill: {exits}")
        log = "".join(lines[-30:])
        assert [code for code, _ in exits] == [1, -signal.SIGKILL], (exits, log)
        assert all(seconds < bound for _, seconds in exits), (exits, bound, log)
        assert len(answers) == 1 and isinstance(answers[0], httpx.Response), (answers, log)
        assert answers[0].status_code == 503, (answers[0].text, log)
        error = answers[0].json()["error"]
        assert error["type"] == "server_error" and "the server is failing" in error["message"], error
        print(f"the request in flight: {answers[0].status_code} {error['message'][:200]}")
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()


def _wait_steps(lines, steps: int, total: str, rank0, timeout_s=300.0) -> None:
    """Until rank 0's progress bar (a line each update: the pipe is read with universal newlines) shows `steps` of
    `total` denoising steps done."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and rank0.poll() is None:
        done = [int(found) for line in lines[-20:] for found in re.findall(rf"(\d+)/{total}\b", line)]
        if done and max(done) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"the request did not reach step {steps}:\n" + "".join(lines[-30:]))


def _exit_times(processes, since: float, limit_s: float) -> list[tuple[int | None, float]]:
    """Each process's (exit code, seconds after `since` it was seen gone), polling every 50 ms for `limit_s`."""
    seen: dict[int, tuple[int, float]] = {}
    while len(seen) < len(processes) and time.monotonic() - since < limit_s:
        for index, process in enumerate(processes):
            if index not in seen and process.poll() is not None:
                seen[index] = (process.returncode, time.monotonic() - since)
        time.sleep(0.05)
    return [seen.get(index, (None, limit_s)) for index in range(len(processes))]


def _wait_ready(lines, rank0, timeout_s=300.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if rank0.poll() is not None:
            raise AssertionError("rank 0 exited while starting:\n" + "".join(lines[-30:]))
        url = next((line.split("listening on ")[1].split()[0] for line in lines if "listening on" in line), None)
        if url is not None:
            try:
                if PROBES.get(url + "/ready", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    raise AssertionError("the server was not ready in time:\n" + "".join(lines[-30:]))
