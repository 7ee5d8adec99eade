"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}` with a status."""

from __future__ import annotations


class ApiError(Exception):
    """An error answered to the client: HTTP `status`, one-sentence `message`, OpenAI `type`,
    and `kind` (the label of specedge_errors_total)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, kind: str = "bad_request", headers: dict | None = None):
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
