"""Forwarding one client request to llama-server: the holds, the tries and the replay rule.

The rules (ours; the HTTP work is aiohttp's):

- A request goes upstream only through :meth:`Admission.admit` (the policy says the server is ready).
- A connection llama-server refused or did not accept (it died, or is not listening yet) was never
  sent: the request waits again (held, bounded by ``hold_timeout_s``) and is tried again.
- A request that was sent and got no byte of its answer's body back before the connection failed (the
  server died under it) is sent once more, to the next ready server, if that is safe (a GET/HEAD or
  an inference POST: :mod:`llama_guard.front.endpoints`; else 502 naming why). The status line and
  headers alone do not count: an answer of known length is held until its first body bytes
  (:meth:`Relay.opening`), and a stream — whose headers llama-server sends when it takes the request,
  before its prefill, and the front door sends on at once — is continued by the next server's stream
  (:class:`~llama_guard.front.relay.Unanswered`). A second such failure is answered 502 — 422 when
  the request was in flight at both as crashes (an SSE error event with that code for a stream whose
  headers went out): requests in flight at a crash are suspects, sent alone
  (:mod:`llama_guard.front.crashes`, its lane), and one in flight at two crashes is refused for
  ``[front].crash_refuse_s``, its retries included.
- Once the answer has begun (its first body byte reached the client) nothing is replayed: the answer
  is relayed (:mod:`llama_guard.front.relay`: its cut, its outcomes as policy inputs, stalled streams).
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
from llama_guard.core.inputs import Input
from llama_guard.core.suspects import Fingerprint
from llama_guard.front.admission import Admission, FailReason, Gate, Refused
from llama_guard.front.body import HeldBody
from llama_guard.front.crashes import CrashSuspects
from llama_guard.front.endpoints import path_of, replayable, work_of
from llama_guard.front.headers import REQUEST_DROP, end_to_end, origin_form
from llama_guard.front.metrics import FrontMetrics
from llama_guard.front.relay import Relay, Unanswered

CONNECT_TIMEOUT_S = 5.0
RETRY_PAUSE_S = (0.05, 0.1, 0.2, 0.4, 0.5)  # between tries while the policy still says ready


def _not_replayed(method: str, target: str, pid: int) -> str:
    return (f"llama-server (pid {pid}) failed before answering {method} {path_of(target)}; it is not sent again: "
            "only GET/HEAD and inference requests (completions, chat, embeddings, tokenize, ...) are replayed, "
            "a request that may change the server's state (slots, LoRA adapters, props) or an unknown one is not")


class Forwarder:
    """Sends requests to llama-server at ``base_url`` and relays the answers to the clients.

    ``post``: queues a policy input; ``clock``: monotonic seconds; ``hold_timeout_s`` and ``max_held``
    (``limits``) and ``[front].crash_refuse_s`` (``refuse_s``) are read when used (they are
    reloadable); ``announce(fingerprint, crash pids, refused for s)``: a request is refused from now on
    (:attr:`suspects`). :attr:`relay` copies the answers."""

    def __init__(self, base_url: str, admission: Admission, metrics: FrontMetrics, *,
                 post: Callable[[Input], None], clock: Callable[[], float],
                 limits: Callable[[], tuple[float, int]], refuse_s: Callable[[], float],
                 announce: Callable[[Fingerprint, tuple[int, ...], float], None]) -> None:
        self.base_url = base_url
        self.admission = admission
        self.metrics = metrics
        self._clock = clock
        self._limits = limits
        self.suspects = CrashSuspects(metrics, clock=clock, refuse_s=refuse_s, announce=announce)
        self.relay = Relay(metrics, self.suspects, post=post, clock=clock)
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
        :class:`Refused` when the front door must answer itself — but for a stream whose headers went
        out already (its server failed before the first event), the refusal ends that stream as an
        SSE error event instead."""
        assert self._session is not None
        hold_timeout_s, max_held = self._limits()
        arrived = since = self._clock()
        target = origin_form(request) or "/"
        url = URL(self.base_url + target, encoded=True)
        headers = end_to_end(request.headers, REQUEST_DROP)
        fp = Fingerprint.of(request.method, target, body.data, body_sha256=body.sha256)
        replayed = replay_counted = False
        in_lane = False
        tries = 0
        held = False
        begun: web.StreamResponse | None = None  # a stream whose headers went out, no event yet (Unanswered)

        async def unanswered(pid: int) -> None:
            """Sent to server ``pid``, and nothing of the body came back: replay it, or raise Refused."""
            nonlocal replayed, since
            self.suspects.failed_under(fp, pid)
            if not replayable(request.method, target):
                raise Refused(FailReason.NOT_REPLAYABLE, _not_replayed(request.method, target, pid))
            if replayed:  # sent once more already: no third time
                await self.suspects.judged(pid)
                self.suspects.check(fp)  # 422 when both ends were crashes
                raise Refused(FailReason.UPSTREAM_FAILED)
            replayed = True
            since = self._clock()  # held again, for as long as a new arrival

        try:
            while True:
                self.suspects.check(fp)
                if self.admission.gate is not Gate.OPEN and not held:
                    held = True
                    self.metrics.held.inc()
                pid, held_s = await self.admission.admit(seq, arrived=arrived, since=since, hold_s=hold_timeout_s,
                                                         max_held=max_held, replay=replayed)
                if held_s > 0:
                    self.metrics.held_seconds.observe(held_s)
                if self.suspects.check(fp) and not in_lane:
                    in_lane = await self._enter_lane(since, hold_timeout_s)
                    continue  # the server may have changed while it waited in the lane
                if in_lane:
                    self.suspects.sent_alone(fp, pid)
                self._enter()
                if replayed and not replay_counted:  # counted when it goes, not when it was decided
                    replay_counted = True
                    self.metrics.replayed.inc()
                try:
                    upstream = await self._session.request(request.method, url, headers=headers, data=body.data,
                                                           allow_redirects=False, compress=None)
                    opening = await self.relay.opening(upstream)
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):  # not sent: no server there
                    pass
                except asyncio.CancelledError:  # the client left; llama-server may still be working on it
                    self.suspects.failed_under(fp, pid)
                    raise
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):  # sent, nothing came back
                    await unanswered(pid)
                else:
                    work = work_of(request.method, target)
                    try:
                        return await self.relay.relay(request, upstream, opening, pid, work, fp, held=held,
                                                      begun=begun, on_begin=body.release)
                    except Unanswered as cut:  # a stream's headers went out, then its server failed
                        begun = cut.out
                        await unanswered(pid)
                finally:
                    self._leave()
                deadline = self.admission.deadline(since, hold_timeout_s)
                if deadline is not None and self._clock() >= deadline:
                    raise Refused(FailReason.HOLD_TIMEOUT)
                await asyncio.sleep(RETRY_PAUSE_S[min(tries, len(RETRY_PAUSE_S) - 1)])
                tries += 1
        except Refused as refused:
            if begun is None:
                raise
            return await self.relay.end_stream(begun, refused.reason, refused.message, refused.status)
        finally:
            if in_lane:
                self.suspects.lane.release()

    async def _enter_lane(self, since: float, hold_s: float) -> bool:
        """Wait for the suspects' lane (one suspect at a time), at most until the hold deadline
        (:meth:`Admission.deadline`; while a drain holds deadlines off, ``hold_s`` from now)."""
        deadline = self.admission.deadline(since, hold_s)
        wait_s = hold_s if deadline is None else max(0.0, deadline - self._clock())
        try:
            await asyncio.wait_for(self.suspects.lane.acquire(), wait_s)
        except asyncio.TimeoutError:
            raise Refused(FailReason.HOLD_TIMEOUT) from None
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
