"""The FastAPI app: OpenAI-compatible routes over a Scheduler of replicas (docs/serve.md).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics. Every error is an OpenAI error object (`{"error": {...}}`) with its status: 400
for a bad request, 401 for a missing or wrong API key, 413 for a body over the size limit, 429
(with Retry-After) when the queue is full, 503 (with Retry-After) while the server shuts down,
504 past the request deadline, 500 for a fault (no traceback is sent; one line is logged, the
traceback at debug level). The HTTP layer's own refusals (malformed requests, read timeouts) are
error objects too: see http.py.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.generator import GenerationConfig
from .errors import ApiError, bad_request, log_fault
from .metrics import CONTENT_TYPE_LATEST, DEFAULT_MAX_TASKS, ServeMetrics
from .schemas import ChatRequest, CompletionRequest, describe_validation_error
from .sse import DONE, FINISH, Formatter, event, extension, usage
from .worker import SHUTDOWN_RETRY_AFTER, Job, QueueFull, Scheduler, shutting_down

__all__ = ["create_app", "DEFAULT_MAX_BODY"]

log = logging.getLogger("specedge.serve")
DEFAULT_MAX_BODY = 1 << 20  # bytes of a request body
POLL_S = 0.2  # how often a waiting request checks that its client is still connected
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

    auth = [Depends(authorized)]

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

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request, body: ChatRequest):
        return await _complete(request, body, chat=True)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request, body: CompletionRequest):
        return await _complete(request, body, chat=False)

    def prepare(body, chat: bool) -> tuple[list[int], dict]:
        """The prompt's ids and the generation arguments, checked as the pipeline checks them."""
        pipe = scheduler.pipeline
        kwargs = body.generation_kwargs(default_max_tokens)
        drafter = body.specedge.drafter
        served = pipe.drafter.kind if pipe.drafter is not None else None
        if drafter == "none":
            kwargs["speculative"] = False
        elif drafter is not None and drafter != served:
            raise bad_request(
                f"this server drafts with '{served}' (start `specedge serve` with --draft {drafter} "
                "for that drafter); a request may name it or 'none' (target only)",
                "specedge.drafter",
            )
        try:
            GenerationConfig(**kwargs).validate()
            ids = pipe.encode(messages=body.message_dicts()) if chat else pipe.encode(**body.prompt_kwargs())
        except ValueError as e:
            raise bad_request(str(e).splitlines()[0]) from None
        return ids, kwargs

    async def _complete(request: Request, body, chat: bool):
        t0 = time.monotonic()
        endpoint = "chat" if chat else "completions"
        task = body.specedge.task or "default"
        ids, kwargs = await run_in_threadpool(prepare, body, chat)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(ev):
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                pass

        job = Job(ids, kwargs, emit, pieces=body.stream)
        try:
            scheduler.submit(job)
        except QueueFull as e:
            metrics.ended(endpoint, task, "rejected")
            raise ApiError(
                429,
                "the server is busy: its request queue is full; retry later",
                type="rate_limit_error",
                code="queue_full",
                kind="queue_full",
                headers={"Retry-After": str(e.retry_after)},
            ) from None
        deadline = t0 + timeout
        fmt = Formatter(chat, model)
        run = _Run(job, endpoint, task, t0, len(ids))

        async def next_event():
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    scheduler.cancel(job)
                    raise ApiError(
                        504,
                        f"the request ran past the server's deadline of {timeout:g} s",
                        type="timeout_error",
                        code="timeout",
                        kind="timeout",
                    )
                if not events.empty():  # the common case while tokens flow: no timer, no task
                    return events.get_nowait()
                try:
                    return await asyncio.wait_for(events.get(), min(POLL_S, left))
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        scheduler.cancel(job)
                        raise _ClientGone() from None

        try:
            ev = await next_event()
            if not body.stream:
                while ev[0] == "piece":  # the text comes whole with the result
                    run.first_piece()
                    ev = await next_event()
        except _ClientGone:
            run.end(metrics, "cancelled")
            return Response(status_code=499)
        except ApiError as e:
            run.end(metrics, e.kind)
            raise
        if ev[0] in ("error", "cancelled"):
            err = _failure(ev)
            run.end(metrics, "shutdown" if err.kind == "shutdown" else "error")
            raise err
        if body.stream:
            return StreamingResponse(
                _stream(ev, next_event, events, fmt, run, body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        result = ev[1]
        ext = run.done(metrics, result, instance)
        return fmt.response(result.text, FINISH[result.finish_reason], usage(len(ids), len(result.token_ids)), ext)

    async def _stream(first, next_event, events: asyncio.Queue, fmt: Formatter, run: _Run, include_usage: bool):
        outcome = "cancelled"  # what the finally reports if the client leaves (the task is cancelled)
        try:
            if fmt.chat:
                yield event(fmt.chunk(role=True))
            ev = first
            try:
                while ev[0] == "piece":
                    run.first_piece()
                    # pieces that queued up while this task waited for the CPU go out as one chunk
                    text, ev = ev[1], None
                    while ev is None and not events.empty():
                        ev = events.get_nowait()
                        if ev[0] == "piece":
                            text, ev = text + ev[1], None
                    yield event(fmt.chunk(text))
                    if ev is None:
                        ev = await next_event()
            except ApiError as e:  # the deadline, mid-stream: the status is sent already
                outcome = e.kind
                metrics.error(e.kind)
                yield event(e.body())
                yield DONE
                return
            except _ClientGone:
                return
            if ev[0] != "done":
                err = _failure(ev)
                outcome = "shutdown" if err.kind == "shutdown" else "error"
                metrics.error(err.kind)
                yield event(err.body())
                yield DONE
                return
            result = ev[1]
            outcome = None
            ext = run.done(metrics, result, instance)
            u = usage(run.prompt_tokens, len(result.token_ids))
            last = fmt.chunk(finish=FINISH[result.finish_reason])
            if include_usage:
                yield event(last)
                yield event(fmt.usage_chunk(u, ext))
            else:
                last.update(usage=u, specedge=ext)
                yield event(last)
            yield DONE
        finally:
            if outcome is not None:
                scheduler.cancel(run.job)
                run.end(metrics, outcome)

    return app


def _failure(ev: tuple) -> ApiError:
    """The answer to a job that ended without a result: its error, or (a job cancelled while its
    client still waits: only a shutdown does that) 503."""
    if ev[0] == "error":
        return ev[1]
    return shutting_down("the server shut down before this request finished")


class _Run:
    """One request's timings, its metrics and its log line."""

    def __init__(self, job: Job, endpoint: str, task: str, t0: float, prompt_tokens: int):
        self.job, self.endpoint, self.task, self.t0, self.prompt_tokens = job, endpoint, task, t0, prompt_tokens
        self.t_first: float | None = None

    def first_piece(self) -> None:
        if self.t_first is None:
            self.t_first = time.monotonic()

    def done(self, metrics: ServeMetrics, result, instance: str | None) -> dict:
        now = time.monotonic()
        ttft = (self.t_first or now) - self.t0
        total = now - self.t0
        s = result.stats
        metrics.finished(self.endpoint, self.task, s, self.job.queue_wait, ttft, total)
        metrics.queue_wait.observe(self.job.queue_wait)
        log.info(
            "specedge serve: %s ok task=%s replica=%s prompt=%d reused=%d tokens=%d finish=%s ttft=%.3fs "
            "total=%.3fs queue=%.3fs tok/s=%.1f acceptance=%.2f mean_accepted=%.2f k=%s fallbacks=%d",
            self.endpoint,
            self.task,
            self.job.replica,
            s["prompt_tokens"],
            s.get("prefix_reused_tokens", 0),
            s["tokens"],
            result.finish_reason,
            ttft,
            total,
            self.job.queue_wait,
            s["tokens_per_s"],
            s["acceptance_rate"],
            s["mean_accepted"],
            s.get("k"),
            s.get("fallbacks", 0),
        )
        ext = extension(result, self.task, self.job.replica, self.job.queue_wait)
        if instance is not None:
            ext["instance"] = instance
        return ext

    def end(self, metrics: ServeMetrics, outcome: str) -> None:
        metrics.ended(self.endpoint, self.task, outcome)
        log.info(
            "specedge serve: %s %s task=%s replica=%s prompt=%d total=%.3fs queue=%.3fs",
            self.endpoint,
            outcome,
            self.task,
            self.job.replica,
            self.prompt_tokens,
            time.monotonic() - self.t0,
            self.job.queue_wait,
        )
