"""HTTP probes of llama-server: readiness (/health) and liveness rounds.

What each request costs the server (llama.cpp ``tools/server/server-context.cpp``, see
docs/liveness.md): ``/health`` is answered by the HTTP thread and never touches the main loop;
``/metrics`` and ``/slots`` are tasks the main loop answers between (or, while yielding, during)
decode steps; a completion takes a slot and writes that slot's KV cache. A round therefore sends
``/health`` and one ``/metrics``; it reads ``/slots`` and sends the 1-token canary only when the
server is idle, nothing completed since the previous round, and a slot exists whose KV cache
holds no conversation (empty, or holding the canary's own prompt): the canary never displaces a
conversation and never shares a decode batch with a generation.

Every request has a timeout; no probe raises on a network error, it reports a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llama_guard.core.client import Answer, RequestFailed, ServerClient
from llama_guard.core.prometheus import MetricsError, parse_metrics

# Prometheus counters of llama-server (--metrics) that move while it decodes.
PROGRESS_COUNTERS = ("llamacpp:n_decode_total", "llamacpp:tokens_predicted_total",
                     "llamacpp:prompt_tokens_total")
PREDICTED = "llamacpp:tokens_predicted_total"
PROCESSING = "llamacpp:requests_processing"
DEFERRED = "llamacpp:requests_deferred"

# The canary: a fixed prompt, one token, and a seed that marks the slot's last task as ours in
# /slots ("params": {"seed": ...}). Sent again to the slot that holds it, the whole prompt is a
# cached prefix: llama-server evaluates at most its last token again.
CANARY_PROMPT = "ping"
CANARY_SEED = 0x6C670001
CANARY_GRACE_S = 1.0  # a completion seen this long after the canary's answer may be the canary's own
ERROR_TEXT_MAX = 300  # characters of the server's error message kept for events


def make_client(get_key: Callable[[], str] = lambda: "", base_url: str = "") -> ServerClient:
    """The one way llama-guard builds an HTTP client for its llama-server (:mod:`llama_guard.core.client`):
    no proxy from the environment, and the API key (``get_key``) on every request."""
    return ServerClient(base_url, get_key)


async def sleep_or_wake(seconds: float, wake: asyncio.Event) -> None:
    """Wait ``seconds``, or less: until ``wake`` is set (then cleared for the next wait)."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), seconds)
    wake.clear()


class CanaryOutcome(enum.Enum):
    """What the canary completion did in a round."""

    NOT_SENT = "not_sent"      # not needed (traffic, busy) or not possible without displacing a conversation
    OK = "ok"                  # HTTP 200 within canary_timeout_s
    TIMED_OUT = "timed_out"    # no answer within canary_timeout_s
    HTTP_ERROR = "http_error"  # the server answered with an error status (``status``, ``error``)
    NO_ANSWER = "no_answer"    # the connection failed (refused, reset)


@dataclass(frozen=True)
class SlotsView:
    """What ``GET /slots`` said: whether a slot is processing, and a progress figure of the busy
    slots (their ``n_decoded`` plus ``n_prompt_tokens_processed``, which moves during prefill);
    ``canary_slot`` the idle slot the canary may use (None: none without a conversation)."""

    busy: bool
    decoded: int
    canary_slot: int | None = None


@dataclass(frozen=True)
class MetricsView:
    """What ``GET /metrics`` said: the :data:`PROGRESS_COUNTERS` (absent ones 0) and the gauges
    ``requests_processing`` and ``requests_deferred`` (0 when absent)."""

    counters: tuple[float, ...]
    predicted: float
    processing: int
    deferred: int


@dataclass(frozen=True)
class LivenessRound:
    """One liveness round. ``answered``: anything answered HTTP (any status of any request).
    ``health_ok``: /health said 200. ``canary``: what the canary did (``status``/``error`` when
    the server answered it with an error). ``busy``: a request is processing or deferred.
    ``progressed``: the decode counters moved since the previous round. ``traffic``: a request
    other than the canary completed or ran since the previous round (counters, or ``completed_at``
    given to :meth:`ServerProbe.liveness`). ``silent_s``: seconds since the server last answered
    any request (0 when this round got an answer). ``loop_ok``: ``/metrics``, a task of the
    server's main loop, answered 200 in time (False when /health failed too)."""

    answered: bool
    health_ok: bool
    canary: CanaryOutcome
    busy: bool
    progressed: bool
    traffic: bool
    detail: str
    elapsed_s: float
    silent_s: float = 0.0
    status: int | None = None
    error: str = ""
    loop_ok: bool = True  # /metrics (a main-loop task) answered 200 in time

    @property
    def canary_ok(self) -> bool | None:
        """True/False when the canary was sent (it succeeded or not), None when it was not."""
        return None if self.canary is CanaryOutcome.NOT_SENT else self.canary is CanaryOutcome.OK


