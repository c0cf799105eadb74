"""The HTTP side (FastAPI, on global rank 0): OpenAI's `POST /v1/images/generations` and `POST /v1/images/edits`
(a multipart form with the input `image` files and a `mask`), `GET /v1/images/files/{name}` (the images of
`response_format: "url"` with `--out`, see `files.py`), `GET /health`, `GET /ready`, `GET /metrics`.

Every refusal is a JSON body in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): 400 for a body
that is not valid JSON, has unknown fields, values of the wrong type or out of range, or settings the model cannot
make; 429 with Retry-After when the queue is full; 503 while loading or shutting down; 504 when a request took longer
than `--request-timeout` (its replica still finishes it, and the next request is unaffected). A request the server
accepted never puts a replica out of step: the replica validates and decides together (see `replica.py`).

Reading order: `build_app` puts together the request counter, the error handlers, the probes' routes and the image
routes. An image route only turns its body into `Work` (`plan_work`); `_Answers` queues it and shapes the answer.
Whatever refuses or fails a generation request raises `GenerationError`, and one handler answers it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException

from ..distributed import group_restarts
from .files import ImageFiles
from .metrics import Metrics
from .request import MAX_IMAGES, MAX_UPLOAD_BYTES, EditRequest, ImageRequest, ServeConfig, Upload, Work, plan_work
from .scheduler import NotAccepting, QueueFull, Scheduler

GENERATIONS = "/v1/images/generations"
EDITS = "/v1/images/edits"
FILES = "/v1/images/files"
#: The form's file fields: `image` (repeated, or OpenAI's `image[]`, for reference images) and `mask`.
IMAGE_FIELDS = ("image", "image[]")


def error(status: int, message: str, kind: str, *, param: str | None = None, headers: dict | None = None,
          error_type: str = "invalid_request_error") -> JSONResponse:
    """An error answer in OpenAI's shape, which OpenAI's clients parse: `kind` is its `code`."""
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": kind}},
                        status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """One line for pydantic's list of errors: where, and what is wrong there."""
    parts, param = [], None
    for item in exc.errors():
        location = [str(part) for part in item.get("loc", ()) if part != "body"]
        if item.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({item.get('ctx', {}).get('error', item.get('msg'))})")
            continue
        param = param or (location[0] if location else None)
        parts.append(f"{'.'.join(location) or 'body'}: {item.get('msg')}")
    return "; ".join(parts), param


