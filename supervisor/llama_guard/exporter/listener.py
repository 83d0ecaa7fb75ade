"""The ``[metrics]`` listener: ``/metrics``, ``/livez`` and ``/readyz`` from an aiohttp server on the
daemon's loop (the server stack the front door uses; no thread of its own).

``/livez`` and ``/readyz`` are answered on the loop (:mod:`llama_guard.status.health`). A scrape is
rendered by prometheus-client (text format, or OpenMetrics when the scraper's ``Accept`` asks for it)
on a :class:`~llama_guard.core.offload.Lane` of kind ``SCRAPE``: the collectors read the runtime dir
(the last bench), which must never hold up the loop; a render that takes over
:data:`SCRAPE_TIMEOUT_S` is answered 503. Any other path answers the metrics too, as prometheus-client's
own server does. Nothing here logs a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from llama_guard.core.offload import CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.model.types import State
from llama_guard.status.health import HEALTH_PATHS, health_response

SCRAPE_TIMEOUT_S = 10.0  # a scrape's rendering must finish within this many seconds (Prometheus' default timeout)
REFRESH_TIMEOUT_S = 1.0  # the most a scrape waits for its refresh (llama-server's /slots) before rendering
HEADER_TIMEOUT_S = 15.0  # an idle keep-alive connection is closed after this many seconds


class MetricsListener:
    """Serves ``registry`` and the health answers for ``last_state`` (the policy's state as the loop's last
    record left it, at ``clock``'s monotonic seconds: the daemon's clock) on one listening socket; ``refresh``
    runs on the loop before each scrape's render (what must be read at the scrape: llama-server's slots),
    within :data:`REFRESH_TIMEOUT_S`."""

    def __init__(self, registry: CollectorRegistry, last_state: Callable[[], State], clock: Callable[[], float],
                 refresh: Callable[[], Awaitable[None]] | None = None) -> None:
        self._registry = registry
        self._state = last_state
        self._clock = clock
        self._refresh = refresh
        self._lane = Lane(LaneKind.SCRAPE)
        self._server: web.Server | None = None
        self._listener: asyncio.base_events.Server | None = None

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        """Bind ``host:port`` (IPv4 or IPv6, by what ``host`` resolves to first; port 0: any) and
        serve; returns the bound address. Raises OSError when it cannot bind."""
        logger = logging.getLogger("llama_guard.metrics.http")
        logger.propagate = False  # aiohttp's error lines may quote the request
        logger.addHandler(logging.NullHandler())
        self._server = web.Server(self._handle, handler_cancellation=True, access_log=None, logger=logger,
                                  keepalive_timeout=HEADER_TIMEOUT_S)
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family)
        try:
            self._listener = await asyncio.get_running_loop().create_server(self._server, sock=sock)
        except BaseException:
            sock.close()
            raise
        bound = self._listener.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def close(self) -> None:
        """Stop accepting and close every connection (an answer being written ends first, within 2 s)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._server is not None:
            for connection in self._server.connections:
                connection.close()
            await self._server.shutdown(2.0)
            self._server = None

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method not in (hdrs.METH_GET, hdrs.METH_HEAD):
            return web.Response(status=405, headers={hdrs.ALLOW: "GET, HEAD"})
        if request.path in HEALTH_PATHS:
            return health_response(request.path, self._state(), self._clock())
        encoder, content_type = choose_encoder(request.headers.get(hdrs.ACCEPT, ""))
        if self._refresh is not None:
            with contextlib.suppress(asyncio.TimeoutError):  # the scrape goes on with what it has
                await asyncio.wait_for(self._refresh(), REFRESH_TIMEOUT_S)
        try:
            body = await self._lane.run(lambda: encoder(self._registry), SCRAPE_TIMEOUT_S, "a /metrics scrape")
        except (CallTimeout, LaneBusy) as exc:
            return web.Response(status=503, text=f"llama-guard: {exc}\n")
        return web.Response(body=body, headers={hdrs.CONTENT_TYPE: content_type})
