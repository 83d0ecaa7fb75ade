"""Holding requests while llama-server is not ready: the gate, the bounded queue, arrival order.

The gate is read from the policy's state only (:func:`gate_of`): OPEN while the phase is READY (unless
a run of 5xx answers is being confirmed: :attr:`~llama_guard.model.types.State.confirming`),
CLOSED once a verdict ends the daemon (EXITED, or a stop, a drain or a GPU reset that ends in an
exit: held and new requests get their 503 at once), HOLD otherwise —
starting, restarting after a crash, in backoff, draining for a planned restart, during a GPU reset,
waiting for VRAM, while the GPU is lent to ``llama-guard tune`` (a hold that times out then is answered
503 with ``Retry-After`` the window's time left). The front door never probes the server itself.

A request that finds the gate at HOLD waits in :class:`Admission` (at most ``max_held`` at once, each
at most until its deadline); when the gate opens the waiters are released in arrival order (their
sequence number, so a request sent once more after a failure goes before later arrivals); when it
closes they are refused at once. Each not-ready stretch is summed up in an :class:`Episode`, in
which every held request has exactly one :class:`Outcome`.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from llama_guard.model.types import AfterStop, State
from llama_guard.vocab.phases import Phase


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
    FIRST_EVENT_TIMEOUT = "first_event_timeout"  # taken by a slot, no first event within [front].first_event_timeout_s


_STATUS = {FailReason.UPSTREAM_FAILED: 502, FailReason.NOT_REPLAYABLE: 502, FailReason.CRASHED_TWICE: 422,
           FailReason.STREAM_CUT: 502, FailReason.FIRST_EVENT_TIMEOUT: 504}
_MESSAGE = {
    FailReason.HOLD_TIMEOUT: "llama-server did not become ready within [front].hold_timeout_s",
    FailReason.QUEUE_FULL: "too many requests are waiting for llama-server ([front].max_held)",
    FailReason.BUFFER_FULL: "too many request bytes are waiting for llama-server ([front].max_buffered_bytes)",
    FailReason.DAEMON_EXITING: "llama-guard is stopping llama-server",
    FailReason.UPSTREAM_FAILED: "llama-server failed this request twice before answering it",
    FailReason.NOT_REPLAYABLE: "llama-server failed before answering this request, which is not sent again",
    FailReason.CRASHED_TWICE: "this request was in flight at two llama-server crashes and is refused for now",
    FailReason.STREAM_CUT: "llama-server failed while this response was streaming",
    FailReason.FIRST_EVENT_TIMEOUT: ("llama-server took this request (its answer's headers came) and sent no byte of "
                                     "its answer within [front].first_event_timeout_s"),
}


class Refused(Exception):
    """A request the front door answers itself (503 with ``Retry-After``, 502, 504, 422); ``detail``: the
    message for this request, when the reason's own one is not enough; ``retry_after_s``: the
    ``Retry-After`` of this 503 in seconds, when the front door knows better than its default (the
    time left of a window lent to ``llama-guard tune``)."""

    def __init__(self, reason: FailReason, detail: str = "", retry_after_s: int | None = None) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.detail = detail
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        """The HTTP status the client gets: 502, 504, 422, else 503 (with ``Retry-After``)."""
        return _STATUS.get(self.reason, 503)

    @property
    def message(self) -> str:
        return self.detail or _MESSAGE[self.reason]


#: How an episode names the hold of a ready server whose run of 5xx answers is being confirmed.
CONFIRMING = "confirming its 5xx answers"

#: The phases in which a pending exit (``after_stop`` EXIT) closes the gate: a stop, a drain before
#: one, a stop that waits for a GPU reset command.
ENDING = frozenset({Phase.STOPPING, Phase.DRAINING, Phase.RESETTING})


def gate_of(state: State) -> Gate:
    """The gate for the policy's ``state``."""
    if state.phase is Phase.EXITED or (state.phase in ENDING and state.after_stop is AfterStop.EXIT):
        return Gate.CLOSED
    if state.phase is Phase.READY and state.pid is not None and not state.confirming:
        return Gate.OPEN
    return Gate.HOLD


