"""One completion request, from its checked body to its response or event stream (app.py routes
both endpoints here).

A request is prepared (the prompt's ids and the generation arguments, checked as the pipeline checks
them), submitted to the Scheduler as a Job whose events (pieces of text, then done, error or
cancelled) arrive on an asyncio queue from the worker thread, and answered: the whole text at once,
or as server-sent events. Every request ends in exactly one outcome in the metrics and one log line
(_Run): ok, rejected (queue full), timeout (past the deadline: the job is cancelled), cancelled
(the client went away: the job is cancelled), shutdown or error.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..runtime.generator import GenerationConfig
from .errors import ApiError, bad_request
from .metrics import ServeMetrics
from .sse import DONE, FINISH, Formatter, event, extension, usage
from .worker import Job, QueueFull, Scheduler, shutting_down

log = logging.getLogger("specedge.serve")
POLL_S = 0.2  # how often a waiting request checks that its client is still connected


class _ClientGone(Exception):
    pass


class _Events:
    """A job's events as the worker thread emits them, read against the request's deadline and its
    client's connection."""

    def __init__(self, request: Request, scheduler: Scheduler, t0: float, timeout: float):
        self.request, self.scheduler, self.timeout, self.deadline = request, scheduler, timeout, t0 + timeout
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.job: Job | None = None

    def emit(self, ev) -> None:
        """Called on the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass

    async def next(self):
        """The next event; ApiError 504 past the deadline, _ClientGone when the client left (the job
        is cancelled in both cases)."""
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.scheduler.cancel(self.job)
                raise ApiError(
                    504,
                    f"the request ran past the server's deadline of {self.timeout:g} s",
                    type="timeout_error",
                    code="timeout",
                    kind="timeout",
                )
            if not self.queue.empty():  # the common case while tokens flow: no timer, no task
                return self.queue.get_nowait()
            try:
                return await asyncio.wait_for(self.queue.get(), min(POLL_S, left))
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    self.scheduler.cancel(self.job)
                    raise _ClientGone() from None


class Completions:
    """Both completion endpoints over one Scheduler, as model `model`."""

    def __init__(
        self,
        scheduler: Scheduler,
        model: str,
        metrics: ServeMetrics,
        *,
        timeout: float,
        default_max_tokens: int,
        instance: str | None,
    ):
        self.scheduler, self.model, self.metrics = scheduler, model, metrics
        self.timeout, self.default_max_tokens, self.instance = timeout, default_max_tokens, instance

    def prepare(self, body, chat: bool) -> tuple[list[int], dict]:
        """The prompt's ids and the generation arguments, checked as the pipeline checks them."""
        pipe = self.scheduler.pipeline
        kwargs = body.generation_kwargs(self.default_max_tokens)
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

    async def complete(self, request: Request, body, chat: bool):
        """Run one request: its JSON response, or its event stream."""
        t0 = time.monotonic()
        endpoint = "chat" if chat else "completions"
        task = body.specedge.task or "default"
        ids, kwargs = await run_in_threadpool(self.prepare, body, chat)
        events = _Events(request, self.scheduler, t0, self.timeout)
        job = events.job = Job(ids, kwargs, events.emit, pieces=body.stream)
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            self.metrics.ended(endpoint, task, "rejected")
            raise ApiError(
                429,
                "the server is busy: its request queue is full; retry later",
                type="rate_limit_error",
                code="queue_full",
                kind="queue_full",
                headers={"Retry-After": str(e.retry_after)},
            ) from None
        fmt = Formatter(chat, self.model)
        run = _Run(job, endpoint, task, t0, len(ids))

        try:
            ev = await events.next()
            if not body.stream:
                while ev[0] == "piece":  # the text comes whole with the result
                    run.first_piece()
                    ev = await events.next()
        except _ClientGone:
            run.end(self.metrics, "cancelled")
            return Response(status_code=499)
        except ApiError as e:
            run.end(self.metrics, e.kind)
            raise
        if ev[0] in ("error", "cancelled"):
            err = _failure(ev)
            run.end(self.metrics, "shutdown" if err.kind == "shutdown" else "error")
            raise err
        if body.stream:
            return StreamingResponse(
                self._stream(ev, events, fmt, run, body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        result = ev[1]
        ext = run.done(self.metrics, result, self.instance)
        return fmt.response(result.text, FINISH[result.finish_reason], usage(len(ids), len(result.token_ids)), ext)

    async def _stream(self, first, events: _Events, fmt: Formatter, run: _Run, include_usage: bool):
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
                    while ev is None and not events.queue.empty():
                        ev = events.queue.get_nowait()
                        if ev[0] == "piece":
                            text, ev = text + ev[1], None
                    yield event(fmt.chunk(text))
                    if ev is None:
                        ev = await events.next()
            except ApiError as e:  # the deadline, mid-stream: the status is sent already
                outcome = e.kind
                self.metrics.error(e.kind)
                yield event(e.body())
                yield DONE
                return
            except _ClientGone:
                return
            if ev[0] != "done":
                err = _failure(ev)
                outcome = "shutdown" if err.kind == "shutdown" else "error"
                self.metrics.error(err.kind)
                yield event(err.body())
                yield DONE
                return
            result = ev[1]
            outcome = None
            ext = run.done(self.metrics, result, self.instance)
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
                self.scheduler.cancel(run.job)
                run.end(self.metrics, outcome)


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
