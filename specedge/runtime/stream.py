"""A request in progress: the text stream it yields, and the one-request-at-a-time lock of a pipeline."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from .generator import Result

__all__ = ["PipelineBusyError", "PipelineClosedError", "RequestLock", "TextStream"]


class TextStream:
    """Iterate to get text pieces as tokens are accepted; `result` is set once it is exhausted.

    An open stream holds its pipeline (see `Pipeline`): exhaust it or `close()` it (or use it as
    a context manager) to let the next request run."""

    def __init__(self, gen: Iterator[str], release=None):
        self._gen = gen
        self._release = release
        self.result: Result | None = None

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration as e:
            self.result = e.value
            self._done()
            raise
        except BaseException:
            self._done()
            raise

    def _done(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def close(self) -> None:
        try:
            self._gen.close()
        finally:
            self._done()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # an abandoned stream must not keep the pipeline busy forever
        self._done()


class PipelineBusyError(RuntimeError):
    """A request on a pipeline from the thread that already holds it (an open stream)."""


class PipelineClosedError(RuntimeError):
    """A request on a pipeline after its `close()`."""


class RequestLock:
    """One request at a time per pipeline: other threads wait their turn; the thread that holds
    it (a stream it opened is still open) is refused, since waiting would deadlock it and running
    would corrupt the KV cache the open stream is using."""

    def __init__(self):
        self._lock = threading.Lock()  # a plain Lock: a stream may be finished on another thread
        self._owner: int | None = None
        self._ident = threading.get_ident

    def held_here(self) -> bool:
        return self._owner == self._ident()

    def acquire(self, what: str) -> None:
        if self._owner == self._ident():
            raise PipelineBusyError(
                f"the pipeline is busy: {what} was called while a stream this thread opened on it is still open "
                "(exhaust or close() that stream first; use one pipeline per concurrent request)"
            )
        self._lock.acquire()
        self._owner = self._ident()

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    @property
    def busy(self) -> bool:
        return self._lock.locked()
