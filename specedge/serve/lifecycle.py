"""Starting and stopping `specedge serve`: the listening sockets, bound before the model loads,
and uvicorn's Server with the shutdown docs/serve.md describes.

The first SIGTERM or SIGINT stops accepting connections and answers the requests waiting in the
queue 503 with Retry-After; running requests go on for up to `grace` seconds, after which (or at
a second signal) they end at once: a stream with an error event and `data: [DONE]`, a whole
response with 503. `Server.signal` tells the command which signal stopped it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading

import uvicorn

from ..errors import UserError

__all__ = ["DEFAULT_GRACE", "Server", "listen"]

log = logging.getLogger("specedge.serve")
DEFAULT_GRACE = 8.0  # seconds; fits within `docker stop`'s 10 s and Kubernetes' 30 s before SIGKILL
_BACKSTOP = 5.0  # seconds after the grace period before uvicorn cancels what still runs


def listen(host: str, port: int, backlog: int = 2048) -> list[socket.socket]:
    """Sockets listening on every address `host` resolves to, as asyncio's create_server binds
    them; a host that does not resolve or an address that cannot be bound is a UserError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys((i[0], i[1], i[2], "", i[4]) for i in infos):
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(backlog)
    except OSError as e:
        for s in socks:
            s.close()
        hint = " (another process is using it: stop it or choose another --port)" if e.errno == 98 else ""
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return socks


class Server(uvicorn.Server):
    """uvicorn's Server that drains `scheduler` on the first signal and cuts its running requests
    after `grace` seconds or at a second signal. It never re-raises the signal (uvicorn does):
    the command chooses its exit code from `signal`."""

    def __init__(self, config: uvicorn.Config, scheduler, grace: float = DEFAULT_GRACE):
        config.timeout_graceful_shutdown = grace + _BACKSTOP
        super().__init__(config)
        self.scheduler = scheduler
        self.grace = grace
        self.signal: int | None = None
        self.cut_short = 0
        self._drained = False

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:  # handled on the loop, where the scheduler may be used safely
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig, frame) -> None:
        if self.signal is None:
            self.signal = sig
            log.info(
                "specedge serve: %s: stopping (no new requests; running ones get %g s; a second signal ends them now)",
                signal.Signals(sig).name,
                self.grace,
            )
            self._drain()
            self.should_exit = True
        else:
            self._cut()

    def _drain(self) -> None:
        if not self._drained:
            self._drained = True
            waiting = self.scheduler.drain()
            if waiting:
                log.info("specedge serve: %d waiting request(s) answered 503", waiting)

    def _cut(self) -> None:
        n = self.scheduler.cut()
        self.cut_short += n
        if n:
            log.info("specedge serve: %d running request(s) ended before they finished", n)

    async def shutdown(self, sockets=None) -> None:
        self._drain()
        timer = asyncio.get_running_loop().call_later(self.grace, self._cut)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()