def parse_counters(text: str, names: tuple[str, ...] = PROGRESS_COUNTERS) -> dict[str, float]:
    """The values of ``names`` in Prometheus text exposition ``text`` (absent names left out;
    malformed text gives none)."""
    try:
        values = parse_metrics(text)
    except MetricsError:
        return {}
    return {name: values[name] for name in names if name in values}


def canary_slot(slots: list[Any]) -> int | None:
    """The id of the idle slot the canary may use without displacing a conversation from the KV
    cache, from ``GET /slots``: first a slot whose last task was the canary (``params.seed`` is
    :data:`CANARY_SEED` and ``n_predict`` 1), else the lowest-id slot that caches nothing (no
    ``id_task`` yet, or ``n_prompt_tokens`` 0). None when every idle slot holds someone's prompt or
    the schema is not understood (then no canary is sent)."""
    ours: list[int] = []
    empty: list[int] = []
    for slot in slots:
        if not isinstance(slot, dict) or not isinstance(slot.get("id"), int) or slot.get("is_processing", True):
            continue
        params = slot.get("params")
        if isinstance(params, dict) and params.get("seed") == CANARY_SEED and params.get("n_predict") == 1:
            ours.append(slot["id"])
        elif "id_task" not in slot or slot.get("n_prompt_tokens") == 0:
            empty.append(slot["id"])
    for pool in (ours, empty):
        if pool:
            return min(pool)
    return None


def _error_text(resp: Answer) -> str:
    """llama-server's error message (``{"error": {"message": ...}}``) or the body's start."""
    try:
        data: Any = resp.json()
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        message = err.get("message") if isinstance(err, dict) else None
        if isinstance(message, str):
            return message[:ERROR_TEXT_MAX]
        if isinstance(err, str):
            return err[:ERROR_TEXT_MAX]
    return " ".join(resp.text.split())[:ERROR_TEXT_MAX]


