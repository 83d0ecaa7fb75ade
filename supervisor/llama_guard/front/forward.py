"""Forwarding one client request to llama-server: the holds, the tries and the replay rule.

The rules (ours; the HTTP work is aiohttp's):

- A request goes upstream only through :meth:`Admission.admit` (the policy says the server is ready).
- A connection llama-server refused or did not accept (it died, or is not listening yet) was never
  sent: the request waits again (held, bounded by ``hold_timeout_s``) and is tried again.
- A request that was sent and got no byte of its answer's body back before the connection failed (the
  server died under it) is sent again, to the next ready server, if that is safe (a GET/HEAD or an
  inference POST: :mod:`llama_guard.front.endpoints`; else 502 naming why) — after each server end, as
  long as its answer has not begun, each wait for the next server a hold of its own (the ends are bounded
  by the policy's restart rules). The status line and headers alone do not count, nor SSE comments
  (llama-server's pings): an answer of known length is held until its first body bytes
  (:meth:`Relay.opening`), and a stream — whose headers llama-server sends when a slot takes the request,
  before its prefill, and the front door sends on at once — is continued by the next server's stream
  (:class:`~llama_guard.front.relay.Unanswered`). A failure under a server that had failed it before is
  answered 502 — 422 when the request was in flight at two crashes (an SSE error event with that code
  for a stream whose headers went out): requests in flight at a crash are suspects, sent alone
  (:mod:`llama_guard.front.crashes`, its lane), and one in flight at two crashes is refused for
  ``[front].crash_refuse_s``, its retries included.
- Once the answer has begun (its first event reached the client) it is not sent again as it was: a stream
  of generated text cut by a server's end is resumed (:class:`~llama_guard.front.relay.Cut`,
  :mod:`llama_guard.front.resume`: the next server continues from the text already sent), any other
  answer is relayed to its cut (:mod:`llama_guard.front.relay`: its cut, its outcomes as policy inputs,
  stalled streams, the bound on a first event).
- Headers and bodies pass through untouched but for the hop-by-hop headers
  (:mod:`llama_guard.front.headers`). Nothing here logs a header or a body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import hdrs, web
from yarl import URL

from llama_guard.core.client import UPSTREAM_KEEPALIVE_S
from llama_guard.core.suspects import Fingerprint
from llama_guard.front.admission import Admission, FailReason, Gate, Refused
from llama_guard.front.body import HeldBody
from llama_guard.front.crashes import CrashSuspects
from llama_guard.front.endpoints import Work, path_of, replayable, work_of
from llama_guard.front.headers import REQUEST_DROP, end_to_end, origin_form
from llama_guard.front.metrics import FrontMetrics
from llama_guard.front.relay import Cut, Relay, Unanswered
from llama_guard.front.resume import API_OF, Api, Transcript, continuation
from llama_guard.model.inputs import Input

CONNECT_TIMEOUT_S = 5.0
RETRY_PAUSE_S = (0.05, 0.1, 0.2, 0.4, 0.5)  # between tries while the policy still says ready


def _keep() -> None:
    """A generation's body is kept past its answer's first event: a cut stream's resume needs it."""


def _not_replayed(method: str, target: str, pid: int) -> str:
    return (f"llama-server (pid {pid}) failed before answering {method} {path_of(target)}; it is not sent again: "
            "only GET/HEAD and inference requests (completions, chat, embeddings, tokenize, ...) are replayed, "
            "a request that may change the server's state (slots, LoRA adapters, props) or an unknown one is not")