class Outcome(enum.Enum):
    """How a held request's hold ended (each ends in exactly one)."""

    FORWARDED = "forwarded"  # released to the ready server
    REPLAYED = "replayed"    # released to the ready server, sent again (a server failed it before its answer began)
    FAILED = "failed"        # answered 503 by the front door (held past its deadline, or the daemon is ending)
    GONE = "gone"            # the client left while it was held


@dataclass
class Episode:
    """One stretch of not-ready time: the phases seen, requests held, and how each hold ended
    (``held`` = ``forwarded + replayed + failed + gone``; ``refused``: turned away, never held, because
    ``max_held`` requests were held). ``longest_s``: the longest hold, from the request's arrival
    (a replayed request's first arrival) to its outcome, seconds."""

    phases: list[str] = field(default_factory=list)
    held: int = 0
    forwarded: int = 0
    replayed: int = 0
    failed: int = 0
    gone: int = 0
    refused: int = 0
    longest_s: float = 0.0

    def count(self, outcome: Outcome, held_s: float) -> None:
        """One held request ended with ``outcome`` after ``held_s`` seconds since its arrival."""
        if outcome is Outcome.FORWARDED:
            self.forwarded += 1
        elif outcome is Outcome.REPLAYED:
            self.replayed += 1
        elif outcome is Outcome.FAILED:
            self.failed += 1
        else:
            self.gone += 1
        self.longest_s = max(self.longest_s, held_s)

    def fields(self) -> dict[str, object]:
        """The ``front_held`` event's fields."""
        return {"phase": ", ".join(self.phases), "held": self.held, "forwarded": self.forwarded,
                "replayed": self.replayed, "failed": self.failed, "gone": self.gone, "refused": self.refused,
                "longest_s": round(self.longest_s, 3)}


@dataclass(eq=False)
class _Waiter:
    """A held request: its arrival number, its future (the pid it may go to), when it arrived, when
    its hold timeout began counting (``since``), the timeout (``hold_s``), whether it is a replay,
    its expiry timer."""

    seq: int
    fut: asyncio.Future[int]
    arrived: float
    since: float
    hold_s: float
    replay: bool
    timer: asyncio.TimerHandle | None = None


