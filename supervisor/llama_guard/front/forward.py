"""Forwarding one client request to llama-server: the replay rule and the relay of the answer.

The rules (ours; the HTTP work is aiohttp's):

- A request goes upstream only through :meth:`Admission.admit` (the policy says the server is ready).
- A connection llama-server refused or did not accept (it died, or is not listening yet) was never
  sent: the request waits again (held, bounded by ``hold_timeout_s``) and is tried again.
- A request that was sent and got no byte of an answer back before the connection failed (the server
  died under it) is sent once more, to the next ready server: a completion changes no server state.
  A second such failure is answered 502.
- Once the answer has begun (status line and headers came back) nothing is replayed. A body cut by a
  server failure ends, for ``text/event-stream``, with one SSE error event and a closed body
  (:mod:`llama_guard.front.sse`); any other body is cut short (the connection is closed before its
  end), so that the client can tell it is incomplete.
- Headers and bodies pass through untouched but for the hop-by-hop headers (RFC 9110, section 7.6.1),
  which belong to each connection; the API key (``Authorization``) goes to llama-server, which checks
  it. Nothing here logs a header or a body.
- Outcomes are typed inputs to the policy: a 2xx answered in full is :class:`RequestCompleted`, a 5xx
  is :class:`UpstreamError`; :meth:`Forwarder.stalled` finds streams that stopped (StreamStalled).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from llama_guard.core.client import UPSTREAM_KEEPALIVE_S
from llama_guard.core.inputs import Input, RequestCompleted, UpstreamError
from llama_guard.front.admission import Admission, FailReason, Gate, Refused
from llama_guard.front.metrics import FrontMetrics
from llama_guard.front.sse import NO_BUFFERING, error_event, is_sse

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "transfer-encoding", "upgrade"})
# Set again by aiohttp from the body we send (same value) / handled by the front door itself.
REQUEST_DROP = HOP_BY_HOP | {"content-length", "expect"}
RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
CONNECT_TIMEOUT_S = 5.0
RETRY_PAUSE_S = (0.05, 0.1, 0.2, 0.4, 0.5)  # between tries while the policy still says ready


def end_to_end(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` without ``drop`` and without the headers the ``Connection`` header names."""
    listed = {token.strip().lower() for value in headers.getall(hdrs.CONNECTION, ()) for token in value.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        low = name.lower()
        if low not in drop and low not in listed:
            out.add(name, value)
    return out


def origin_form(request: web.BaseRequest) -> str | None:
    """The request's target as llama-server gets it: ``/path?query`` byte for byte as the client sent
    it, or the path and query of an absolute-form target (``http://host/path``, which a server must
    accept: RFC 9112, section 3.2.2 — the host it names is not contacted). None for the asterisk form
    (``OPTIONS *``: a question about the front door itself, nothing to forward)."""
    raw = request.raw_path
    if raw.startswith("/"):
        return raw
    if raw == "*":
        return None
    path = request.rel_url.raw_path_qs
    return path if path.startswith("/") else "/" + path


@dataclass(eq=False)
class Flight:
    """One answer being relayed from server ``pid``: ``began`` once its first body byte came;
    ``waiting_since`` (monotonic) while the relay waits for the next byte from the server;
    ``reported_at`` when it was last reported stalled."""

    pid: int
    began: bool = False
    waiting_since: float | None = None
    reported_at: float | None = None


class Forwarder:
    """Sends requests to llama-server at ``base_url`` and relays the answers to the clients.

    ``post``: queues a policy input; ``clock``: monotonic seconds; ``hold_timeout_s`` and ``max_held``
    are read at each request (they are reloadable)."""

    def __init__(self, base_url: str, admission: Admission, metrics: FrontMetrics, *,
                 post: Callable[[Input], None], clock: Callable[[], float],
                 limits: Callable[[], tuple[float, int]]) -> None:
        self.base_url = base_url
        self.admission = admission
        self.metrics = metrics
        self._post = post
        self._clock = clock
        self._limits = limits
        self.flights: set[Flight] = set()
        self.in_flight = 0
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        """Create the upstream client (no cookies kept, nothing decompressed, no proxy from the
        environment, no header added on its own)."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S, use_dns_cache=True)
        self._session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, trust_env=False,
            skip_auto_headers=(hdrs.USER_AGENT, hdrs.ACCEPT, hdrs.ACCEPT_ENCODING, hdrs.CONTENT_TYPE),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def forward(self, request: web.BaseRequest, body: bytes, seq: int,
                      on_answer: Callable[[], None]) -> web.StreamResponse:
        """Answer ``request`` (its ``body`` already read; ``seq`` its arrival number) from llama-server.
        ``on_answer`` is called once the answer has begun (the body is no longer needed). Raises
        :class:`Refused` when the front door must answer itself."""
        assert self._session is not None
        hold_timeout_s, max_held = self._limits()
        deadline = self._clock() + hold_timeout_s
        url = URL(self.base_url + (origin_form(request) or "/"), encoded=True)
        headers = end_to_end(request.headers, REQUEST_DROP)
        sent = 0
        tries = 0
        held = False
        while True:
            if self.admission.gate is not Gate.OPEN and not held:
                held = True
                self.metrics.held.inc()
            pid, held_s = await self.admission.admit(seq, deadline, max_held)
            if held_s > 0:
                self.metrics.held_seconds.observe(held_s)
            self.in_flight += 1
            try:
                upstream = await self._session.request(request.method, url, headers=headers, data=body,
                                                       allow_redirects=False, compress=None)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):  # not sent: no server there
                pass
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):  # sent, nothing came back
                sent += 1
                if sent >= 2:
                    raise Refused(FailReason.UPSTREAM_FAILED) from None
                self.metrics.replayed.inc()
                self.admission.episode.replayed += 1
                deadline = self._clock() + hold_timeout_s  # held again, for as long as a new arrival
            else:
                on_answer()
                return await self._relay(request, upstream, pid)
            finally:
                self.in_flight -= 1
            if self._clock() >= deadline:
                raise Refused(FailReason.HOLD_TIMEOUT)
            await asyncio.sleep(RETRY_PAUSE_S[min(tries, len(RETRY_PAUSE_S) - 1)])
            tries += 1

    async def _relay(self, request: web.BaseRequest, upstream: aiohttp.ClientResponse,
                     pid: int) -> web.StreamResponse:
        """Copy the answer that began in ``upstream`` to the client, byte for byte as it comes."""
        flight = Flight(pid)
        self.flights.add(flight)
        complete = False
        try:
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                     headers=end_to_end(upstream.headers, RESPONSE_DROP))
            if upstream.content_length is not None and hdrs.TRANSFER_ENCODING not in upstream.headers:
                out.content_length = upstream.content_length
            sse = is_sse(upstream.headers.get(hdrs.CONTENT_TYPE, ""))
            if sse:
                out.headers.setdefault(*NO_BUFFERING)
            try:
                await out.prepare(request)
            except ConnectionError:
                return out  # the client left
            while True:
                flight.waiting_since = self._clock()
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, OSError):
                    return await self._cut(request, out, sse, pid)
                finally:
                    flight.waiting_since = None
                if not chunk:
                    break
                flight.began = True
                try:
                    await out.write(chunk)
                except ConnectionError:  # the client left: llama-server sees its connection close
                    self.metrics.requests.labels(str(upstream.status)).inc()
                    return out
            complete = True
            with contextlib.suppress(ConnectionError):
                await out.write_eof()
            self.metrics.requests.labels(str(upstream.status)).inc()
            if 200 <= upstream.status < 300:
                self._post(RequestCompleted(pid))
            elif upstream.status >= 500:
                self._post(UpstreamError(pid, upstream.status))
            return out
        finally:
            self.flights.discard(flight)
            if complete:
                upstream.release()  # back to the pool
            else:
                upstream.close()  # llama-server sees the connection close and stops the task

    async def _cut(self, request: web.BaseRequest, out: web.StreamResponse, sse: bool,
                   pid: int) -> web.StreamResponse:
        """The server failed in the middle of an answer: end it as an error, never replay it."""
        self.metrics.requests.labels("cut").inc()
        self.metrics.failed.labels(FailReason.STREAM_CUT.value).inc()
        if sse:
            with contextlib.suppress(ConnectionError):
                await out.write(error_event(f"llama-server (pid {pid}) failed while this response was "
                                            "streaming; the response is incomplete"))
                await out.write_eof()
            return out
        if request.transport is not None:
            request.transport.close()  # what was written is flushed, then the body ends short
        return out

    def stalled(self, now: float, stall_s: float) -> list[tuple[int, float]]:
        """``(pid, seconds)`` of each begun answer that has waited ``stall_s`` seconds or more for
        its next byte from the server (again each further ``stall_s``); marks them reported."""
        out = []
        for flight in self.flights:
            since = flight.waiting_since
            if not flight.began or since is None or now - since < stall_s:
                continue
            if flight.reported_at is not None and now - flight.reported_at < stall_s:
                continue
            flight.reported_at = now
            out.append((flight.pid, now - since))
        return out
