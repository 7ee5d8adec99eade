"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}` with a status."""

from __future__ import annotations

import logging

log = logging.getLogger("specedge.serve")


class ApiError(Exception):
    """An error answered to the client: HTTP `status`, one-sentence `message`, OpenAI `type`,
    and `kind` (the label of specedge_errors_total)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        kind: str = "bad_request",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def log_fault(method: str | None, path: str | None, exc: BaseException) -> None:
    """A fault in one line (its message's first line); the traceback at debug level (--debug)."""
    first = str(exc).strip().splitlines()
    log.error(
        "specedge serve: %s %s: internal error: %s%s",
        method,
        path,
        type(exc).__name__,
        f": {first[0]}" if first else "",
    )
    log.debug("specedge serve: the traceback of that error", exc_info=exc)