class Admission:
    """The gate and the held requests. ``clock``: monotonic seconds (the daemon's clock);
    ``on_episode``: called with each finished :class:`Episode` that held or refused a request.

    A held request's deadline is ``hold_s`` after its ``since`` — or after the end of a drain for a
    planned restart, when it waited through one: the drain (bounded by ``[schedule].drain_timeout_s``)
    waits for requests in flight, never for the server, so a request held across it is given its whole
    ``hold_s`` for the restart that follows. While the drain lasts, no held request times out."""

    def __init__(self, clock: Callable[[], float], on_episode: Callable[[Episode], None]) -> None:
        self._clock = clock
        self._on_episode = on_episode
        self.gate = Gate.HOLD
        self.pid: int | None = None
        self._waiters: dict[int, _Waiter] = {}  # by arrival sequence number
        self.episode = Episode()
        self.draining = False  # a drain for a planned restart is under way
        self.lent_until: float | None = None  # while the GPU is lent to tune: when its window ends at the latest
        self._drain_ended = -math.inf  # when the last such drain ended (monotonic s)

    @property
    def waiting(self) -> int:
        """Requests held now."""
        return len(self._waiters)

    def update(self, state: State) -> None:
        """Follow the policy's ``state``: release the held requests in arrival order when the gate
        opens, refuse them when it closes; hold their deadlines while a planned drain lasts."""
        gate = gate_of(state)
        phase = CONFIRMING if state.confirming else state.phase.value
        if gate is Gate.HOLD and phase not in self.episode.phases[-1:]:
            self.episode.phases.append(phase)
        draining = gate is Gate.HOLD and state.phase is Phase.DRAINING
        if draining is not self.draining:
            self.draining = draining
            if not draining:
                self._drain_ended = self._clock()
            for waiter in self._waiters.values():
                self._arm(waiter)
        lend = state.lend
        self.lent_until = lend.until if state.phase is Phase.LENT and lend is not None else None
        self._switch(gate, state.pid if gate is Gate.OPEN else None)

    def close(self) -> None:
        """The daemon shuts down: refuse every held request now, and every later one."""
        self._switch(Gate.CLOSED, None)

    def deadline(self, since: float, hold_s: float) -> float | None:
        """When a request held from ``since`` for up to ``hold_s`` seconds times out (monotonic s);
        None while a planned drain lasts."""
        return None if self.draining else max(since, self._drain_ended) + hold_s

    def _arm(self, waiter: _Waiter) -> None:
        """(Re)schedule ``waiter``'s timeout at its :meth:`deadline`."""
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        deadline = self.deadline(waiter.since, waiter.hold_s)
        if deadline is not None:
            waiter.timer = waiter.fut.get_loop().call_later(max(0.0, deadline - self._clock()), self._expire, waiter)

    def _expire(self, waiter: _Waiter) -> None:
        self._resolve(waiter, None, FailReason.HOLD_TIMEOUT)

    def refusal(self, reason: FailReason) -> Refused:
        """The answer for a request refused with ``reason`` now: a hold that times out while the GPU is
        lent to ``llama-guard tune`` says so, with ``Retry-After`` the window's time left (seconds, at
        least 1): the hold cannot outlast a window longer than ``[front].hold_timeout_s``."""
        if reason is FailReason.HOLD_TIMEOUT and self.lent_until is not None:
            left = max(1, math.ceil(self.lent_until - self._clock()))
            return Refused(reason, f"the GPU is lent to llama-guard tune for at most {left} s more, longer than "
                                   "this request may be held ([front].hold_timeout_s)", retry_after_s=left)
        return Refused(reason)

    def _resolve(self, waiter: _Waiter, pid: int | None, reason: FailReason) -> None:
        """End ``waiter``'s hold: released to ``pid``, else refused with ``reason``; counted once."""
        if self._waiters.get(waiter.seq) is not waiter:
            return  # already ended
        del self._waiters[waiter.seq]
        if waiter.timer is not None:
            waiter.timer.cancel()
        if waiter.fut.done():
            return
        held_s = self._clock() - waiter.arrived
        if pid is not None:
            waiter.fut.set_result(pid)
            self.episode.count(Outcome.REPLAYED if waiter.replay else Outcome.FORWARDED, held_s)
        else:
            waiter.fut.set_exception(self.refusal(reason))
            self.episode.count(Outcome.FAILED, held_s)

    def _switch(self, gate: Gate, pid: int | None) -> None:
        self.pid = pid
        if gate is self.gate:
            return
        self.gate = gate
        if gate is Gate.HOLD:
            return
        for seq in sorted(self._waiters):
            self._resolve(self._waiters[seq], pid, FailReason.DAEMON_EXITING)
        if self.episode.held or self.episode.refused:
            self._on_episode(self.episode)
        self.episode = Episode()

    async def admit(self, seq: int, *, arrived: float, since: float, hold_s: float, max_held: int,
                    replay: bool = False) -> tuple[int, float]:
        """Wait until the server is ready; returns its pid and the seconds since ``arrived`` when the
        request was held (0.0 when it was not).

        ``seq`` orders the held requests (lower first); ``arrived`` (monotonic) is when the request
        came (its first arrival, for a replay); the hold times out ``hold_s`` seconds after ``since``
        (see :meth:`deadline`); ``replay``: it is being sent once more. Raises :class:`Refused`:
        HOLD_TIMEOUT past the deadline, QUEUE_FULL with ``max_held`` already held, DAEMON_EXITING
        when the gate is or becomes CLOSED. A cancelled wait (the client left) counts as GONE.
        """
        if self.gate is Gate.OPEN and self.pid is not None:
            return self.pid, 0.0
        if self.gate is Gate.CLOSED:
            raise Refused(FailReason.DAEMON_EXITING)
        if len(self._waiters) >= max_held:
            self.episode.refused += 1
            raise Refused(FailReason.QUEUE_FULL)
        waiter = _Waiter(seq, asyncio.get_running_loop().create_future(), arrived, since, hold_s, replay)
        self._waiters[seq] = waiter
        self.episode.held += 1
        self._arm(waiter)
        try:
            pid = await waiter.fut
        except asyncio.CancelledError:
            if self._waiters.get(seq) is waiter:  # still held: the client left
                del self._waiters[seq]
                if waiter.timer is not None:
                    waiter.timer.cancel()
                self.episode.count(Outcome.GONE, self._clock() - arrived)
            raise
        return pid, self._clock() - arrived
