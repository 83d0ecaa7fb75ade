"""Holding requests while llama-server is not ready: the gate, the bounded queue, arrival order.

The gate is read from the policy's state only (:func:`gate_of`): OPEN while the phase is READY,
CLOSED once a verdict ends the daemon (EXITED, or a stop that ends in an exit), HOLD otherwise —
starting, restarting after a crash, in backoff, draining for a planned restart, during a GPU reset,
waiting for VRAM. The front door never probes the server itself.

A request that finds the gate at HOLD waits in :class:`Admission` (at most ``max_held`` at once, each
at most until its deadline); when the gate opens the waiters are released in arrival order (their
sequence number, so a request sent once more after a failure goes before later arrivals); when it
closes they are refused at once. Each not-ready stretch is summed up in an :class:`Episode`.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from llama_guard.core.types import AfterStop, Phase, State


class Gate(enum.Enum):
    """Whether requests may go to llama-server now."""

    OPEN = "open"      # the server is ready: forward
    HOLD = "hold"      # not ready yet: hold
    CLOSED = "closed"  # the daemon is ending: refuse at once


class FailReason(enum.Enum):
    """Why the front door answered a request itself with an error (the ``reason`` label)."""

    HOLD_TIMEOUT = "hold_timeout"        # held past [front].hold_timeout_s
    QUEUE_FULL = "queue_full"            # more than [front].max_held held at once
    BUFFER_FULL = "buffer_full"          # request bodies in memory would pass [front].max_buffered_bytes
    DAEMON_EXITING = "daemon_exiting"    # a verdict ends the daemon (exit 78/75, a stop)
    UPSTREAM_FAILED = "upstream_failed"  # no byte came back, also from the replay
    STREAM_CUT = "stream_cut"            # a response that had begun was cut by a server failure
    NOT_REPLAYABLE = "not_replayable"    # the server failed before answering; not safe to send again
    CRASHED_TWICE = "crashed_twice"      # in flight at two llama-server crashes: refused for a while


class Refused(Exception):
    """A request the front door answers itself (503 with ``Retry-After``, 502, 422); ``detail``: the
    message for this request, when the reason's own one is not enough."""

    def __init__(self, reason: FailReason, detail: str = "") -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.detail = detail


def gate_of(state: State) -> Gate:
    """The gate for the policy's ``state``."""
    if state.phase is Phase.EXITED or (state.phase is Phase.STOPPING and state.after_stop is AfterStop.EXIT):
        return Gate.CLOSED
    if state.phase is Phase.READY and state.pid is not None:
        return Gate.OPEN
    return Gate.HOLD


@dataclass
class Episode:
    """One stretch of not-ready time: the phases seen, requests held, and how they ended."""

    phases: list[str] = field(default_factory=list)
    held: int = 0
    forwarded: int = 0
    replayed: int = 0
    failed: int = 0
    longest_s: float = 0.0

    def fields(self) -> dict[str, object]:
        """The ``front_held`` event's fields."""
        return {"phase": ", ".join(self.phases), "held": self.held, "forwarded": self.forwarded,
                "replayed": self.replayed, "failed": self.failed, "longest_s": round(self.longest_s, 3)}


class Admission:
    """The gate and the held requests. ``clock``: monotonic seconds (the daemon's clock);
    ``on_episode``: called with each finished :class:`Episode` that held a request."""

    def __init__(self, clock: Callable[[], float], on_episode: Callable[[Episode], None]) -> None:
        self._clock = clock
        self._on_episode = on_episode
        self.gate = Gate.HOLD
        self.pid: int | None = None
        self._waiters: dict[int, tuple[asyncio.Future[int], float]] = {}  # seq -> (future, held since)
        self.episode = Episode()

    @property
    def waiting(self) -> int:
        """Requests held now."""
        return len(self._waiters)

    def update(self, state: State) -> None:
        """Follow the policy's ``state``: release the held requests in arrival order when the gate
        opens, refuse them when it closes."""
        gate = gate_of(state)
        if gate is Gate.HOLD and state.phase.value not in self.episode.phases[-1:]:
            self.episode.phases.append(state.phase.value)
        self._switch(gate, state.pid if gate is Gate.OPEN else None)

    def close(self) -> None:
        """The daemon shuts down: refuse every held request now, and every later one."""
        self._switch(Gate.CLOSED, None)

    def _switch(self, gate: Gate, pid: int | None) -> None:
        self.pid = pid
        if gate is self.gate:
            return
        self.gate = gate
        if gate is Gate.HOLD:
            return
        now = self._clock()
        for seq in sorted(self._waiters):
            fut, since = self._waiters.pop(seq)
            if fut.done():
                continue
            self.episode.longest_s = max(self.episode.longest_s, now - since)
            if pid is not None:
                fut.set_result(pid)
                self.episode.forwarded += 1
            else:
                fut.set_exception(Refused(FailReason.DAEMON_EXITING))
                self.episode.failed += 1
        if self.episode.held:
            self._on_episode(self.episode)
        self.episode = Episode()

    async def admit(self, seq: int, deadline: float, max_held: int) -> tuple[int, float]:
        """Wait until the server is ready; returns its pid and the seconds this request was held.

        ``seq`` orders the held requests (lower first); ``deadline`` (monotonic) bounds the wait.
        Raises :class:`Refused`: HOLD_TIMEOUT past ``deadline``, QUEUE_FULL with ``max_held``
        already held, DAEMON_EXITING when the gate is or becomes CLOSED.
        """
        if self.gate is Gate.OPEN and self.pid is not None:
            return self.pid, 0.0
        if self.gate is Gate.CLOSED:
            raise Refused(FailReason.DAEMON_EXITING)
        if len(self._waiters) >= max_held:
            self.episode.failed += 1
            raise Refused(FailReason.QUEUE_FULL)
        start = self._clock()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters[seq] = (fut, start)
        self.episode.held += 1
        try:
            pid = await asyncio.wait_for(fut, max(0.0, deadline - start))
        except asyncio.TimeoutError:
            self.episode.failed += 1
            self.episode.longest_s = max(self.episode.longest_s, self._clock() - start)
            raise Refused(FailReason.HOLD_TIMEOUT) from None
        finally:
            self._waiters.pop(seq, None)
        return pid, self._clock() - start