class Forwarder:
    """Sends requests to llama-server at ``base_url`` and relays the answers to the clients.

    ``post``: queues a policy input; ``clock``: monotonic seconds; ``hold_timeout_s`` and ``max_held``
    (``limits``), ``[front].crash_refuse_s`` (``refuse_s``) and ``[front].first_event_timeout_s``
    (``first_event_s``) are read when used (they are reloadable); ``announce(fingerprint, crash pids,
    refused for s)``: a request is refused from now on (:attr:`suspects`); ``chat_prefill()``: whether
    llama-server continues a trailing assistant message (:func:`~llama_guard.vocab.server_flags.chat_prefill`).
    :attr:`relay` copies the answers."""

    def __init__(self, base_url: str, admission: Admission, metrics: FrontMetrics, *,
                 post: Callable[[Input], None], clock: Callable[[], float],
                 limits: Callable[[], tuple[float, int]], refuse_s: Callable[[], float],
                 announce: Callable[[Fingerprint, tuple[int, ...], float], None],
                 first_event_s: Callable[[], float] = lambda: 0.0,
                 chat_prefill: Callable[[], bool] = lambda: True) -> None:
        self.base_url = base_url
        self.admission = admission
        self.metrics = metrics
        self._clock = clock
        self._limits = limits
        self.suspects = CrashSuspects(metrics, clock=clock, refuse_s=refuse_s, announce=announce)
        self.relay = Relay(metrics, self.suspects, post=post, clock=clock, first_event_s=first_event_s)
        self._chat_prefill = chat_prefill
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
        The body is released once the answer has begun (it is no longer needed for a replay) — but a
        generation's, which a cut stream's resume needs, only when the answer ends. Raises
        :class:`Refused` when the front door must answer itself — but for a stream whose headers went
        out already, the refusal ends that stream as an SSE error event instead."""
        assert self._session is not None
        hold_timeout_s, max_held = self._limits()
        arrived = since = self._clock()
        target = origin_form(request) or "/"
        url = URL(self.base_url + target, encoded=True)
        headers = end_to_end(request.headers, REQUEST_DROP)
        fp = Fingerprint.of(request.method, target, body.data, body_sha256=body.sha256)
        work = work_of(request.method, target)
        api = API_OF.get(path_of(target)) if work is Work.GENERATION else None
        transcript = Transcript(api) if api is not None else None
        data = body.data
        failed_at: list[int] = []  # the servers that failed it before its answer began, or cut its stream
        replays_counted = 0
        in_lane = False
        tries = 0
        held = False
        begun: web.StreamResponse | None = None  # the client's stream, its headers sent (Unanswered, Cut)

        async def unanswered(pid: int) -> None:
            """Sent to server ``pid``, and nothing of the body came back: replay it, or raise Refused."""
            nonlocal since
            self.suspects.failed_under(fp, pid)
            if not replayable(request.method, target):
                raise Refused(FailReason.NOT_REPLAYABLE, _not_replayed(request.method, target, pid))
            if pid in failed_at:  # this server failed it before: it is not sent to it a third time
                await self.suspects.judged(pid)
                self.suspects.check(fp)  # 422 when both ends were crashes
                raise Refused(FailReason.UPSTREAM_FAILED)
            failed_at.append(pid)
            since = self._clock()  # held again, for as long as a new arrival

        try:
            while True:
                self.suspects.check(fp)
                if self.admission.gate is not Gate.OPEN and not held:
                    held = True
                    self.metrics.held.inc()
                pid, held_s = await self.admission.admit(seq, arrived=arrived, since=since, hold_s=hold_timeout_s,
                                                         max_held=max_held, replay=bool(failed_at))
                if held_s > 0:
                    self.metrics.held_seconds.observe(held_s)
                if self.suspects.check(fp) and not in_lane:
                    in_lane = await self._enter_lane(since, hold_timeout_s)
                    continue  # the server may have changed while it waited in the lane
                if in_lane:
                    self.suspects.sent_alone(fp, pid)
                self._enter()
                if len(failed_at) > replays_counted:  # counted when it goes, not when it was decided
                    replays_counted = len(failed_at)
                    self.metrics.replayed.inc()
                try:
                    upstream = await self._session.request(request.method, url, headers=headers, data=data,
                                                           allow_redirects=False, compress=None)
                    opening = await self.relay.opening(upstream, pid)
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):  # not sent: no server there
                    pass
                except asyncio.CancelledError:  # the client left; llama-server may still be working on it
                    self.suspects.failed_under(fp, pid)
                    raise
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):  # sent, nothing came back
                    await unanswered(pid)
                else:
                    try:
                        return await self.relay.relay(request, upstream, opening, pid, work, fp, held=held,
                                                      begun=begun, transcript=transcript,
                                                      on_begin=body.release if transcript is None else _keep)
                    except Unanswered as cut:  # a stream's headers went out, then its server failed
                        begun = cut.out
                        await unanswered(pid)
                    except Cut as cut:  # a stream of generated text began, then its server failed
                        begun = cut.out
                        assert api is not None and transcript is not None
                        data = self._resumed(api, body.data, transcript, pid, failed_at)
                        failed_at.append(pid)
                        since = self._clock()
                finally:
                    self._leave()
                deadline = self.admission.deadline(since, hold_timeout_s)
                if deadline is not None and self._clock() >= deadline:
                    raise self.admission.refusal(FailReason.HOLD_TIMEOUT)
                await asyncio.sleep(RETRY_PAUSE_S[min(tries, len(RETRY_PAUSE_S) - 1)])
                tries += 1
        except Refused as refused:
            if begun is None:
                raise
            return await self.relay.end_stream(begun, refused.reason, refused.message, refused.status)
        finally:
            if in_lane:
                self.suspects.lane.release()

    def _resumed(self, api: Api, body: bytes, transcript: Transcript, pid: int, failed_at: list[int]) -> bytes:
        """The body that continues a stream server ``pid`` cut (:func:`continuation`); raises
        :class:`Refused` (STREAM_CUT, naming why) when it cannot be continued exactly, or when ``pid``
        had failed this request before."""
        cut = f"llama-server (pid {pid}) failed while this response was streaming; the response is incomplete"
        if pid in failed_at:
            raise Refused(FailReason.STREAM_CUT, f"{cut}: this server had failed it before")
        resumed = continuation(api, body, transcript, chat_prefill=self._chat_prefill())
        if isinstance(resumed, str):
            raise Refused(FailReason.STREAM_CUT, f"{cut}, and cannot be resumed: {resumed}")
        transcript.resumed()
        self.metrics.resumed.inc()
        return resumed

    async def _enter_lane(self, since: float, hold_s: float) -> bool:
        """Wait for the suspects' lane (one suspect at a time), at most until the hold deadline
        (:meth:`Admission.deadline`; while a drain holds deadlines off, ``hold_s`` from now)."""
        deadline = self.admission.deadline(since, hold_s)
        wait_s = hold_s if deadline is None else max(0.0, deadline - self._clock())
        try:
            await asyncio.wait_for(self.suspects.lane.acquire(), wait_s)
        except asyncio.TimeoutError:
            raise self.admission.refusal(FailReason.HOLD_TIMEOUT) from None
        return True

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
