"""Replicas and the bounded queue in front of them.

Each replica owns one pipeline (batch-1 static caches) and one thread that runs its requests one
after the other. Requests wait in one queue of at most `queue_size` requests; a full queue is
refused (QueueFull: the app answers 429 with Retry-After). The oldest waiting request goes to an
idle replica, the one whose cache holds the longest reusable prefix of its prompt, so a
conversation that continues lands where its earlier turns are cached (the pipeline's prefix
reuse then skips that part of the prefill). A request whose client went away, or whose deadline
passed, is cancelled: taken off the queue if it waits, stopped after the round in progress if it
runs (the stream is closed, which frees the pipeline for the next request).

Workers talk to the requester through `Job.emit(event)`, called on the worker thread:
("piece", text), ("done", Result), ("cancelled", None) or ("error", ApiError).

At shutdown `drain()` refuses new requests and answers the waiting ones ("error", 503 with
Retry-After) while the running ones go on; `cut()` then ends the running ones at once (their
requesters hear ("error", 503) without waiting for the round in flight); `close()` joins the threads.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import ApiError

__all__ = ["Job", "QueueFull", "Scheduler", "SHUTDOWN_RETRY_AFTER", "shutting_down"]

SHUTDOWN_RETRY_AFTER = 5  # seconds a client refused at shutdown is told to wait (a restart, another replica)


def shutting_down(message: str = "the server is shutting down; retry later") -> ApiError:
    return ApiError(
        503,
        message,
        type="server_error",
        code="shutdown",
        kind="shutdown",
        headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER)},
    )


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__("the server is busy")
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    token_ids: list[int]
    kwargs: dict  # Pipeline.stream keyword arguments besides the prompt
    emit: Callable[[tuple], None]
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    replica: int | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    # False: the requester wants the whole text only (it comes with the result), so after the
    # first piece (its time to first token) no piece wakes it
    pieces: bool = True

    @property
    def queue_wait(self) -> float:
        return (self.started or time.monotonic()) - self.submitted


class Replica:
    """One pipeline and the thread that runs its requests."""

    def __init__(self, index: int, pipe, scheduler: Scheduler):
        self.index = index
        self.pipe = pipe
        self._scheduler = scheduler
        self.job: Job | None = None
        self.thread = threading.Thread(target=self._loop, name=f"specedge-replica-{index}", daemon=True)

    def reusable(self, token_ids: list[int]) -> int:
        """Prompt tokens this replica's cache would reuse (read while the replica is idle)."""
        return self.pipe.generator.target.reusable(token_ids)

    def _loop(self) -> None:
        while True:
            job = self._scheduler._wait_for_job(self)
            if job is None:
                return
            t0 = time.monotonic()
            final = (
                "error",
                ApiError(
                    500, "internal error: the request ended without a result", type="server_error", kind="internal"
                ),
            )
            try:
                final = self._run(job)
            finally:
                # idle before the requester hears the end: a client (or Ray's router, which sends a
                # replica its next request as soon as the last one answered) must find it free
                self._scheduler._finished(self, time.monotonic() - t0)
                job.emit(final)

    def _run(self, job: Job) -> tuple:
        """Runs the job, emitting its pieces; returns its final event (done, error or cancelled)."""
        job.started = time.monotonic()
        if job.cancel.is_set():
            return ("cancelled", None)
        try:
            stream = self.pipe.stream(token_ids=job.token_ids, **job.kwargs)
            with stream:
                first = True
                for piece in stream:
                    if job.pieces or first:
                        job.emit(("piece", piece))
                        first = False
                    if job.cancel.is_set():  # checked once per round: the stream yields per round
                        return ("cancelled", None)
            return ("done", stream.result)
        except ValueError as e:  # the app validated the request; a pipeline refusal is still the client's
            return ("error", ApiError(400, str(e).splitlines()[0]))
        except Exception as e:  # noqa: BLE001 - answered as a 500 without a traceback, logged by the app
            return ("error", ApiError(500, f"internal error: {type(e).__name__}", type="server_error", kind="internal"))


