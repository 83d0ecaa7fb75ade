"""The front door's side of the crash-suspect rule (:mod:`llama_guard.core.suspects`: the rule
itself, pure): which requests were in flight at each server's end, the lane suspects go through
one at a time (and which suspect each server was sent alone), and the refusal of one charged with
crashes (sent alone to a server that crashed under it, after an earlier crash).

A request is known by its :class:`~llama_guard.core.suspects.Fingerprint` (method, route, sha256 of
its body's canonical form). Times are monotonic seconds from ``clock``; a refusal raises
:class:`~llama_guard.front.admission.Refused` (``CRASHED_TWICE``), naming until when (UTC).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Callable

from llama_guard.core.suspects import (
    Admit,
    Book,
    Fingerprint,
    admit,
    answered,
    ended,
    in_flight,
    is_crash,
    sent_alone,
)
from llama_guard.front.admission import FailReason, Refused
from llama_guard.front.endpoints import path_of
from llama_guard.front.metrics import FrontMetrics
from llama_guard.model.types import State

JUDGE_WAIT_S = 5.0  # after a replay failed: how long to wait for the policy to judge that server's end


def wall_time(after_s: float) -> str:
    """The UTC wall-clock time ``after_s`` seconds from now, ISO 8601 to the second."""
    when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=after_s)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


class CrashSuspects:
    """The book of requests in flight at server ends (:attr:`book`) and the suspects' :attr:`lane`.

    ``[front].crash_refuse_s`` (``refuse_s``) is read when used (reloadable); ``announce(fingerprint,
    crash pids, refused for s)``: a request is refused from now on."""

    def __init__(self, metrics: FrontMetrics, *, clock: Callable[[], float], refuse_s: Callable[[], float],
                 announce: Callable[[Fingerprint, tuple[int, ...], float], None]) -> None:
        self._metrics = metrics
        self._clock = clock
        self._refuse_s = refuse_s
        self._announce = announce
        self.book = Book()
        self.lane = asyncio.Lock()  # suspects go to the server one at a time (FIFO)
        self._serving: int | None = None  # the server pid the policy's state names
        self._judgement = asyncio.Event()  # set when a server's end is judged

    def check(self, fp: Fingerprint) -> bool:
        """Whether ``fp`` is a suspect (it goes alone, through :attr:`lane`). Raises :class:`Refused`
        (CRASHED_TWICE, naming until when) for a request charged with crashes."""
        verdict, until = admit(self.book, fp, self._clock())
        if verdict is Admit.REFUSE:
            assert until is not None
            crashes = ", ".join(str(p) for p in self.book.crashes(fp))
            raise Refused(FailReason.CRASHED_TWICE, (
                f"this request ({fp.method} {path_of(fp.target)}, body sha256 {fp.body_sha256[:16]}) was in flight "
                f"at two llama-server crashes (pids {crashes}), the last one as the only suspect sent to that "
                f"server, and is refused until "
                f"{wall_time(until - self._clock())} ([front].crash_refuse_s)"))
        return verdict is Admit.SERIAL

    async def judged(self, pid: int) -> None:
        """Wait until the end of server ``pid`` is judged (the policy's state no longer names it), at
        most :data:`JUDGE_WAIT_S`."""
        until = self._clock() + JUDGE_WAIT_S
        while pid not in self.book.endings and self._clock() < until:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._judgement.wait(), until - self._clock())

    def sent_alone(self, fp: Fingerprint, pid: int) -> None:
        """Suspect ``fp`` goes to server ``pid`` through :attr:`lane` (it holds the lane)."""
        self.book = sent_alone(self.book, fp, pid)

    def failed_under(self, fp: Fingerprint, pid: int) -> None:
        """``fp`` was in flight at server ``pid`` when its connection failed — or when its client left
        before the answer began (the server may go on with its prefill): if ``pid`` ends by a crash, it
        counts."""
        self.book, refused = in_flight(self.book, fp, pid, self._clock(), self._refuse_s())
        if refused:
            self._refused(fp)

    def answered(self, fp: Fingerprint) -> None:
        """``fp`` was answered in full: no suspect."""
        self.book = answered(self.book, fp)

    def _refused(self, fp: Fingerprint) -> None:
        mark = self.book.marks[fp]
        assert mark.refused_until is not None
        self._metrics.crash_refusals.inc()
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
