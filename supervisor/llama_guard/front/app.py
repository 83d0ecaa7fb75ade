"""The front door's HTTP server (aiohttp's low-level server): ``/livez``, ``/readyz``, everything else forwarded.

What a bad client gets, and why no other client notices (each bound is a ``[front]`` key):

- a connection that sends no complete request head within ``header_timeout_s`` (an idle one, or one
  that trickles its headers) is closed — aiohttp's keep-alive timer, armed from the connection's start;
- a request line or header line over 8190 bytes, or malformed HTTP, gets aiohttp's 400 and a close;
- a body over ``max_body_bytes`` gets 413 (before it is read, when ``Content-Length`` says so);
- a body not complete within ``body_timeout_s`` (a client trickling it) gets 408;
- bodies in memory — being read, held, or in flight until their answer begins — never pass
  ``max_buffered_bytes`` together: past it, 503 with ``Retry-After``; a body holds of it only the
  bytes that came, never what its ``Content-Length`` declares (:mod:`llama_guard.front.body`);
- past ``max_connections`` open connections, a new one is closed at once.
Nothing here logs a header or a body: aiohttp's access log is off and its logger is silenced.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import resource
import socket
import sys
from collections.abc import Callable

from aiohttp import hdrs, web

from llama_guard.config.argv import Endpoints
from llama_guard.config.listen import FrontConfig
from llama_guard.front.admission import FailReason, Refused
from llama_guard.front.body import Budget, HeldBody, pin_mmap_threshold
from llama_guard.front.exposed import not_enabled
from llama_guard.front.forward import Forwarder
from llama_guard.front.headers import origin_form
from llama_guard.front.metrics import FrontMetrics
from llama_guard.front.sse import FRONT_DOOR
from llama_guard.model.types import State
from llama_guard.status.health import HEALTH_PATHS, health_response

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # aiohttp's own dependency below Python 3.11
    from async_timeout import timeout

GONE = "gone"  # llama_guard_front_requests_total's code for a client that left before its answer was complete
RETRY_AFTER_S = 5  # what a refused client is told to wait (seconds)
FD_RESERVE = 256  # file descriptors kept for the daemon itself (see effective_max_connections)
# asyncio accepts at most its ``backlog`` connections in one loop step: a flood of connections is taken
# in slices of ACCEPT_SLICE with the policy's decisions in between, while the kernel's queue holds
# LISTEN_BACKLOG (capped by net.core.somaxconn) so that a burst waits there instead of in SYN retries.
ACCEPT_SLICE = 128
LISTEN_BACKLOG = 4096
READ_CHUNK = 65536
# After a body the front door refused (413, 408), aiohttp reads and drops the rest of it before the
# close (so that the client reads its answer rather than a TCP reset) — 10 s by default, at the
# client's speed: a body that never ends would keep the loop copying garbage. One second is enough.
LINGER_S = 1.0


def _quiet_logger() -> logging.Logger:
    """A logger that writes nothing: aiohttp's error logs may quote the request they failed on."""
    logger = logging.getLogger("llama_guard.front.http")
    logger.propagate = False
    logger.addHandler(logging.NullHandler())
    return logger


def error_response(status: int, message: str, *, retry_after: int | None = None) -> web.Response:
    """A JSON error in llama-server's shape: ``{"error": {"code", "message", "type"}}``, its message
    beginning with :data:`~llama_guard.front.sse.FRONT_DOOR` (the front door answered, not llama-server)."""
    kind = "unavailable_error" if status == 503 else "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"code": status, "message": FRONT_DOOR + message, "type": kind}})
    headers = {hdrs.RETRY_AFTER: str(retry_after)} if retry_after is not None else None
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


class BodyError(Exception):
    """A request body the front door refuses: ``status`` (408, 413) and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def effective_max_connections(configured: int) -> int:
    """``[front].max_connections``, lowered so that client connections never take the last
    :data:`FD_RESERVE` file descriptors of the daemon's soft RLIMIT_NOFILE (its probes, its pidfd, its
    status file and the upstream connections need them: a flood of connections must not blind the
    supervision)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, soft - FD_RESERVE))


