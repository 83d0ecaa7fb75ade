"""Forwarding one client request to llama-server: the replay rule and the relay of the answer.

The rules (ours; the HTTP work is aiohttp's):

- A request goes upstream only through :meth:`Admission.admit` (the policy says the server is ready).
- A connection llama-server refused or did not accept (it died, or is not listening yet) was never
  sent: the request waits again (held, bounded by ``hold_timeout_s``) and is tried again.
- A request that was sent and got no byte of an answer back before the connection failed (the server
  died under it) is sent once more, to the next ready server, if that is safe (a GET/HEAD or an
  inference POST: :mod:`llama_guard.front.endpoints`; else 502 naming why). A second such failure is
  answered 502 — 422 when the request was in flight at both as crashes: requests in flight at a crash
  are suspects, sent alone (:mod:`llama_guard.core.suspects`, :attr:`Forwarder.lane`), and one in
  flight at two crashes is refused for ``[front].crash_refuse_s``, its retries included.
- Once the answer has begun (status line and headers came back) nothing is replayed. A body cut by a
  server failure ends, for ``text/event-stream``, with one SSE error event and a closed body
  (:mod:`llama_guard.front.sse`); any other body is cut short (the connection is closed before its
  end), so that the client can tell it is incomplete.
- Headers and bodies pass through untouched but for the hop-by-hop headers (RFC 9110, section 7.6.1),
  which belong to each connection; the API key (``Authorization``) goes to llama-server, which checks
  it. Nothing here logs a header or a body.
- Outcomes are typed inputs to the policy: a generation or embedding answered in full whose answer
  proves the server decoded (:mod:`llama_guard.front.decoded`; any other 2xx proves nothing) is
  :class:`RequestCompleted`, a 5xx is :class:`UpstreamError`; :meth:`Forwarder.stalled` finds
  streams that stopped (StreamStalled).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from llama_guard.core.client import UPSTREAM_KEEPALIVE_S
from llama_guard.core.inputs import FirstToken, Input, RequestCompleted, UpstreamError
from llama_guard.core.suspects import Admit, Book, Fingerprint, admit, answered, ended, in_flight, is_crash
from llama_guard.core.types import State
from llama_guard.front.admission import Admission, FailReason, Gate, Refused
from llama_guard.front.body import HeldBody
from llama_guard.front.decoded import Witness
from llama_guard.front.endpoints import Work, path_of, replayable, work_of
from llama_guard.front.metrics import FrontMetrics
from llama_guard.front.sse import NO_BUFFERING, error_event, is_sse

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "transfer-encoding", "upgrade"})
# Set again by aiohttp from the body we send (same value) / handled by the front door itself.
REQUEST_DROP = HOP_BY_HOP | {"content-length", "expect"}
RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
CONNECT_TIMEOUT_S = 5.0
RETRY_PAUSE_S = (0.05, 0.1, 0.2, 0.4, 0.5)  # between tries while the policy still says ready
JUDGE_WAIT_S = 5.0  # after a replay failed: how long to wait for the policy to judge that server's end


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


def wall_time(after_s: float) -> str:
    """The UTC wall-clock time ``after_s`` seconds from now, ISO 8601 to the second."""
    when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=after_s)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _not_replayed(method: str, target: str, pid: int) -> str:
    return (f"llama-server (pid {pid}) failed before answering {method} {path_of(target)}; it is not sent again: "
            "only GET/HEAD and inference requests (completions, chat, embeddings, tokenize, ...) are replayed, "
            "a request that may change the server's state (slots, LoRA adapters, props) or an unknown one is not")


class SizedAnswer(web.StreamResponse):
    """A relayed answer of known length (``Content-Length``: a whole JSON answer, which llama-server
    writes at once): its status line and headers go out in one write with its first body bytes — one
    send and one wake-up of the client instead of two. (A stream's headers go out at once, as
    llama-server sends them before its first token.) aiohttp's own ``web.Response`` sets the same
    class attribute (``aiohttp/web_response.py``); a write of no bytes sends the headers alone."""

    _send_headers_immediately = False


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
    (``limits``) and ``[front].crash_refuse_s`` (``refuse_s``) are read when used (they are
    reloadable); ``announce(fingerprint, crash pids, refused for s)``: a request is refused from now on."""

    def __init__(self, base_url: str, admission: Admission, metrics: FrontMetrics, *,
                 post: Callable[[Input], None], clock: Callable[[], float],
                 limits: Callable[[], tuple[float, int]], refuse_s: Callable[[], float],
                 announce: Callable[[Fingerprint, tuple[int, ...], float], None]) -> None:
        self.base_url = base_url
        self.admission = admission
        self.metrics = metrics
        self._post = post
        self._clock = clock
        self._limits = limits
        self._refuse_s = refuse_s
        self._announce = announce
        self.book = Book()  # requests in flight at server ends (core/suspects.py)
        self.lane = asyncio.Lock()  # suspects go to the server one at a time (FIFO)
        self._serving: int | None = None  # the server pid the policy's state names
        self._judgement = asyncio.Event()  # set when a server's end is judged
        self.flights: set[Flight] = set()
        self.in_flight = 0  # requests sent to llama-server whose answer is not yet relayed in full
        self._idle = asyncio.Event()  # set while in_flight is 0
        self._idle.set()
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        """Create the upstream client (no cookies kept, nothing decompressed, no proxy from the
        environment, no header added on its own)."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S, use_dns_cache=True)
        self._session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, trust_env=False,
            skip_auto_headers=(hdrs.USER_AGENT, hdrs.ACCEPT, hdrs.ACCEPT_ENCODING, hdrs.CONTENT_TYPE),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S))

    async def drop_idle(self) -> None:
        """Close the upstream pool's connections when no request is in flight (after a drain; new
        requests open new ones): llama-server's graceful exit waits for idle keep-alive connections."""
        old = self._session
        if old is None or self.in_flight:
            return
        await self.open()
        await old.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def forward(self, request: web.BaseRequest, body: HeldBody, seq: int) -> web.StreamResponse:
        """Answer ``request`` (its ``body`` already read; ``seq`` its arrival number) from llama-server.
        The body is released once the answer has begun (it is no longer needed for a replay). Raises
        :class:`Refused` when the front door must answer itself."""
        assert self._session is not None
        hold_timeout_s, max_held = self._limits()
        arrived = since = self._clock()
        target = origin_form(request) or "/"
        url = URL(self.base_url + target, encoded=True)
        headers = end_to_end(request.headers, REQUEST_DROP)
        fp = Fingerprint(request.method, target, body.sha256)
        replayed = False
        in_lane = False
        tries = 0
        held = False
        try:
            while True:
                self._check(fp)
                if self.admission.gate is not Gate.OPEN and not held:
                    held = True
                    self.metrics.held.inc()
                pid, held_s = await self.admission.admit(seq, arrived=arrived, since=since, hold_s=hold_timeout_s,
                                                         max_held=max_held, replay=replayed)
                if held_s > 0:
                    self.metrics.held_seconds.observe(held_s)
                if self._check(fp) and not in_lane:
                    in_lane = await self._enter_lane(since, hold_timeout_s)
                    continue  # the server may have changed while it waited in the lane
                self._enter()
                try:
                    upstream = await self._session.request(request.method, url, headers=headers, data=body.data,
                                                           allow_redirects=False, compress=None)
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):  # not sent: no server there
                    pass
                except asyncio.CancelledError:  # the client left; llama-server may still be working on it
                    self._failed_under(fp, pid)
                    raise
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):  # sent, nothing came back
                    self._failed_under(fp, pid)
                    if not replayable(request.method, target):
                        raise Refused(FailReason.NOT_REPLAYABLE, _not_replayed(request.method, target, pid)) from None
                    if replayed:  # sent once more already: no third time
                        await self._judged(pid)
                        self._check(fp)  # 422 when both ends were crashes
                        raise Refused(FailReason.UPSTREAM_FAILED) from None
                    replayed = True
                    self.metrics.replayed.inc()
                    since = self._clock()  # held again, for as long as a new arrival
                else:
                    body.release()
                    return await self._relay(request, upstream, pid, work_of(request.method, target), fp, held=held)
                finally:
                    self._leave()
                deadline = self.admission.deadline(since, hold_timeout_s)
                if deadline is not None and self._clock() >= deadline:
                    raise Refused(FailReason.HOLD_TIMEOUT)
                await asyncio.sleep(RETRY_PAUSE_S[min(tries, len(RETRY_PAUSE_S) - 1)])
                tries += 1
        finally:
            if in_lane:
                self.lane.release()

    def _check(self, fp: Fingerprint) -> bool:
        """Whether ``fp`` is a suspect (it goes alone, through :attr:`lane`). Raises :class:`Refused`
        (CRASHED_TWICE, naming until when) for a request in flight at two crashes."""
        verdict, until = admit(self.book, fp, self._clock())
        if verdict is Admit.REFUSE:
            assert until is not None
            crashes = ", ".join(str(p) for p in self.book.crashes(fp))
            raise Refused(FailReason.CRASHED_TWICE, (
                f"this request ({fp.method} {path_of(fp.target)}, body sha256 {fp.body_sha256[:16]}) was in flight "
                f"at two llama-server crashes (pids {crashes}) and is refused until "
                f"{wall_time(until - self._clock())} ([front].crash_refuse_s)"))
        return verdict is Admit.SERIAL

    async def _judged(self, pid: int) -> None:
        """Wait until the end of server ``pid`` is judged (the policy's state no longer names it), at
        most :data:`JUDGE_WAIT_S`."""
        until = self._clock() + JUDGE_WAIT_S
        while pid not in self.book.endings and self._clock() < until:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._judgement.wait(), until - self._clock())

    async def _enter_lane(self, since: float, hold_s: float) -> bool:
        """Wait for the suspects' lane (one suspect at a time), at most until the hold deadline
        (:meth:`Admission.deadline`; while a drain holds deadlines off, ``hold_s`` from now)."""
        deadline = self.admission.deadline(since, hold_s)
        wait_s = hold_s if deadline is None else max(0.0, deadline - self._clock())
        try:
            await asyncio.wait_for(self.lane.acquire(), wait_s)
        except asyncio.TimeoutError:
            raise Refused(FailReason.HOLD_TIMEOUT) from None
        return True

    def _failed_under(self, fp: Fingerprint, pid: int) -> None:
        """``fp`` was in flight at server ``pid`` when its connection failed — or when its client left
        before the answer began (the server may go on with its prefill): if ``pid`` ends by a crash, it
        counts (:mod:`llama_guard.core.suspects`)."""
        self.book, refused = in_flight(self.book, fp, pid, self._clock(), self._refuse_s())
        if refused:
            self._refused(fp)

    def _refused(self, fp: Fingerprint) -> None:
        mark = self.book.marks[fp]
        assert mark.refused_until is not None
        self.metrics.crash_refusals.inc()
        self._announce(fp, self.book.crashes(fp), mark.refused_until - self._clock())

    def observe(self, state: State) -> None:
        """Follow the policy's ``state``: when the server it had ends, judge that end (a crash a
        request can cause, or not) for the requests that were in flight at it."""
        if state.pid == self._serving:
            return
        if self._serving is not None:
            crash = is_crash(state.failure.cause, state.exit_signal)
            self.book, refused = ended(self.book, self._serving, crash, self._clock(), self._refuse_s())
            for fp in refused:
                self._refused(fp)
            self._judgement.set()  # wake the requests waiting for it, with a fresh event for the next end
            self._judgement = asyncio.Event()
        self._serving = state.pid

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight to llama-server (sent, or its answer being relayed)."""
        await self._idle.wait()

    async def _relay(self, request: web.BaseRequest, upstream: aiohttp.ClientResponse,
                     pid: int, work: Work | None, fp: Fingerprint, *, held: bool) -> web.StreamResponse:
        """Copy the answer that began in ``upstream`` to the client, byte for byte as it comes; a
        2xx answer to inference ``work`` is read on the way (:class:`Witness`) for proof of decoding.
        Answered in full, ``fp`` is no suspect; cut by the server's failure, it was in flight at it.
        ``held``: the request waited at the gate; its first byte of a 2xx answer is a FirstToken."""
        flight = Flight(pid)
        plain = upstream.headers.get(hdrs.CONTENT_ENCODING, "identity").lower() == "identity"
        witness = Witness(work) if work is not None and plain and 200 <= upstream.status < 300 else None
        self.flights.add(flight)
        complete = False
        try:
            sized = upstream.content_length is not None and hdrs.TRANSFER_ENCODING not in upstream.headers
            out = (SizedAnswer if sized else web.StreamResponse)(
                status=upstream.status, reason=upstream.reason, headers=end_to_end(upstream.headers, RESPONSE_DROP))
            if sized:
                out.content_length = upstream.content_length
            elif upstream.connection is not None and upstream.connection.protocol is not None:
                # llama-server closes its connection right after an answer of unknown length (a
                # stream), whatever its Keep-Alive header says: back in the pool, it would take the
                # next request to a closing connection (failed unanswered, replayed after a pause).
                upstream.connection.protocol.force_close()
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
                    self._failed_under(fp, pid)
                    return await self._cut(request, out, sse, pid)
                finally:
                    flight.waiting_since = None
                if not chunk:
                    break
                try:
                    await out.write(chunk)  # first: the bytes go out before anything else is done with them
                except ConnectionError:  # the client left: llama-server sees its connection close
                    self.metrics.requests.labels(str(upstream.status)).inc()
                    return out
                if held and not flight.began and 200 <= upstream.status < 300:
                    self._post(FirstToken(pid))
                flight.began = True
                if witness is not None:
                    witness.feed(chunk)
            complete = True
            self.book = answered(self.book, fp)
            with contextlib.suppress(ConnectionError):
                await out.write_eof()
            self.metrics.requests.labels(str(upstream.status)).inc()
            if witness is not None and witness.decoded():
                self._post(RequestCompleted(pid, witness.reuse()))
            elif upstream.status >= 500:
                self._post(UpstreamError(pid, upstream.status))
            return out
        finally:
            self.flights.discard(flight)
            if complete:
                upstream.release()  # back to the pool (an answer of unknown length: closed, see above)
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
        with contextlib.suppress(ConnectionError):
            await out.write(b"")  # the headers, if no body byte took them along yet
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
