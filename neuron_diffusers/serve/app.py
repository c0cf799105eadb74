"""The HTTP side (FastAPI, on global rank 0): OpenAI's `POST /v1/images/generations` and `POST /v1/images/edits`
(a multipart form with the input `image` files and a `mask`), `GET /v1/images/files/{name}` (the images of
`response_format: "url"` with `--out`, see `files.py`), `GET /health`, `GET /ready`, `GET /metrics`.

Every refusal is a JSON body in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): 400 for a body
that is not valid JSON, has unknown fields, values of the wrong type or out of range, or settings the model cannot
make; 429 with Retry-After when the queue is full; 503 while loading or shutting down; 504 when a request took longer
than `--request-timeout` (its replica still finishes it, and the next request is unaffected). A request the server
accepted never puts a replica out of step: the replica validates and decides together (see `replica.py`).
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
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

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


def build_app(config: ServeConfig, scheduler: Scheduler, metrics: Metrics, request_timeout_s: float,
              files: ImageFiles | None = None) -> FastAPI:
    app = FastAPI(title="neuron-diffusers", description="OpenAI-style image generation over a device mesh.",
                  docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        metrics.errors.labels("invalid_request").inc()
        message, param = _validation_message(exc)
        return error(400, message, "invalid_request", param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail), "http_error", headers=exc.headers)

    @app.get("/health")
    async def health():
        if scheduler.failure:
            return error(503, f"unhealthy: {scheduler.failure}", "unhealthy", error_type="server_error")
        return {"status": "ok"}

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

    def refuse(message: str, param: str | None = None) -> JSONResponse:
        metrics.errors.labels("invalid_request").inc()
        return error(400, message, "invalid_request", param=param)

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
            return refuse(str(exc))
        return await answer(work, arrived, request)

    @app.post(EDITS)
    async def edits(request: Request):
        arrived = time.perf_counter()
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > (MAX_IMAGES + 1) * MAX_UPLOAD_BYTES:
            return refuse(f"the body is larger than {MAX_IMAGES + 1} files of {MAX_UPLOAD_BYTES} bytes: send smaller "
                          "images.")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            return refuse("POST /v1/images/edits takes a multipart/form-data body (OpenAI's): the `image` file(s), "
                          "an optional `mask` file, and the text fields (`prompt`, `n`, `size`, ...).")
        try:
            form = await request.form(max_files=MAX_IMAGES + 1, max_fields=32, max_part_size=MAX_UPLOAD_BYTES)
        except Exception as exc:  # starlette's MultiPartException and the parser's errors: a malformed body
            return refuse(f"the body is not a valid multipart form ({exc})")
        try:
            fields, images, mask = {}, [], None
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    if name not in (*IMAGE_FIELDS, "mask") or (name == "mask" and mask is not None):
                        return refuse(f"unexpected file field {name!r}: send `image` (repeat it for reference "
                                      "images) and at most one `mask`.", name)
                    upload = Upload((value.filename or name)[:200], await value.read())
                    if name == "mask":
                        mask = upload
                    else:
                        images.append(upload)
                elif name in fields or name in (*IMAGE_FIELDS, "mask"):
                    return refuse(f"field {name!r} is given twice, or as text where a file belongs.", name)
                else:
                    fields[name] = value
        finally:
            await form.close()
        if not images:
            return refuse("no `image` file: an edit needs its input image (multipart field `image`).", "image")
        if "loras" in fields:  # a list has no form encoding: the field holds its JSON
            try:
                fields["loras"] = json.loads(fields["loras"])
            except ValueError:
                return refuse('loras: a form field holds it as JSON, e.g. [{"name": "ink", "scale": 0.8}]', "loras")
        try:
            body = EditRequest.model_validate(fields, strict=False)  # a form's values are all text
            work = plan_work(body, config, tuple(images), mask)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            return refuse(message, param)
        except ValueError as exc:
            return refuse(str(exc))
        return await answer(work, arrived, request)

    async def answer(work: Work, arrived: float, request: Request):
        try:
            future = scheduler.submit(work.task(), len(work.requests))
        except QueueFull as exc:
            metrics.errors.labels("queue_full").inc()
            return error(429, f"{exc}: retry later", "queue_full", error_type="rate_limit_error",
                         headers={"Retry-After": str(scheduler.retry_after())})
        except NotAccepting as exc:
            metrics.errors.labels("not_accepting").inc()
            return error(503, str(exc), "not_accepting", error_type="server_error")
        try:
            # shield: a timeout (or a client gone) must not cancel the job a replica already runs
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), request_timeout_s)
        except TimeoutError:
            metrics.errors.labels("timeout").inc()
            return error(504, f"the request took longer than {request_timeout_s:g} s (--request-timeout); its "
                         "replica finishes it and goes on with the next one", "timeout", error_type="server_error")
        finally:
            metrics.latency.observe(time.perf_counter() - arrived)
        if "error" in result:
            failure = result["error"]
            metrics.errors.labels(failure["kind"]).inc()
            return error(failure["status"], failure["message"], failure["kind"], error_type=failure["type"])
        metrics.images.inc(len(result["images"]))
        items = []
        for png, made in zip(result["images"], work.requests, strict=True):
            # Plus the seed it was made from (an extension: a request without `seed` gets a random one).
            try:
                items.append({**await _image(png, work.response_format, request), "seed": made.seed})
            except OSError as exc:  # --out full or gone: this answer fails, the server goes on
                metrics.errors.labels("storage").inc()
                return error(500, f"cannot keep the image in --out ({exc.strerror or exc}); ask with "
                             "response_format b64_json meanwhile", "storage", error_type="server_error")
        return {"created": int(time.time()), "data": items}

    async def _image(png: bytes, response_format: str, request: Request) -> dict:
        """One image of the answer: base64 PNG; or (`url`) a URL of this server with `--out`, else the same PNG as
        a `data:` URL."""
        if response_format == "url" and files is not None:
            name = await asyncio.to_thread(files.add, png)
            return {"url": str(request.url_for("image_file", name=name))}
        encoded = base64.b64encode(png).decode("ascii")
        if response_format == "url":
            return {"url": f"data:image/png;base64,{encoded}"}
        return {"b64_json": encoded}

    return app