class _Refuse(asyncio.Protocol):
    """A connection past ``max_connections``: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class FrontApp:
    """Serves the front door on its listening sockets; ``get_config`` is read live, ``last_state`` is the
    policy's state as the loop's last record left it (the health answers, at ``clock``'s monotonic
    seconds: the daemon's clock), and ``get_endpoints`` is read live (what llama-server serves under the
    user's own flags: the rest is answered here)."""

    def __init__(self, forwarder: Forwarder, metrics: FrontMetrics, *,
                 get_config: Callable[[], FrontConfig], last_state: Callable[[], State],
                 get_endpoints: Callable[[], Endpoints], clock: Callable[[], float]) -> None:
        self.forwarder = forwarder
        self.metrics = metrics
        self._config = get_config
        self._state = last_state
        self._clock = clock
        self._endpoints = get_endpoints
        self._seq = itertools.count()
        self.budget = Budget(lambda: self._config().max_buffered_bytes)
        pin_mmap_threshold()
        self._server: web.Server | None = None
        self._listeners: list[asyncio.base_events.Server] = []  # one per address of [front].listen
        self.max_connections = 0  # in force once listening

    @property
    def connections(self) -> int:
        return len(self._server.connections) if self._server is not None else 0

    async def listen(self, host: str, port: int, sock: socket.socket | None = None) -> tuple[str, int]:
        """Serve on ``sock`` (a listening socket passed by systemd's socket activation) or else open
        a listening socket on ``host:port`` (OSError when it cannot be bound); returns the bound
        address. Called once per address of ``[front].listen``: every socket serves the same requests,
        and ``max_connections`` bounds their connections together."""
        front = self._config()
        if self._server is None:
            self._server = web.Server(self._handle, handler_cancellation=True, access_log=None,
                                      logger=_quiet_logger(), keepalive_timeout=front.header_timeout_s,
                                      lingering_time=LINGER_S)
            self.max_connections = effective_max_connections(front.max_connections)
        max_connections = self.max_connections
        server = self._server

        def factory() -> asyncio.Protocol:
            if len(server.connections) >= max_connections:
                return _Refuse()
            return server()

        loop = asyncio.get_running_loop()
        if sock is None:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        try:
            listener = await loop.create_server(factory, sock=sock, backlog=ACCEPT_SLICE)
        except BaseException:
            sock.close()
            raise
        self._listeners.append(listener)
        sock.listen(LISTEN_BACKLOG)  # asyncio listened with its slice: the kernel's queue gets the full length
        bound = listener.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    def stop_accepting(self) -> None:
        """Stop accepting connections; the open ones and their requests in flight go on. For a socket
        systemd passed: only this process's descriptor is closed (never ``shutdown``, which would end it for
        the service manager's copy too), so new connections wait in the kernel's queue for the next daemon
        instead of being answered 503. (A request on a connection accepted before gets its 503 with
        ``Connection: close``: its retry connects anew, into that queue.)"""
        for listener in self._listeners:
            listener.close()
        self._listeners = []

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, then close every connection (bounded by ``timeout_s``): an idle keep-alive
        one at once, one with a request once its answer is written. (aiohttp's ``shutdown`` alone
        waits the whole ``timeout_s`` for an idle connection's next request.)"""
        self.stop_accepting()
        if self._server is not None:
            for connection in self._server.connections:
                connection.close()
            await self._server.shutdown(timeout_s)
            self._server = None

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method in (hdrs.METH_GET, hdrs.METH_HEAD) and request.path in HEALTH_PATHS:
            return health_response(request.path, self._state(), self._clock())
        target = origin_form(request)
        if target is None:
            return self._answer(error_response(400, "the request target must be a path (/...) or an absolute URL"))
        off = not_enabled(request.method, target, self._endpoints())
        if off is not None:
            return self._answer(off)
        seq = next(self._seq)
        front = self._config()
        body = HeldBody(self.budget)
        try:
            await self._read_body(request, front, body)
            return await self.forwarder.forward(request, body, seq)
        except BodyError as exc:
            return self._answer(error_response(exc.status, str(exc)))
        except Refused as refused:
            return self._refused(refused)
        except asyncio.CancelledError:  # the client closed its connection before its answer was complete
            self.metrics.requests.labels(GONE).inc()
            raise
        finally:
            body.release()

    async def _read_body(self, request: web.BaseRequest, front: FrontConfig, body: HeldBody) -> None:
        """Read the whole body into ``body``, which holds of the budget only the bytes that came.
        Raises :class:`BodyError` (413 over ``max_body_bytes``, 408 when the body is not complete
        within ``body_timeout_s`` of the request head, whatever size it declares) or :class:`Refused`
        (BUFFER_FULL: no room in the budget for the bytes that came)."""
        if (request.content_length or 0) > front.max_body_bytes:
            raise BodyError(413, f"the request body is over {front.max_body_bytes} bytes ([front].max_body_bytes)")

        if request.content.is_eof():  # the whole body came with the head (a small one): nothing to wait for
            self._take(request.content.read_nowait(), front, body)
            body.complete()
            return
        try:
            async with timeout(front.body_timeout_s):  # no task of its own, unlike asyncio.wait_for
                if request.version >= (1, 1) and request.headers.get(hdrs.EXPECT, "").lower() == "100-continue":
                    # The client waits for this before it sends the body (curl does so for large bodies);
                    # aiohttp's router sends the same in its default expect handler.
                    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                while chunk := await request.content.read(READ_CHUNK):
                    self._take(chunk, front, body)
        except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
            raise BodyError(408, f"the request body did not arrive within {front.body_timeout_s:g} s "
                                 "([front].body_timeout_s)") from None
        body.complete()

    @staticmethod
    def _take(chunk: bytes, front: FrontConfig, body: HeldBody) -> None:
        """Add ``chunk`` to ``body``: :class:`BodyError` 413 past ``max_body_bytes``, :class:`Refused`
        (BUFFER_FULL) when the budget has no room for it."""
        if body.taken + len(chunk) > front.max_body_bytes:
            raise BodyError(413, f"the request body is over {front.max_body_bytes} bytes ([front].max_body_bytes)")
        if chunk and not body.add(chunk):
            raise Refused(FailReason.BUFFER_FULL)

    def _refused(self, refused: Refused) -> web.Response:
        self.metrics.failed.labels(refused.reason.value).inc()
        response = error_response(refused.status, refused.message,
                                  retry_after=(refused.retry_after_s or RETRY_AFTER_S) if refused.status == 503
                                  else None)
        if refused.reason is FailReason.DAEMON_EXITING:
            response.force_close()  # the client's retry connects anew: to the next daemon (socket activation)
        return self._answer(response)

    def _answer(self, response: web.Response) -> web.Response:
        self.metrics.requests.labels(str(response.status)).inc()
        return response
