"""The FastAPI app: OpenAI-compatible routes over a Scheduler of replicas (docs/serve.md).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics. Every error is an OpenAI error object (`{"error": {...}}`) with its status: 400
for a bad request, 401 for a missing or wrong API key, 413 for a body over the size limit, 429
(with Retry-After) when the queue is full, 503 (with Retry-After) while the server shuts down,
504 past the request deadline, 500 for a fault (no traceback is sent; one line is logged, the
traceback at debug level). The HTTP layer's own refusals (malformed requests, read timeouts) are
error objects too: see http.py. The two completion routes run in completions.py.
"""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .completions import Completions
from .errors import ApiError, bad_request, log_fault
from .metrics import CONTENT_TYPE_LATEST, DEFAULT_MAX_TASKS, ServeMetrics
from .schemas import ChatRequest, CompletionRequest, describe_validation_error
from .worker import SHUTDOWN_RETRY_AFTER, Scheduler

__all__ = ["create_app", "DEFAULT_MAX_BODY"]

DEFAULT_MAX_BODY = 1 << 20  # bytes of a request body
_STATUS_KIND = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "bad_request",
    408: "timeout",
    413: "too_large",
    422: "bad_request",
    429: "queue_full",
    503: "shutdown",
    504: "timeout",
}


class _ClientGone(Exception):
    pass


class _BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes (413), by Content-Length or as they arrive."""

    def __init__(self, app, limit: int, metrics: ServeMetrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            self.metrics.error("too_large" if declared.isdigit() else "bad_request")
            err = (
                ApiError(413, f"the request body is over the server's limit of {self.limit} bytes", kind="too_large")
                if declared.isdigit()
                else bad_request("the Content-Length header is not a number")
            )
            return await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise StarletteHTTPException(
                        413, f"the request body is over the server's limit of {self.limit} bytes"
                    )
            return message

        await self.app(scope, limited, send)


def _answer_errors_as_openai(app: FastAPI, metrics: ServeMetrics) -> None:
    """Every error, FastAPI's and Starlette's own included, answers as an OpenAI error object and is
    counted by kind."""

    def answer(err: ApiError) -> JSONResponse:
        metrics.error(err.kind)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = describe_validation_error(exc.errors())
        return answer(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = _STATUS_KIND.get(exc.status_code, "bad_request")
        status = 400 if exc.status_code == 422 else exc.status_code
        detail = str(exc.detail)
        if status == 400 and isinstance(exc.__cause__, ValueError):  # FastAPI could not decode the body
            detail = "the request body is not valid JSON" + (
                " (it is not UTF-8 text)" if isinstance(exc.__cause__, UnicodeDecodeError) else ""
            )
        return answer(ApiError(status, detail, kind=kind))

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        request.scope["specedge.logged"] = True  # http.py's wrapper then does not log it again
        log_fault(request.method, request.url.path, exc)
        return answer(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error", kind="internal"))


def _authorizer(api_key: str | None):
    """The dependency that checks `Authorization: Bearer KEY` (none when no key is set)."""

    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(
                401,
                "a valid API key is required (Authorization: Bearer KEY)"
                if given
                else "missing API key (send Authorization: Bearer KEY)",
                type="authentication_error",
                code="invalid_api_key",
                kind="unauthorized",
            )

    return authorized


def create_app(
    scheduler: Scheduler,
    model: str,
    *,
    api_key: str | None = None,
    timeout: float = 300.0,
    max_body: int = DEFAULT_MAX_BODY,
    default_max_tokens: int = 256,
    metrics: ServeMetrics | None = None,
    instance: str | None = None,
    max_tasks: int = DEFAULT_MAX_TASKS,
) -> FastAPI:
    """The app serving `scheduler`'s replicas as model `model`. The scheduler's threads start
    with the app and stop when it shuts down. `instance` names this server among several behind
    one endpoint (Ray Serve's replica id): /health and each response's `specedge` object carry it.
    `max_tasks` caps the distinct task labels of the metrics (when `metrics` is not given)."""
    metrics = metrics or ServeMetrics(max_tasks, model)
    scheduler._on_change = lambda waiting, busy: (metrics.queue_depth.set(waiting), metrics.busy.set(busy))

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.close)

    app = FastAPI(title="specedge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.add_middleware(_BodyLimit, limit=max_body, metrics=metrics)

    _answer_errors_as_openai(app, metrics)
    auth = [Depends(_authorizer(api_key))]

    @app.get("/health")
    async def health():
        h = {
            "status": "ok",
            "model": model,
            "replicas": len(scheduler.replicas),
            "busy": scheduler.busy,
            "waiting": scheduler.waiting,
        }
        if instance is not None:
            h["instance"] = instance
        if scheduler.closed:  # a load balancer takes this server out of rotation while it stops
            h["status"] = "stopping"
            return JSONResponse(h, status_code=503, headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER)})
        return h

    @app.get("/metrics", dependencies=auth)
    async def prometheus():
        # rendered on a worker thread: the event loop keeps serving other requests meanwhile
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": model, "object": "model", "created": int(app.state.created), "owned_by": "specedge"}

    app.state.created = time.time()

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=auth)
    async def model_info(name: str):
        if name != model:
            raise ApiError(
                404,
                f"the model '{name}' is not served here (this server serves '{model}')",
                code="model_not_found",
                kind="not_found",
            )
        return model_card()

    completions = Completions(
        scheduler, model, metrics, timeout=timeout, default_max_tokens=default_max_tokens, instance=instance
    )

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request, body: ChatRequest):
        return await completions.complete(request, body, chat=True)

    @app.post("/v1/completions", dependencies=auth)
    async def complete(request: Request, body: CompletionRequest):
        return await completions.complete(request, body, chat=False)

    return app