class ServerProbe:
    """Probes one llama-server at ``base_url`` (``http://host:port``). ``clock``: monotonic
    seconds (the silence since the last answer is measured on it)."""

    def __init__(self, base_url: str, *, timeout_s: float, canary_timeout_s: float,
                 canary: bool = True, client: ServerClient | None = None,
                 get_key: Callable[[], str] = lambda: "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.canary_timeout_s = canary_timeout_s
        self.canary = canary
        self._client = client or make_client(get_key, base_url)
        self._clock = clock
        self._last: MetricsView | None = None
        self._canaries = 0  # canaries that reached the server since the last /metrics reading
        self._answered_at = clock()
        self._round_at: float | None = None  # when the previous round began
        self._canary_window = (0.0, -1.0)  # monotonic span of the last canary (its own completion)

    async def aclose(self) -> None:
        await self._client.aclose()

    def silent_s(self) -> float:
        """Seconds since the server last answered any request of this probe."""
        return max(0.0, self._clock() - self._answered_at)

    def _answered(self) -> None:
        self._answered_at = self._clock()

    async def health_status(self) -> int | None:
        """The HTTP status of ``GET /health`` (200 ready, 503 loading …), or None when nothing
        answered within ``timeout_s``. Any answer shows the server's HTTP loop is alive."""
        try:
            resp = await self._client.get("/health", timeout_s=self.timeout_s)
        except RequestFailed:
            return None
        self._answered()
        return resp.status

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 within ``timeout_s``."""
        return await self.health_status() == 200

    async def slots(self) -> SlotsView | None:
        """``GET /slots`` summarised, or None when unavailable."""
        try:
            resp = await self._client.get("/slots", timeout_s=self.timeout_s)
            self._answered()
            data: Any = resp.json() if resp.status == 200 else None
        except (RequestFailed, ValueError):
            return None
        if not isinstance(data, list):
            return None
        busy = False
        decoded = 0
        for slot in data:
            if isinstance(slot, dict) and slot.get("is_processing"):
                busy = True
                # Prefill moves this one (per batch) before any token is generated.
                processed = slot.get("n_prompt_tokens_processed")
                if isinstance(processed, int):
                    decoded += processed
                nxt = slot.get("next_token")
                items = nxt if isinstance(nxt, list) else [nxt]
                for item in items:
                    if isinstance(item, dict) and isinstance(item.get("n_decoded"), int):
                        decoded += item["n_decoded"]
        return SlotsView(busy=busy, decoded=decoded, canary_slot=canary_slot(data))

    async def metrics(self) -> MetricsView | None:
        """``GET /metrics`` (one main-loop task), or None when it did not answer 200 in time."""
        try:
            resp = await self._client.get("/metrics", timeout_s=self.timeout_s)
        except RequestFailed:
            return None
        self._answered()
        if resp.status != 200:
            return None
        values = parse_counters(resp.text, (*PROGRESS_COUNTERS, PROCESSING, DEFERRED))
        return MetricsView(counters=tuple(values.get(name, 0.0) for name in PROGRESS_COUNTERS),
                           predicted=values.get(PREDICTED, 0.0),
                           processing=int(values.get(PROCESSING, 0.0)), deferred=int(values.get(DEFERRED, 0.0)))

    async def canary_completion(self, slot: int | None = None) -> tuple[CanaryOutcome, int | None, str]:
        """A 1-token completion (``POST /completion``, ``cache_prompt``, on ``slot`` when given)
        within ``canary_timeout_s``: the outcome, the HTTP status of an error answer, and a
        message (the server's own error message for an error answer, else what went wrong)."""
        body: dict[str, Any] = {"prompt": CANARY_PROMPT, "n_predict": 1, "cache_prompt": True,
                                "seed": CANARY_SEED, "temperature": 0.0}
        if slot is not None:
            body["id_slot"] = slot
        try:
            resp = await self._client.post("/completion", json=body, timeout_s=self.canary_timeout_s)
        except RequestFailed as exc:
            if exc.timed_out:
                self._canaries += 1  # it may still run and count one token
                return (CanaryOutcome.TIMED_OUT, None,
                        f"canary completion timed out after {self.canary_timeout_s:.1f} s")
            return CanaryOutcome.NO_ANSWER, None, f"canary completion failed: {exc}"
        self._answered()
        if resp.status != 200:
            return CanaryOutcome.HTTP_ERROR, resp.status, _error_text(resp)
        self._canaries += 1
        return CanaryOutcome.OK, None, ""

    async def liveness(self, completed_at: float | None = None, *, confirm: bool = False) -> LivenessRound:
        """One round: /health; if it answered 200, one /metrics; then, only when the server is
        idle and no request completed since the previous round (``completed_at``: monotonic time
        a request other than the canary last completed, from whoever saw it, e.g. a front door),
        the canary on a slot that holds no conversation (read from /slots). ``confirm``: a round
        that confirms a run of 5xx answers while the front door holds new requests: the canary goes
        whatever the traffic, and on whichever idle slot llama-server picks when every idle slot holds
        a conversation (a server whose completions all fail keeps no conversation worth the wait)."""
        start = self._clock()
        previous_round, self._round_at = self._round_at, start
        status = await self.health_status()
        if status != 200:
            self._last = None
            detail = (f"/health answered HTTP {status}" if status is not None
                      else f"/health failed within {self.timeout_s:.1f} s")
            return LivenessRound(status is not None, False, CanaryOutcome.NOT_SENT, False, False, False, detail,
                                 self._clock() - start, silent_s=self.silent_s(), loop_ok=False)
        view = await self.metrics()
        before, canaries = self._last, self._canaries
        self._last, self._canaries = view, 0
        progressed = view is not None and before is not None and view.counters != before.counters
        busy = view is not None and (view.processing > 0 or view.deferred > 0)
        # Completed work that was not ours: more tokens predicted than the canaries could add.
        first, last = self._canary_window
        traffic = (view is not None and before is not None and view.predicted - before.predicted > canaries) or (
            completed_at is not None and previous_round is not None and completed_at >= previous_round
            and not first <= completed_at <= last + CANARY_GRACE_S)
        outcome, code, detail, error = CanaryOutcome.NOT_SENT, None, "", ""
        if view is None:
            detail = f"/metrics gave no answer within {self.timeout_s:.1f} s"
        elif busy:
            detail = "a request is processing" + ("" if progressed else " and the counters did not move")
        elif self.canary and (confirm or not traffic):
            slots = await self.slots()
            if slots is not None and not slots.busy and (slots.canary_slot is not None or confirm):
                sent = self._clock()
                outcome, code, detail = await self.canary_completion(slots.canary_slot)
                self._canary_window = (sent, self._clock())
                if outcome is CanaryOutcome.HTTP_ERROR:
                    error, detail = detail, f"canary completion answered HTTP {code}: {detail}"
            else:
                detail = "no canary: every idle slot holds a conversation" if slots is not None else (
                    "no canary: /slots gave no answer")
        return LivenessRound(True, True, outcome, busy, progressed, traffic, detail, self._clock() - start,
                             silent_s=self.silent_s(), status=code, error=error, loop_ok=view is not None)

    async def wait_idle(self, poll_s: float = 0.5, wake: asyncio.Event | None = None) -> None:
        """Return once no slot is processing (callers bound it with a deadline). ``/slots`` is asked
        every ``poll_s`` seconds, and at once when ``wake`` is set (then cleared): the server said a
        slot finished its request."""
        while True:
            view = await self.slots()
            if view is not None and not view.busy:
                return
            if wake is None:
                await asyncio.sleep(poll_s)
            else:
                await sleep_or_wake(poll_s, wake)
