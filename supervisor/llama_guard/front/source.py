"""The front door as a watcher of the daemon (:class:`~llama_guard.model.watcher.Watcher`) and its
front door port (:class:`~llama_guard.core.ports.FrontPort`).

A drain waits on its exact count of requests in flight (:meth:`FrontSource.wait_requests_done`).
It learns readiness from the policy's state only — from the record of every step of the loop
(``on_transition``: the state after it), never from probing the server itself nor by polling; it
reports request outcomes as typed inputs (RequestCompleted, UpstreamError, StreamStalled) through
``ctx.post``, and
announces a request refused after two crashes (``front_request_refused``).
Off (a no-op source) when ``[front].listen`` is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from llama_guard.config import Config
from llama_guard.config.argv import user_endpoints
from llama_guard.config.listen import listen_text
from llama_guard.core.listen_wait import bind_waiting
from llama_guard.core.offload import Lane, LaneKind
from llama_guard.core.suspects import Fingerprint
from llama_guard.front import activation
from llama_guard.front.admission import Admission, Episode, Gate, gate_of
from llama_guard.front.crashes import wall_time
from llama_guard.front.endpoints import path_of
from llama_guard.front.metrics import FrontMetrics
from llama_guard.model.inputs import CrashesCharged, StreamStalled
from llama_guard.model.transition import Transition
from llama_guard.model.types import State
from llama_guard.model.watcher import Context, Watcher
from llama_guard.vocab.server_flags import chat_prefill

if TYPE_CHECKING:  # aiohttp (~0.2 s of imports) only when the front door is on: see start()
    from llama_guard.front.app import FrontApp
    from llama_guard.front.forward import Forwarder

CHECK_S = 1.0  # how often stalled streams are looked for
CLOSE_TIMEOUT_S = 5.0  # at shutdown: how long open connections may take to finish


class FrontSource(Watcher):
    """Serves ``[front].listen`` — each of its addresses on the socket systemd passed for it (``passed``:
    :func:`activation.take`), if any, else on one it binds; its metrics go into ``registry`` (the
    exporter's, when there is one)."""

    name = "front"

    def __init__(self, registry: CollectorRegistry | None = None,
                 passed: list[tuple[str, socket.socket]] | None = None) -> None:
        self._registry = registry
        self._passed = list(passed or [])
        self.admission: Admission | None = None
        self.forwarder: Forwarder | None = None
        self.app: FrontApp | None = None
        self.listening: tuple[str, int] | None = None  # the first bound address (its port is every address's)
        self.addresses: list[tuple[str, int]] = []  # every bound address
        self.activated = False  # it serves a socket systemd passed (shared with the service manager)
        self._proc = Lane(LaneKind.PROC)  # who holds the port, while it waits for it
        self._state: State | None = None  # the policy's state: at start, then as each record of the loop leaves it

    async def start(self, ctx: Context) -> str | None:
        front = ctx.config.front
        addresses = front.addresses
        activated = activation.front_socket(self._passed, front.listen, addresses)
        if isinstance(activated, str):
            return activated
        if not addresses:
            return None
        from llama_guard.front.app import FrontApp
        from llama_guard.front.forward import Forwarder

        self._state = state = ctx.initial  # before the loop's first step; then on_transition
        admission = Admission(ctx.clock, lambda episode: self._episode(ctx, episode))
        admission.update(state)
        metrics = FrontMetrics(self._registry, waiting=lambda: admission.waiting,
                               in_flight=lambda: forwarder.in_flight, connections=lambda: app.connections)
        forwarder = Forwarder(ctx.config.server.base_url, admission, metrics, post=ctx.post, clock=ctx.clock,
                              limits=lambda: (ctx.config.front.hold_timeout_s, ctx.config.front.max_held),
                              refuse_s=lambda: ctx.config.front.crash_refuse_s,
                              announce=lambda fp, pids, refuse_s: self._crash_refused(ctx, fp, pids, refuse_s),
                              first_event_s=lambda: ctx.config.front.first_event_timeout_s,
                              chat_prefill=lambda: chat_prefill(ctx.config.server.extra_args, ctx.config.server.env))
        forwarder.suspects.observe(state)
        app = FrontApp(forwarder, metrics, get_config=lambda: ctx.config.front, last_state=self._policy,
                       get_endpoints=lambda: user_endpoints(ctx.config.server), clock=ctx.clock)
        await forwarder.open()
        bound: list[tuple[str, int]] = []
        try:
            for address in addresses:  # the socket systemd passed serves its own address; the others are bound
                served = activated is not None and activation.serves(activated, address)
                one = await (app.listen(*address, sock=activated) if served else self._listen(ctx, app, address))
                if isinstance(one, str):
                    await app.close(CLOSE_TIMEOUT_S)
                    await forwarder.close()
                    return one
                bound.append(one)
        except BaseException:  # a stop while the port is waited for
            await app.close(CLOSE_TIMEOUT_S)
            await forwarder.close()
            raise
        self.listening, self.addresses, self.activated = bound[0], bound, activated is not None
        self.admission, self.forwarder, self.app = admission, forwarder, app
        ctx.emit("front_listening", listen=listen_text(bound), upstream=ctx.config.server.base_url,
                 max_connections=app.max_connections, activated=activated is not None)
        return None

    async def _listen(self, ctx: Context, app: FrontApp, address: tuple[str, int]) -> tuple[str, int] | str:
        """Bind the front door's ``address``: the bound address, or why it cannot be bound; a port another
        process holds is waited for (``front_port_taken``: :func:`~llama_guard.core.listen_wait.bind_waiting`)."""
        return await bind_waiting(ctx, self._proc, lambda: app.listen(*address), setting="[front].listen",
                                  value=ctx.config.front.listen, address=address, taken="front_port_taken")

    async def run(self, ctx: Context) -> None:
        if self.forwarder is None or self.admission is None:
            return
        while True:
            await asyncio.sleep(CHECK_S)
            stall_s = ctx.config.front.stall_timeout_s
            if stall_s <= 0:
                continue
            for pid, waited in self.forwarder.relay.stalled(ctx.clock(), stall_s):
                if pid == self._policy().pid:
                    ctx.post(StreamStalled(pid, waited))

    def _policy(self) -> State:
        """The policy's state as the loop's last record left it (set at start)."""
        assert self._state is not None
        return self._state

    def on_transition(self, ctx: Context, step: Transition) -> None:
        self._state = step.after
        if self.forwarder is not None:
            self.forwarder.suspects.observe(step.after)  # before the gate opens to the next server
        if self.admission is not None:
            self.admission.update(step.after)
        if self.app is not None and self.activated and gate_of(step.after) is Gate.CLOSED:
            # The daemon ends: the next one (systemd restarts it, or the socket starts it) takes the new
            # connections from the kernel's queue, instead of this one answering them 503 while it drains.
            self.app.stop_accepting()

    def on_reload(self, ctx: Context, old: Config, new: Config) -> None:
        if self.forwarder is not None:
            self.forwarder.base_url = new.server.base_url  # a new [server].port restarts the server too

    async def before_drained_stop(self, ctx: Context, pid: int) -> None:
        """Close the upstream pool's idle connections to the drained server, just before its SIGTERM:
        llama-server's graceful exit waits for idle keep-alive connections."""
        if self.forwarder is not None:
            await self.forwarder.drop_idle()

    async def wait_requests_done(self) -> bool:
        if self.forwarder is None:
            return False
        await self.forwarder.wait_idle()  # the gate holds new requests while the server drains
        return True

    def _crash_refused(self, ctx: Context, fp: Fingerprint, pids: tuple[int, ...], refuse_s: float) -> None:
        ctx.emit("front_request_refused", method=fp.method, path=path_of(fp.target), body_sha256=fp.body_sha256,
                 server_pids=list(pids), refuse_s=round(refuse_s), until=wall_time(refuse_s))
        ctx.post(CrashesCharged(pids))  # the request's crashes, not the build's

    def _episode(self, ctx: Context, episode: Episode) -> None:
        ctx.emit("front_held", **episode.fields())

    def snapshot(self) -> dict[str, Any] | None:
        if self.listening is None or self.admission is None or self.forwarder is None or self.app is None:
            return None
        return {"listen": listen_text(self.addresses), "waiting": self.admission.waiting,
                "in_flight": self.forwarder.in_flight, "connections": self.app.connections}

    async def close(self) -> None:
        if self.admission is not None:
            self.admission.close()
        if self.app is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.app.close(CLOSE_TIMEOUT_S), CLOSE_TIMEOUT_S + 1.0)
        if self.forwarder is not None:
            await self.forwarder.close()
