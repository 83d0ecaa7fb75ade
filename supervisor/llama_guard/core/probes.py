"""HTTP probes of llama-server: readiness (/health), liveness (canary, /slots, /metrics).

Every request has a timeout; no probe raises on a network error, it reports a failure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import httpx

from llama_guard.core.prometheus import MetricsError, parse_metrics

# Prometheus counters of llama-server (--metrics) that move while it decodes.
PROGRESS_COUNTERS = ("llamacpp:n_decode_total", "llamacpp:tokens_predicted_total",
                     "llamacpp:prompt_tokens_total")


class BearerKey(httpx.Auth):
    """Sends ``Authorization: Bearer <key>`` with the key current at each request (``get_key()``;
    "" sends nothing), so that a reloaded ``[server].api_key_file`` applies to open clients."""

    def __init__(self, get_key: Callable[[], str]) -> None:
        self._get_key = get_key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        key = self._get_key()
        if key:
            request.headers["Authorization"] = f"Bearer {key}"
        yield request


def make_client(get_key: Callable[[], str] = lambda: "", base_url: str = "") -> httpx.AsyncClient:
    """The one way llama-guard builds an HTTP client for its llama-server: no proxy from the
    environment, and the API key (``get_key``) on every request."""
    return httpx.AsyncClient(base_url=base_url, trust_env=False, auth=BearerKey(get_key))


@dataclass(frozen=True)
class SlotsView:
    """What ``GET /slots`` said: whether a slot is processing, and a progress figure of the busy
    slots (their ``n_decoded`` plus ``n_prompt_tokens_processed``, which moves during prefill)."""

    busy: bool
    decoded: int


@dataclass(frozen=True)
class LivenessRound:
    """One liveness round; ``canary_ok`` is None when the canary was not sent."""

    health_ok: bool
    canary_ok: bool | None
    busy: bool
    progressed: bool
    detail: str
    elapsed_s: float


def parse_counters(text: str, names: tuple[str, ...] = PROGRESS_COUNTERS) -> dict[str, float]:
    """The values of ``names`` in Prometheus text exposition ``text`` (absent names left out;
    malformed text gives none)."""
    try:
        values = parse_metrics(text)
    except MetricsError:
        return {}
    return {name: values[name] for name in names if name in values}


class ServerProbe:
    """Probes one llama-server at ``base_url`` (``http://host:port``)."""

    def __init__(self, base_url: str, *, timeout_s: float, canary_timeout_s: float,
                 canary: bool = True, client: httpx.AsyncClient | None = None,
                 get_key: Callable[[], str] = lambda: "") -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.canary_timeout_s = canary_timeout_s
        self.canary = canary
        self._client = client or make_client(get_key, base_url)
        self._last_progress: tuple[float, ...] | None = None

    async def aclose(self) -> None:
        await self._client.aclose()

    async def health_status(self) -> int | None:
        """The HTTP status of ``GET /health`` (200 ready, 503 loading …), or None when nothing
        answered within ``timeout_s``. Any answer shows the server's HTTP loop is alive."""
        try:
            resp = await self._client.get("/health", timeout=self.timeout_s)
        except httpx.HTTPError:
            return None
        return resp.status_code

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 within ``timeout_s``."""
        return await self.health_status() == 200

    async def slots(self) -> SlotsView | None:
        """``GET /slots`` summarised, or None when unavailable."""
        try:
            resp = await self._client.get("/slots", timeout=self.timeout_s)
            data: Any = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
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
        return SlotsView(busy=busy, decoded=decoded)

    async def progress(self) -> tuple[float, ...] | None:
        """The decode counters from ``/metrics`` plus the busy slots' ``n_decoded``; None if unreadable."""
        values: list[float] = []
        try:
            resp = await self._client.get("/metrics", timeout=self.timeout_s)
            if resp.status_code == 200:
                counters = parse_counters(resp.text)
                values += [counters.get(name, 0.0) for name in PROGRESS_COUNTERS]
        except httpx.HTTPError:
            pass
        view = await self.slots()
        if view is not None:
            values.append(float(view.decoded))
        return tuple(values) if values else None

    async def canary_completion(self) -> tuple[bool, str]:
        """A 1-token completion (``POST /completion``) within ``canary_timeout_s``."""
        body = {"prompt": "ping", "n_predict": 1, "cache_prompt": True}
        try:
            resp = await self._client.post("/completion", json=body, timeout=self.canary_timeout_s)
        except httpx.TimeoutException:
            return False, f"canary completion timed out after {self.canary_timeout_s:.1f} s"
        except httpx.HTTPError as exc:
            return False, f"canary completion failed: {exc.__class__.__name__}"
        if resp.status_code != 200:
            return False, f"canary completion answered HTTP {resp.status_code}"
        return True, ""

    async def liveness(self, *, canary: bool = True) -> LivenessRound:
        """One round: /health; then the canary (unless ``canary`` is False: real traffic completed a
        request since the previous round) while watching /slots and the decode counters."""
        start = time.monotonic()
        if not await self.health():
            self._last_progress = None
            return LivenessRound(False, None, False, False, f"/health failed within {self.timeout_s:.1f} s",
                                 time.monotonic() - start)
        before = self._last_progress if self._last_progress is not None else await self.progress()
        canary_ok: bool | None = None
        detail = ""
        if self.canary and canary:
            canary_ok, detail = await self.canary_completion()
        view = await self.slots()
        after = await self.progress()
        self._last_progress = after
        progressed = before is not None and after is not None and after != before
        busy = view.busy if view is not None else False
        if canary_ok is False and busy:
            detail += "; a slot is busy and " + ("advancing" if progressed else "not advancing")
        return LivenessRound(True, canary_ok, busy, progressed, detail, time.monotonic() - start)

    async def wait_idle(self, poll_s: float = 0.5) -> None:
        """Return once no slot is processing (callers bound it with a deadline)."""
        while True:
            view = await self.slots()
            if view is not None and not view.busy:
                return
            await asyncio.sleep(poll_s)
