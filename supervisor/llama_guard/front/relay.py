"""Relaying an answer that began in llama-server to the client, byte for byte as it comes.

An answer begins with its first event — its first body byte, but for SSE comments (llama-server's
pings); until then the request may still be replayed (:meth:`Relay.opening`, :class:`Unanswered`).
A stream of generated text cut after that raises :class:`Cut` for the forwarder to resume
(:mod:`llama_guard.front.resume`); any other body cut by a server failure ends, for
``text/event-stream``, with one SSE error event and a closed body (:mod:`llama_guard.front.sse`), and
is otherwise cut short (the connection is closed before its end), so that the client can tell it is
incomplete. An answer a slot took (its headers came) whose first event does not come within
``[front].first_event_timeout_s`` ends with 504 and is reported as a stall. Outcomes are typed inputs
to the policy: a generation or embedding answered in full whose answer proves the server decoded
(:mod:`llama_guard.front.decoded`; any other 2xx proves nothing) is :class:`RequestCompleted`, a 5xx
is :class:`UpstreamError`, the first event of a held request's 2xx answer is :class:`FirstToken`;
:meth:`Relay.stalled` finds streams that stopped (seconds of monotonic ``clock``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import hdrs, web

from llama_guard.core.suspects import Fingerprint
from llama_guard.front.admission import FailReason, Refused
from llama_guard.front.crashes import CrashSuspects
from llama_guard.front.decoded import Witness
from llama_guard.front.endpoints import Work
from llama_guard.front.headers import RESPONSE_DROP, end_to_end
from llama_guard.front.metrics import FrontMetrics
from llama_guard.front.resume import Transcript
from llama_guard.front.sse import NO_BUFFERING, error_event, is_comment, is_sse
from llama_guard.model.inputs import FirstToken, Input, RequestCompleted, StreamStalled, UpstreamError

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # aiohttp's own dependency below Python 3.11
    from async_timeout import timeout


class SizedAnswer(web.StreamResponse):
    """A relayed answer of known length (``Content-Length``: a whole JSON answer, which llama-server
    writes at once): its status line and headers go out in one write with its first body bytes — one
    send and one wake-up of the client instead of two. (A stream's headers go out at once, as
    llama-server sends them before its prefill: the client has parsed them by the first token.)
    aiohttp's own ``web.Response`` sets the same class attribute (``aiohttp/web_response.py``); a write
    of no bytes sends the headers alone."""

    _send_headers_immediately = False


class Unanswered(Exception):
    """A stream whose server failed before its first event: the client has its status line and
    headers (``out``, sent on as llama-server sent them, when it took the request) and no event of its
    body (SSE comments at most), so the request may be replayed and the next server's stream continue
    ``out``."""

    def __init__(self, out: web.StreamResponse) -> None:
        super().__init__("llama-server failed before the stream's first event")
        self.out = out


class Cut(Exception):
    """A stream of generated text that had begun (``out``: the client's, some events sent) was cut by
    the end of server ``pid``; its :class:`~llama_guard.front.resume.Transcript` says what was sent, so
    that the next server may continue it, or ``out`` ends with an error event (:meth:`Relay.end_stream`)."""

    def __init__(self, out: web.StreamResponse, pid: int) -> None:
        super().__init__(f"llama-server (pid {pid}) failed while the stream was relayed")
        self.out = out
        self.pid = pid


@dataclass(eq=False)
class Flight:
    """One answer being relayed from server ``pid``: ``began`` once its first event (first body byte
    but for SSE comments) came; ``waiting_since`` (monotonic) while the relay waits on the server, since
    its last event (comments do not count); ``reported_at`` when it was last reported stalled."""

    pid: int
    began: bool = False
    waiting_since: float | None = None
    reported_at: float | None = None


class Relay:
    """Copies begun answers to their clients; :attr:`flights` are those being relayed. ``post``
    queues a policy input; ``suspects`` hears of each answer in full and each cut;
    ``first_event_s()``: ``[front].first_event_timeout_s`` (read when used; 0 = off)."""

    def __init__(self, metrics: FrontMetrics, suspects: CrashSuspects, *, post: Callable[[Input], None],
                 clock: Callable[[], float], first_event_s: Callable[[], float] = lambda: 0.0) -> None:
        self._metrics = metrics
        self._suspects = suspects
        self._post = post
        self._clock = clock
        self._first_event_s = first_event_s
        self.flights: set[Flight] = set()

    def _first_by(self) -> float | None:
        """The monotonic time by which an answer whose headers came now must send its first event."""
        limit = self._first_event_s()
        return self._clock() + limit if limit > 0 else None

    def _late(self, pid: int, since: float) -> None:
        """Server ``pid`` took a request at ``since`` and sent no event in time: evidence for liveness."""
        self._post(StreamStalled(pid, self._clock() - since))

    async def opening(self, upstream: aiohttp.ClientResponse, pid: int) -> bytes | None:
        """For an answer of known length (``Content-Length``, no ``Transfer-Encoding``): its first body
        bytes (``b""`` for an empty body), read before anything goes to the client — a server that
        fails between its headers and its body (a crash in another of its threads; cpp-httplib writes
        the two apart) has then sent the client nothing, and the request counts as unanswered. None for
        an answer of unknown length (a stream: :class:`Unanswered`). Raises
        :class:`aiohttp.ClientPayloadError` (``upstream`` closed) when the server failed first, and
        :class:`Refused` (FIRST_EVENT_TIMEOUT, 504; reported to the policy as a stall of server ``pid``)
        when no body byte came within ``[front].first_event_timeout_s`` of the headers."""
        if upstream.content_length is None or hdrs.TRANSFER_ENCODING in upstream.headers:
            return None
        since, first_by = self._clock(), self._first_by()
        try:
            if first_by is None:
                return await upstream.content.readany()
            async with timeout(max(0.0, first_by - since)):
                return await upstream.content.readany()
        except asyncio.TimeoutError:
            upstream.close()
            self._late(pid, since)
            raise Refused(FailReason.FIRST_EVENT_TIMEOUT) from None
        except (aiohttp.ClientError, OSError) as err:
            upstream.close()
            raise aiohttp.ClientPayloadError(f"llama-server failed before its answer's body: {err}") from err
        except BaseException:
            upstream.close()
            raise

    async def relay(self, request: web.BaseRequest, upstream: aiohttp.ClientResponse, opening: bytes | None,
                    pid: int, work: Work | None, fp: Fingerprint, *, held: bool, begun: web.StreamResponse | None,
                    on_begin: Callable[[], None], transcript: Transcript | None = None) -> web.StreamResponse:
        """Copy the answer in ``upstream`` (``opening``: its first body bytes, already read, for an
        answer of known length: :meth:`opening`) to the client, byte for byte as it comes; a 2xx answer
        to inference ``work`` is read on the way (:class:`Witness`) for proof of decoding. Answered in
        full, ``fp`` is no suspect; cut by the server's failure, it was in flight at it. ``held``: the
        request waited at the gate; its first byte of a 2xx answer is a FirstToken. ``begun``: the
        client's stream that an earlier server began (headers only, :class:`Unanswered`; or some events,
        :class:`Cut`), which this answer continues when it is a 2xx stream too (else it ends with an SSE
        error event). ``on_begin`` is called before the first event goes to the client. ``transcript``:
        a 2xx stream's events are fed to it, and its cut raises :class:`Cut` instead of ending it.
        Raises :class:`Unanswered` when a stream's server fails before its first event. A stream whose
        first event does not come within ``[front].first_event_timeout_s`` of its headers ends with a
        504 error event (reported to the policy as a stall)."""
        flight = Flight(pid)
        plain = upstream.headers.get(hdrs.CONTENT_ENCODING, "identity").lower() == "identity"
        witness = Witness(work) if work is not None and plain and 200 <= upstream.status < 300 else None
        self.flights.add(flight)
        complete = False
        try:
            sized = opening is not None
            if not sized and upstream.connection is not None and upstream.connection.protocol is not None:
                # llama-server closes its connection right after an answer of unknown length (a
                # stream), whatever its Keep-Alive header says: back in the pool, it would take the
                # next request to a closing connection (failed unanswered, replayed after a pause).
                upstream.connection.protocol.force_close()
            sse = is_sse(upstream.headers.get(hdrs.CONTENT_TYPE, ""))
            if not (sse and 200 <= upstream.status < 300):
                transcript = None
            if begun is not None:
                if not (sse and 200 <= upstream.status < 300):
                    return await self._refused_replay(begun, upstream, opening, pid, fp)
                out = begun
            else:
                out = (SizedAnswer if sized else web.StreamResponse)(
                    status=upstream.status, reason=upstream.reason,
                    headers=end_to_end(upstream.headers, RESPONSE_DROP))
                if sized:
                    out.content_length = upstream.content_length
                if sse:
                    out.headers.setdefault(*NO_BUFFERING)
                try:
                    await out.prepare(request)
                except ConnectionError:
                    return out  # the client left
            pending: bytes | None = opening  # already read
            took = self._clock()  # the headers came: llama-server took the request into a slot
            first_by = None if sized else self._first_by()
            quiet: float | None = None  # since when only comments came (SSE pings)
            waiting = took
            while True:
                if pending is not None:
                    chunk, pending = pending, None
                else:
                    waiting = quiet if quiet is not None else self._clock()
                    flight.waiting_since = waiting
                    try:
                        if first_by is not None and not flight.began:
                            async with timeout(max(0.0, first_by - self._clock())):
                                chunk = await upstream.content.readany()
                        else:
                            chunk = await upstream.content.readany()
                    except asyncio.CancelledError:
                        if not flight.began:  # the client left before the first event: llama-server may
                            self._suspects.failed_under(fp, pid)  # still be at it (a crash then counts)
                        raise
                    except asyncio.TimeoutError:
                        self._late(pid, took)
                        return await self._ended(request, out, sse, FailReason.FIRST_EVENT_TIMEOUT, (
                            f"llama-server (pid {pid}) took this request and sent no event of its answer within "
                            f"{self._first_event_s():g} s ([front].first_event_timeout_s)"), 504)
                    except (aiohttp.ClientError, OSError):
                        if sse and not flight.began:
                            raise Unanswered(out) from None
                        self._suspects.failed_under(fp, pid)
                        if transcript is not None:
                            raise Cut(out, pid) from None
                        return await self._ended(request, out, sse, FailReason.STREAM_CUT, (
                            f"llama-server (pid {pid}) failed while this response was streaming; the response "
                            "is incomplete"))
                    finally:
                        flight.waiting_since = None
                if not chunk:
                    break
                event = not (sse and is_comment(chunk))
                quiet = None if event else waiting
                if event and not flight.began:
                    on_begin()
                try:
                    await out.write(chunk)  # first: the bytes go out before anything else is done with them
                except ConnectionError:  # the client left: llama-server sees its connection close
                    self._metrics.requests.labels(str(upstream.status)).inc()
                    return out
                if not event:
                    continue
                if held and not flight.began and 200 <= upstream.status < 300:
                    self._post(FirstToken(pid))
                flight.began = True
                if witness is not None:
                    witness.feed(chunk)
                if transcript is not None:
                    transcript.feed(chunk)
            complete = True
            self._suspects.answered(fp)
            with contextlib.suppress(ConnectionError):
                await out.write_eof()
            self._metrics.requests.labels(str(upstream.status)).inc()
            if witness is not None and witness.decoded():
                self._post(RequestCompleted(pid))
            elif upstream.status >= 500:
                self._post(UpstreamError(pid, upstream.status))
            return out
        finally:
            self.flights.discard(flight)
            if complete:
                upstream.release()  # back to the pool (an answer of unknown length: closed, see above)
            else:
                upstream.close()  # llama-server sees the connection close and stops the task

    async def _ended(self, request: web.BaseRequest, out: web.StreamResponse, sse: bool, reason: FailReason,
                     message: str, code: int = 502) -> web.StreamResponse:
        """End an answer whose headers went out as an error, never replayed: an SSE stream with an
        error event for ``message`` (``code``), any other body cut short (the connection closed before
        its end)."""
        if sse:
            return await self.end_stream(out, reason, message, code)
        self._metrics.requests.labels("cut").inc()
        self._metrics.failed.labels(reason.value).inc()
        with contextlib.suppress(ConnectionError):
            await out.write(b"")  # the headers, if no body byte took them along yet
        if request.transport is not None:
            request.transport.close()  # what was written is flushed, then the body ends short
        return out

    async def _refused_replay(self, begun: web.StreamResponse, upstream: aiohttp.ClientResponse,
                              opening: bytes | None, pid: int, fp: Fingerprint) -> web.StreamResponse:
        """The replay of a stream whose headers went out was answered with no stream (an error, as a
        JSON answer): end the client's stream with an error event carrying that status and the start
        of that answer. The request was answered: no suspect; a 5xx is an UpstreamError."""
        text = (opening or b"")[:300].decode("utf-8", "replace")
        self._suspects.answered(fp)
        if upstream.status >= 500:
            self._post(UpstreamError(pid, upstream.status))
        return await self.end_stream(begun, FailReason.UPSTREAM_FAILED, (
            f"llama-server (pid {pid}) answered this request, sent once more after the server before it failed, "
            f"with HTTP {upstream.status} instead of a stream: {text}"), code=upstream.status)

    async def end_stream(self, out: web.StreamResponse, reason: FailReason, message: str,
                         code: int = 502) -> web.StreamResponse:
        """End the client's stream ``out`` (its headers sent) with one SSE error event for ``message``
        (``code``: the HTTP status it stands for), counted as cut, failed for ``reason``."""
        self._metrics.requests.labels("cut").inc()
        self._metrics.failed.labels(reason.value).inc()
        with contextlib.suppress(ConnectionError):
            await out.write(error_event(message, code))
            await out.write_eof()
        return out

    def stalled(self, now: float, stall_s: float) -> list[tuple[int, float]]:
        """``(pid, seconds)`` of each begun answer that has waited ``stall_s`` seconds or more for
        its next event from the server (SSE comments, llama-server's pings, do not count; again each
        further ``stall_s``); marks them reported."""
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
