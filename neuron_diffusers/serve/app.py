"""The HTTP side (FastAPI, on global rank 0): OpenAI's `POST /v1/images/generations`, `GET /health`, `GET /ready`,
`GET /metrics`.

Every refusal is a JSON body in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): 400 for a body
that is not valid JSON, has unknown fields, values of the wrong type or out of range, or settings the model cannot
make; 429 with Retry-After when the queue is full; 503 while loading or shutting down; 504 when a request took longer
than `--request-timeout` (its replica still finishes it, and the next request is unaffected). A request the server
accepted never puts a replica out of step: the replica validates and decides together (see `replica.py`).
"""

from __future__ import annotations

import asyncio
import base64
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from .metrics import Metrics
from .request import ImageRequest, ServeConfig, plan_work
from .scheduler import NotAccepting, QueueFull, Scheduler

GENERATIONS = "/v1/images/generations"


def error(status: int, message: str, kind: str, *, param: str | None = None, headers: dict | None = None,
          error_type: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": kind}},
                        status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
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


def build_app(config: ServeConfig, scheduler: Scheduler, metrics: Metrics, request_timeout_s: float) -> FastAPI:
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

    @app.post(GENERATIONS)
    async def generations(body: ImageRequest):
        arrived = time.perf_counter()
        try:
            work = plan_work(body, config)
        except ValueError as exc:
            metrics.errors.labels("invalid_request").inc()
            return error(400, str(exc), "invalid_request")
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
        return {"created": int(time.time()), "data": [_item(png, work.response_format, request.seed)
                                                      for png, request in zip(result["images"], work.requests,
                                                                              strict=True)]}

    return app


def _item(png: bytes, response_format: str, seed: int) -> dict:
    """One image of the answer: base64 PNG, or (`url`) the same PNG as a `data:` URL, since the server keeps no
    files; plus the seed it was made from (an extension: a request without `seed` gets a random one)."""
    encoded = base64.b64encode(png).decode("ascii")
    if response_format == "url":
        return {"url": f"data:image/png;base64,{encoded}", "seed": seed}
    return {"b64_json": encoded, "seed": seed}