class Scheduler:
    """The replicas and their queue. `submit` is called from the event loop, the rest from the
    replica threads; one condition variable guards the queue and the idle set."""

    def __init__(self, pipelines: list, queue_size: int, on_change: Callable[[int, int], None] | None = None):
        if not pipelines:
            raise ValueError("at least one replica")
        if queue_size < 0:
            raise ValueError(f"the queue size must be >= 0, got {queue_size}")
        self.queue_size = queue_size
        self.replicas = [Replica(i, p, self) for i, p in enumerate(pipelines)]
        self._cv = threading.Condition()
        self._pending: deque[Job] = deque()
        self._idle = set(range(len(self.replicas)))
        self._closed = False
        self._service_s = 1.0  # moving average of a request's run time, for Retry-After
        self._on_change = on_change or (lambda waiting, busy: None)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            for r in self.replicas:
                r.thread.start()

    @property
    def pipeline(self):
        """A pipeline to tokenize and validate with (every replica holds the same bundle)."""
        return self.replicas[0].pipe

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise shutting_down()
            if len(self._pending) >= self.queue_size + len(self._idle):
                waits = (len(self._pending) + 1) / len(self.replicas)
                raise QueueFull(max(1, math.ceil(waits * self._service_s)))
            self._pending.append(job)
            self._dispatch()

    def cancel(self, job: Job) -> None:
        """The requester gave up: drop the job if it still waits, else stop it after this round."""
        job.cancel.set()
        with self._cv:
            if job in self._pending:
                self._pending.remove(job)
                self._changed()

    def _dispatch(self) -> None:
        while self._pending and self._idle:
            job = self._pending.popleft()
            best = max(sorted(self._idle), key=lambda i: self.replicas[i].reusable(job.token_ids))
            self._idle.discard(best)
            job.replica = best
            self.replicas[best].job = job
        self._changed()
        self._cv.notify_all()

    def _changed(self) -> None:
        self._on_change(len(self._pending), len(self.replicas) - len(self._idle))

    def _wait_for_job(self, replica: Replica) -> Job | None:
        with self._cv:
            self._cv.wait_for(lambda: replica.job is not None or self._closed)
            return replica.job

    def _finished(self, replica: Replica, run_s: float) -> None:
        with self._cv:
            replica.job = None
            self._service_s = 0.8 * self._service_s + 0.2 * run_s
            if not self._closed:
                self._idle.add(replica.index)
                self._dispatch()

    @property
    def closed(self) -> bool:
        """No new requests are taken (the server is stopping)."""
        with self._cv:
            return self._closed

    @property
    def waiting(self) -> int:
        with self._cv:
            return len(self._pending)

    @property
    def busy(self) -> int:
        with self._cv:
            return len(self.replicas) - len(self._idle)

    def drain(self) -> int:
        """Stop taking requests and answer those waiting 503 (Retry-After); the running ones go
        on. Returns how many were waiting."""
        with self._cv:
            self._closed = True
            pending, self._pending = list(self._pending), deque()
            self._changed()
            self._cv.notify_all()
        for job in pending:
            job.cancel.set()
            job.emit(("error", shutting_down()))
        return len(pending)

    def cut(self) -> int:
        """End the running requests now: their requesters hear 503 at once and each replica stops
        after its round in flight. Returns how many were running."""
        with self._cv:
            running = [r.job for r in self.replicas if r.job is not None and not r.job.cancel.is_set()]
        for job in running:
            job.cancel.set()
            job.emit(("error", shutting_down("the server shut down before this request finished")))
        return len(running)

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, cancel those waiting and running, join the threads."""
        self.drain()
        self.cut()
        with self._cv:
            self._cv.notify_all()
        if self._started:
            for r in self.replicas:
                r.thread.join(timeout)
