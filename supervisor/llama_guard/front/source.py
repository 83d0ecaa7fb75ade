"""The front door as a watcher of the daemon (:class:`~llama_guard.core.watcher.Source`).

It learns readiness from the policy's state only — after every action of the policy (``on_action``:
the state has changed) and once a second — never from probing the server itself; it reports request
outcomes as typed inputs (RequestCompleted, UpstreamError, StreamStalled) through ``ctx.post``.
Off (a no-op source) when ``[front].listen`` is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from llama_guard.config import Config, host_port
from llama_guard.core.actions import Action
from llama_guard.core.inputs import StreamStalled
from llama_guard.core.watcher import Context, Source
from llama_guard.front.admission import Admission, Episode
from llama_guard.front.metrics import FrontMetrics

if TYPE_CHECKING:  # aiohttp (~0.2 s of imports) only when the front door is on: see start()
    from llama_guard.front.app import FrontApp
    from llama_guard.front.forward import Forwarder

CHECK_S = 1.0  # how often stalled streams are looked for (and the gate re-read from the state)
CLOSE_TIMEOUT_S = 5.0  # at shutdown: how long open connections may take to finish


class FrontSource(Source):
    """Serves ``[front].listen``; its metrics go into ``registry`` (the exporter's, when there is one)."""

    name = "front"

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._registry = registry
        self.admission: Admission | None = None
        self.forwarder: Forwarder | None = None
        self.app: FrontApp | None = None
        self.listening: tuple[str, int] | None = None

    async def start(self, ctx: Context) -> str | None:
        front = ctx.config.front
        address = front.address
        if address is None:
            return None
        from llama_guard.front.app import FrontApp
        from llama_guard.front.forward import Forwarder

        admission = Admission(ctx.clock, lambda episode: self._episode(ctx, episode))
        admission.update(ctx.state)
        metrics = FrontMetrics(self._registry, waiting=lambda: admission.waiting,
                               in_flight=lambda: forwarder.in_flight, connections=lambda: app.connections)
        forwarder = Forwarder(ctx.config.server.base_url, admission, metrics, post=ctx.post, clock=ctx.clock,
                              limits=lambda: (ctx.config.front.hold_timeout_s, ctx.config.front.max_held))
        app = FrontApp(forwarder, metrics, get_config=lambda: ctx.config.front, get_state=ctx.get_state)
        await forwarder.open()
        try:
            self.listening = await app.listen(*address)
        except OSError as exc:
            await forwarder.close()
            return f"[front].listen = {front.listen!r}: cannot listen: {exc.strerror or exc}"
        self.admission, self.forwarder, self.app = admission, forwarder, app
        ctx.emit("front_listening", listen=host_port(*self.listening),
                 upstream=ctx.config.server.base_url, max_connections=app.max_connections)
        return None

    async def run(self, ctx: Context) -> None:
        if self.forwarder is None or self.admission is None:
            return
        while True:
            await asyncio.sleep(CHECK_S)
            self.admission.update(ctx.state)
            stall_s = ctx.config.front.stall_timeout_s
            if stall_s <= 0:
                continue
            for pid, waited in self.forwarder.stalled(ctx.clock(), stall_s):
                if pid == ctx.state.pid:
                    ctx.post(StreamStalled(pid, waited))

    def on_action(self, ctx: Context, action: Action) -> None:
        if self.admission is not None:
            self.admission.update(ctx.state)

    def on_reload(self, ctx: Context, old: Config, new: Config) -> None:
        if self.forwarder is not None:
            self.forwarder.base_url = new.server.base_url  # a new [server].port restarts the server too

    def _episode(self, ctx: Context, episode: Episode) -> None:
        ctx.emit("front_held", **episode.fields())

    def snapshot(self) -> dict[str, Any] | None:
        if self.listening is None or self.admission is None or self.forwarder is None or self.app is None:
            return None
        return {"listen": host_port(*self.listening), "waiting": self.admission.waiting,
                "in_flight": self.forwarder.in_flight, "connections": self.app.connections}

    async def close(self) -> None:
        if self.admission is not None:
            self.admission.close()
        if self.app is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.app.close(CLOSE_TIMEOUT_S), CLOSE_TIMEOUT_S + 1.0)
        if self.forwarder is not None:
            await self.forwarder.close()