class GenerationError(Exception):
    """A generation request refused (400, 429, 503) or failed (500, 504, a replica's error), raised by the helpers
    of the two image routes: one handler answers it in OpenAI's shape and counts it in the errors metric by its kind,
    so no helper needs to carry the metrics or build a response."""

    def __init__(self, status: int, message: str, kind: str, *, param: str | None = None,
                 headers: dict | None = None, error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers, self.error_type = headers, error_type


def _invalid(message: str, param: str | None = None) -> GenerationError:
    """A 400: the client's request is wrong, and `message` says how to fix it."""
    return GenerationError(400, message, "invalid_request", param=param)


def build_app(config: ServeConfig, scheduler: Scheduler, metrics: Metrics, request_timeout_s: float,
              files: ImageFiles | None = None) -> FastAPI:
    """The server's app: the probes, then the image routes, behind the request counter and the error handlers."""
    app = FastAPI(title="neuron-diffusers", description="OpenAI-style image generation over a device mesh.",
                  docs_url=None, redoc_url=None)
    _count_requests(app, metrics)
    _answer_errors(app, metrics)
    _add_probes(app, config, scheduler, metrics)
    _add_image_routes(app, config, _Answers(scheduler, metrics, request_timeout_s, files), files)
    return app


def _count_requests(app: FastAPI, metrics: Metrics) -> None:
    """Every answer, refusals included, counts in the requests metric by path and status."""

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response


def _answer_errors(app: FastAPI, metrics: Metrics) -> None:
    """All errors in OpenAI's JSON shape, FastAPI's own (a body that fails the model: 400 rather than its 422;
    an unknown path or method) included, so a client parses one kind of refusal."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        metrics.errors.labels("invalid_request").inc()
        message, param = _validation_message(exc)
        return error(400, message, "invalid_request", param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail), "http_error", headers=exc.headers)

    @app.exception_handler(GenerationError)
    async def generation_error(request: Request, exc: GenerationError):
        metrics.errors.labels(exc.kind).inc()
        return error(exc.status, exc.message, exc.kind, param=exc.param, headers=exc.headers,
                     error_type=exc.error_type)


def _add_probes(app: FastAPI, config: ServeConfig, scheduler: Scheduler, metrics: Metrics) -> None:
    """`/health` (every rank alive: an orchestrator restarts the server on 503), `/ready` (weights loaded: a load
    balancer sends requests only then) and `/metrics` (Prometheus)."""

    @app.get("/health")
    async def health():
        if scheduler.failure:
            return error(503, f"unhealthy: {scheduler.failure}", "unhealthy", error_type="server_error")
        # torchrun --max-restarts: how many times the agent restarted this group (0: the first start).
        return {"status": "ok", "restarts": group_restarts()}

    @app.get("/ready")
    async def ready():
        if not scheduler.ready.is_set():
            return error(503, "loading: weights are not loaded (and warmed) yet", "not_ready",
                         error_type="server_error")
        return {"status": "ready", "model": config.checkpoint.source, "replicas": config.replicas,
                "tp": config.tp, "ulysses": config.ulysses, "ring": config.ring, "cfg": config.cfg}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)


def _add_image_routes(app: FastAPI, config: ServeConfig, answers: _Answers, files: ImageFiles | None) -> None:
    """OpenAI's two image routes, and the files of their `url` answers. A route only turns its body into `Work`
    (raising `GenerationError` for what the server refuses); `_Answers` queues it and shapes the answer."""

    @app.get(FILES + "/{name}", name="image_file")
    async def image_file(name: str):
        path = files.path(name) if files is not None else None
        if path is None:
            return error(404, f"no image {name!r}: it was never made here, or it is older than the last --keep "
                         "images", "not_found")
        return FileResponse(path, media_type="image/png")

    @app.post(GENERATIONS)
    async def generations(body: ImageRequest, request: Request):
        arrived = time.perf_counter()
        try:
            work = plan_work(body, config)
        except ValueError as exc:
            raise _invalid(str(exc)) from exc
        return await answers.answer(work, arrived, request)

    @app.post(EDITS)
    async def edits(request: Request):
        arrived = time.perf_counter()
        _check_edit_headers(request)
        fields, images, mask = await _read_edit_form(request)
        return await answers.answer(_edit_work(fields, images, mask, config), arrived, request)


def _check_edit_headers(request: Request) -> None:
    """Refuse, before reading a byte of it, a body too large for its files or not a multipart form."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > (MAX_IMAGES + 1) * MAX_UPLOAD_BYTES:
        raise _invalid(f"the body is larger than {MAX_IMAGES + 1} files of {MAX_UPLOAD_BYTES} bytes: send smaller "
                       "images.")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise _invalid("POST /v1/images/edits takes a multipart/form-data body (OpenAI's): the `image` file(s), an "
                       "optional `mask` file, and the text fields (`prompt`, `n`, `size`, ...).")


async def _read_edit_form(request: Request) -> tuple[dict, list[Upload], Upload | None]:
    """The edit form's text fields, its `image` files (in order) and its `mask` file, bounded by starlette while it
    parses (the Content-Length check alone trusts the client); the form's spooled files are closed either way."""
    try:
        form = await request.form(max_files=MAX_IMAGES + 1, max_fields=32, max_part_size=MAX_UPLOAD_BYTES)
    except Exception as exc:  # starlette's MultiPartException and the parser's errors: a malformed body
        raise _invalid(f"the body is not a valid multipart form ({exc})") from exc
    try:
        fields, images, mask = await _split_form(form)
    finally:
        await form.close()
    if not images:
        raise _invalid("no `image` file: an edit needs its input image (multipart field `image`).", "image")
    return fields, images, mask


async def _split_form(form: FormData) -> tuple[dict, list[Upload], Upload | None]:
    """Files only in the file fields, each text field once: a field given twice would leave which one counts to
    the parser's order."""
    fields, images, mask = {}, [], None
    for name, value in form.multi_items():
        if not isinstance(value, UploadFile):
            if name in fields or name in (*IMAGE_FIELDS, "mask"):
                raise _invalid(f"field {name!r} is given twice, or as text where a file belongs.", name)
            fields[name] = value
            continue
        if name not in (*IMAGE_FIELDS, "mask") or (name == "mask" and mask is not None):
            raise _invalid(f"unexpected file field {name!r}: send `image` (repeat it for reference images) and at "
                           "most one `mask`.", name)
        upload = Upload((value.filename or name)[:200], await value.read())
        if name == "mask":
            mask = upload
        else:
            images.append(upload)
    return fields, images, mask


def _edit_work(fields: dict, images: list[Upload], mask: Upload | None, config: ServeConfig) -> Work:
    """The edit's `Work`, its text fields checked by the same model as a generation's JSON body (not strictly: a
    form's values are all text)."""
    if "loras" in fields:  # a list has no form encoding: the field holds its JSON
        try:
            fields["loras"] = json.loads(fields["loras"])
        except ValueError as exc:
            raise _invalid('loras: a form field holds it as JSON, e.g. [{"name": "ink", "scale": 0.8}]',
                           "loras") from exc
    try:
        body = EditRequest.model_validate(fields, strict=False)
        return plan_work(body, config, tuple(images), mask)
    except ValidationError as exc:
        raise _invalid(*_validation_message(exc)) from exc
    except ValueError as exc:
        raise _invalid(str(exc)) from exc


class _Answers:
    """Queues a request's `Work` and waits for its replica, then answers: its images with their seeds, or why not
    (`GenerationError`). Shared by both image routes, so an edit and a generation answer alike."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics, request_timeout_s: float, files: ImageFiles | None):
        self.scheduler, self.metrics, self.request_timeout_s, self.files = scheduler, metrics, request_timeout_s, files

    async def answer(self, work: Work, arrived: float, request: Request) -> dict:
        result = await self._result(work, arrived)
        if "error" in result:
            failure = result["error"]
            raise GenerationError(failure["status"], failure["message"], failure["kind"], error_type=failure["type"])
        self.metrics.images.inc(len(result["images"]))
        items = []
        for png, made in zip(result["images"], work.requests, strict=True):
            # Plus the seed it was made from (an extension: a request without `seed` gets a random one).
            items.append({**await self._image(png, work.response_format, request), "seed": made.seed})
        return {"created": int(time.time()), "data": items}

    async def _result(self, work: Work, arrived: float) -> dict:
        """The replica's answer: its images, or its error; 429 or 503 when the queue does not take the work, 504
        after `--request-timeout` (the replica still finishes it)."""
        try:
            future = self.scheduler.submit(work.task(), len(work.requests), work.batch_key)
        except QueueFull as exc:
            raise GenerationError(429, f"{exc}: retry later", "queue_full", error_type="rate_limit_error",
                                  headers={"Retry-After": str(self.scheduler.retry_after())}) from exc
        except NotAccepting as exc:
            raise GenerationError(503, str(exc), "not_accepting", error_type="server_error") from exc
        try:
            # shield: a timeout (or a client gone) must not cancel the job a replica already runs
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.request_timeout_s)
        except TimeoutError as exc:
            raise GenerationError(504, f"the request took longer than {self.request_timeout_s:g} s "
                                  "(--request-timeout); its replica finishes it and goes on with the next one",
                                  "timeout", error_type="server_error") from exc
        finally:
            self.metrics.latency.observe(time.perf_counter() - arrived)

    async def _image(self, png: bytes, response_format: str, request: Request) -> dict:
        """One image of the answer: base64 PNG; or (`url`) a URL of this server with `--out`, else the same PNG as
        a `data:` URL."""
        if response_format == "url" and self.files is not None:
            try:
                name = await asyncio.to_thread(self.files.add, png)
            except OSError as exc:  # --out full or gone: this answer fails, the server goes on
                raise GenerationError(500, f"cannot keep the image in --out ({exc.strerror or exc}); ask with "
                                      "response_format b64_json meanwhile", "storage",
                                      error_type="server_error") from exc
            return {"url": str(request.url_for("image_file", name=name))}
        encoded = base64.b64encode(png).decode("ascii")
        if response_format == "url":
            return {"url": f"data:image/png;base64,{encoded}"}
        return {"b64_json": encoded}
