"""The HTTP/1.1 connection layer under the app: uvicorn's httptools protocol with read limits.

What uvicorn leaves open, and this closes:
- a client that sends its request head (or body) slowly holds a connection for ever: the head
  must arrive within `header_timeout` seconds of the connection (or of the request's first byte
  on a kept-alive one) and the body within `body_timeout` of the head, else 408;
- a head over `max_header_bytes` is refused with 431 (llhttp sets no limit of its own);
- a client that stops reading its response holds its connection and request task for ever: once
  the socket's send buffer is full, `write_timeout` seconds without progress close the connection;
- a request the parser refuses (a non-numeric Content-Length, a bad header) got uvicorn's
  text/plain 400: every refusal here is an OpenAI error object, as the app's are;
- a client that half-closes its side after sending a request (shutdown(SHUT_WR)) got no answer,
  because the transport closed on end-of-file: a complete request is now answered first. The
  end-of-file alone cannot tell a half-close from a client that left, so the server sends an
  interim `100 Continue` (which HTTP/1.1 clients skip): a client that closed entirely answers it
  with a reset, which the connection's state shows (checked every PROBE_S seconds until the
  response starts), and its request is cancelled as when a client leaves.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .errors import ApiError, log_fault

__all__ = [
    "HttpLimits",
    "protocol_class",
    "uvicorn_config",
    "DEFAULT_HEADER_TIMEOUT",
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_MAX_HEADER_BYTES",
]

DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for a request's head
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for its body, once the head is in
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_WRITE_TIMEOUT = 30.0  # seconds a response may wait for a client that does not read it
PROBE_S = 0.1  # how often a half-closed connection is checked for a reset, until its response starts
_TCP_CLOSE = 7  # Linux's tcpi_state once a reset arrived (a half-closed peer leaves it at CLOSE_WAIT)


@dataclass(frozen=True)
class HttpLimits:
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    on_error: Callable[[str], None] | None = None  # counts a refusal by kind (the app's error metric)


class _HeadTooLarge(Exception):
    pass


def _answer(err: ApiError) -> bytes:
    body = json.dumps(err.body(), separators=(",", ":")).encode()
    return b"".join(
        [
            STATUS_LINE[err.status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits = HttpLimits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._timer = None
        self._head_bytes = 0
        self._in_head = True
        self._eof = False
        self._received = False
        self._write_timer = None
        self._running = None
        self._probe = None

    # --- timers
    def _arm(self, seconds: float, handler) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, handler)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.limits.header_timeout, self._head_timed_out)

    def connection_lost(self, exc) -> None:
        self._disarm()
        for timer in (self._write_timer, self._probe):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if self.limits.on_error is not None:
            self.limits.on_error("timeout")
        self._client_left()  # it stopped reading

    def _client_left(self) -> None:
        """End the connection as if the client had closed it: its requests see a disconnect."""
        for cycle in {self.cycle, self._running} - {None}:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.abort()

    def _start_asgi_task(self, cycle, app) -> None:
        self._running = cycle  # the request being answered (self.cycle is the last one parsed)
        super()._start_asgi_task(cycle, app)

    def _refuse(self, err: ApiError) -> None:
        """Answer `err` and close; for a request the app already runs, that request ends too."""
        self._disarm()
        if self.limits.on_error is not None:
            self.limits.on_error(err.kind)
        running = self._running
        if running is not None and running.response_started and not running.response_complete:
            # a pipelined request went wrong behind a response still going out: that one ends
            # whole, then the connection closes (an answer now would land inside it)
            running.keep_alive = False
            self.transport.pause_reading()
            return
        if not self.transport.is_closing():
            self.transport.write(_answer(err))
            self.transport.close()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    def _head_timed_out(self) -> None:
        self._timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            # a pipelined head arrives slowly behind a response still going out: end after it
            self.cycle.keep_alive = False
            return
        if not self._received:
            self.transport.close()  # connected and said nothing: no request to answer
            return
        self._refuse(
            ApiError(
                408,
                f"the request head did not arrive within {self.limits.header_timeout:g} s",
                code="request_timeout",
                kind="timeout",
            )
        )

    def _body_timed_out(self) -> None:
        self._timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body:
            return
        if cycle.response_started:  # the app answered without the body: no more of it is read
            cycle.keep_alive = False
            if cycle.response_complete:
                self.transport.close()
            return
        self._refuse(
            ApiError(
                408,
                f"the request body did not arrive within {self.limits.body_timeout:g} s",
                code="request_timeout",
                kind="timeout",
            )
        )

    # --- parsing
    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        self._received = True
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            # bytes between requests (even ones the parser skips, like blank lines) start the clock
            self._arm(self.limits.header_timeout, self._head_timed_out)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no protocol upgrades are served (ws="none"): the request is answered as plain HTTP
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _HeadTooLarge):
                self._refuse(
                    ApiError(
                        431,
                        f"the request head is over the server's limit of {self.limits.max_header_bytes} bytes",
                        kind="too_large",
                    )
                )
            else:
                reason = str(e).strip().rstrip(".") or "malformed"
                self._refuse(ApiError(400, f"the request is not valid HTTP/1.1: {reason}"))

    def send_400_response(self, msg: str) -> None:  # uvicorn's own refusals, should any remain
        self._refuse(ApiError(400, f"the request is not valid HTTP/1.1: {msg.rstrip('.')}"))

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.limits.max_header_bytes:
            raise _HeadTooLarge()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        if self._timer is None:  # a kept-alive connection's next request: its head's clock starts now
            self._arm(self.limits.header_timeout, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._eof and not self.transport.is_closing() and not self.pipeline:
            self.transport.close()  # the client half-closed: nothing more can come

    def eof_received(self) -> bool | None:
        # a complete request still being answered: keep the sending side open for its response
        cycle = self.cycle
        if cycle is not None and not cycle.more_body and not cycle.response_complete and not cycle.response_started:
            self._eof = True
            cycle.keep_alive = False
            self._disarm()
            if cycle.scope.get("http_version") != "1.0":  # no 1xx to HTTP/1.0 clients (RFC 9110, 15.2)
                cycle.waiting_for_100_continue = False
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self._probe = self.loop.call_later(PROBE_S, self._check_peer)
            return True
        return None  # the transport closes (the client left, or sent nothing to answer)

    def _check_peer(self) -> None:
        self._probe = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or cycle.response_started:
            return
        if _reset(self.transport.get_extra_info("socket")):
            self._client_left()
            return
        self._probe = self.loop.call_later(PROBE_S, self._check_peer)


def _reset(sock) -> bool:
    """Whether the peer reset the connection (it had closed it entirely, then got our probe)."""
    if sock is None:
        return False
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE
    except (OSError, AttributeError):  # no TCP_INFO here: a pending error says the same
        try:
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
        except OSError:
            return True


def protocol_class(limits: HttpLimits) -> type:
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


class _OneLineErrors:
    """ASGI wrapper: an exception that escapes the app after it was answered (Starlette re-raises
    it for the server to log, which uvicorn does with a traceback) is logged in one line here; the
    traceback goes to the debug level."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        except Exception as exc:  # noqa: BLE001 - a fault: the client got its 500 or a cut stream
            if not scope.get("specedge.logged"):
                log_fault(scope.get("method"), scope.get("path"), exc)


def uvicorn_config(app, limits: HttpLimits, **kwargs):
    """uvicorn's Config for `app` with this protocol; `kwargs` go to uvicorn.Config."""
    import uvicorn

    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("access_log", False)
    return uvicorn.Config(_OneLineErrors(app), http=protocol_class(limits), ws="none", lifespan="on", **kwargs)
