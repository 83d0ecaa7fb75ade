"""Requests in flight at llama-server crashes: suspects, replayed one at a time, refused after two.

A request that kills llama-server (a grammar, a JSON schema, a template or an image the build cannot
handle) would kill the next server too if it were replayed, and again when the client retries it. The
rule, pure (no I/O, no clock reads; times are monotonic seconds given by the caller):

- A request is known by its :class:`Fingerprint`: method, target (path and query) and the SHA-256 of its
  body — a client's retry of the same request has the same one.
- A request whose connection to server ``pid`` failed before the answer began (or while it was being
  relayed) was *in flight* at that server's end (:func:`in_flight`). How the server ended is learnt
  from the policy (:func:`ended`); only an ending a request can cause counts as a crash
  (:func:`is_crash`): the server exited on its own (a signal other than SIGKILL, an exit status), an
  out-of-memory or fatal GPU error, a hang. A SIGKILL from outside, a planned restart, a GPU reset or a
  stop do not count: the requests in flight there are innocent and replayed as before.
- :func:`admit` answers, for each request before it is sent: ``SERVE`` (as any request; also while the
  end it was in flight at is not judged yet — it cannot reach a next server before that end is judged,
  since the next server is started after it), ``SERIAL`` (a suspect: in flight at one crash — it goes to
  the next server alone, one suspect at a time, so that a second crash names the culprit while other
  traffic flows normally), or ``REFUSE`` (in flight at two crashes: refused until ``refused_until``,
  ``refuse_s`` after the second).
- A suspect that got an answer is cleared (:func:`answered`). Marks expire ``refuse_s`` after they were
  made (a refused one at ``refused_until``), and at most :data:`MAX_MARKS` are kept (the oldest go first),
  so the book is bounded whatever the traffic.
"""

from __future__ import annotations

import enum
import hashlib
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from llama_guard.core.types import RestartCause

MAX_MARKS = 4096  # fingerprints remembered at once
MAX_ENDINGS = 64  # server ends remembered (pid → crash or not)
#: Restart causes a request can bring about (with :func:`is_crash`'s exception for SIGKILL).
REQUEST_CAUSES = frozenset({RestartCause.CRASH, RestartCause.OOM, RestartCause.CUDA_ERROR, RestartCause.HANG})


@dataclass(frozen=True)
class Fingerprint:
    """A request as its retries repeat it: ``method``, ``target`` (origin form: path and query) and the
    hex SHA-256 of its body."""

    method: str
    target: str
    body_sha256: str

    @classmethod
    def of(cls, method: str, target: str, body: bytes) -> Fingerprint:
        return cls(method, target, hashlib.sha256(body).hexdigest())


class Admit(enum.Enum):
    """How a request may be sent now."""

    SERVE = "serve"    # as any request
    SERIAL = "serial"  # a suspect: alone, one suspect at a time
    REFUSE = "refuse"  # in flight at two crashes: refused until its mark's refused_until


@dataclass(frozen=True)
class Mark:
    """One fingerprint's record: the servers (pids) whose end it was in flight at, since when
    (monotonic s), and, once in flight at two crashes, until when it is refused."""

    pids: frozenset[int]
    since: float
    refused_until: float | None = None


@dataclass(frozen=True)
class Book:
    """The marks and the server ends judged so far (``endings``: pid → whether it was a crash)."""

    marks: Mapping[Fingerprint, Mark] = field(default_factory=lambda: MappingProxyType({}))
    endings: Mapping[int, bool] = field(default_factory=lambda: MappingProxyType({}))

    def crashes(self, fp: Fingerprint) -> tuple[int, ...]:
        """The pids of the crashes ``fp`` was in flight at, in pid order."""
        mark = self.marks.get(fp)
        return tuple(sorted(p for p in mark.pids if self.endings.get(p))) if mark else ()


def is_crash(cause: RestartCause, exit_signal: int | None) -> bool:
    """Whether a server's end, as the policy recorded it (``State.failure.cause``, ``State.exit_signal``), is
    one a request can cause. A SIGKILL the server did not get from us for a hang comes from outside
    (an operator, the kernel's OOM killer acting for the whole host)."""
    if cause is RestartCause.CRASH and exit_signal == signal.SIGKILL:
        return False
    return cause in REQUEST_CAUSES


def admit(book: Book, fp: Fingerprint, now: float) -> tuple[Admit, float | None]:
    """How ``fp`` may be sent at ``now``, and (REFUSE) until when it is refused."""
    mark = book.marks.get(fp)
    if mark is None:
        return Admit.SERVE, None
    if mark.refused_until is not None:
        return (Admit.REFUSE, mark.refused_until) if now < mark.refused_until else (Admit.SERVE, None)
    if any(book.endings.get(p) for p in mark.pids):
        return Admit.SERIAL, None
    return Admit.SERVE, None  # the ends it was in flight at are not judged yet, or were no crash


def in_flight(book: Book, fp: Fingerprint, pid: int, now: float, refuse_s: float) -> tuple[Book, bool]:
    """``fp`` was in flight when server ``pid`` failed under it: the book after it, and whether ``fp``
    is refused from now on (``pid``'s end was already judged a crash, and so was an earlier one: then
    it is refused until ``now + refuse_s``)."""
    marks = _live(book.marks, now, refuse_s)
    mark = marks.get(fp)
    pids = (mark.pids if mark else frozenset()) | {pid}
    new = Mark(pids, mark.since if mark else now, mark.refused_until if mark else None)
    refused = new.refused_until is None and sum(1 for p in pids if book.endings.get(p)) >= 2
    marks[fp] = replace(new, refused_until=now + refuse_s) if refused else new
    if len(marks) > MAX_MARKS:
        for old in sorted(marks, key=lambda f: marks[f].since)[:len(marks) - MAX_MARKS]:
            del marks[old]
    return replace(book, marks=MappingProxyType(marks)), refused


def ended(book: Book, pid: int, crash: bool, now: float, refuse_s: float) -> tuple[Book, list[Fingerprint]]:
    """Server ``pid`` ended, a crash or not: the book after it, and the fingerprints refused from now
    on (in flight at this crash and an earlier one)."""
    if pid in book.endings:
        return book, []
    endings = {**book.endings, pid: crash}
    if len(endings) > MAX_ENDINGS:
        endings.pop(next(iter(endings)))
    book = replace(book, endings=MappingProxyType(endings))
    marks = _live(book.marks, now, refuse_s)
    refused = []
    for fp, mark in list(marks.items()):
        if pid not in mark.pids:
            continue
        if mark.refused_until is None and crash and len(book.crashes(fp)) >= 2:
            marks[fp] = replace(mark, refused_until=now + refuse_s)
            refused.append(fp)
        elif not any(endings.get(p, True) for p in mark.pids):
            del marks[fp]  # every server it was in flight at ended without a crash: innocent
    return replace(book, marks=MappingProxyType(marks)), refused


def answered(book: Book, fp: Fingerprint) -> Book:
    """A request ``fp`` got an answer from a server: it is no suspect (a refused mark stays)."""
    mark = book.marks.get(fp)
    if mark is None or mark.refused_until is not None:
        return book
    return replace(book, marks=MappingProxyType({f: m for f, m in book.marks.items() if f != fp}))


def _live(marks: Mapping[Fingerprint, Mark], now: float, refuse_s: float) -> dict[Fingerprint, Mark]:
    """``marks`` without the expired ones (a copy)."""
    return {fp: m for fp, m in marks.items()
            if (now < m.refused_until if m.refused_until is not None else now - m.since < refuse_s)}
