"""Requests in flight at llama-server crashes: suspects, replayed one at a time, refused once one
alone is found at a second crash.

A request that kills llama-server (a grammar, a JSON schema, a template or an image the build cannot
handle) would kill the next server too if it were replayed, and again when the client retries it. The
rule, pure (no I/O, no clock reads; times are monotonic seconds given by the caller):

- A request is known by its :class:`Fingerprint`: method, route and the SHA-256 of the canonical form
  of its body (:mod:`llama_guard.core.canonical`) — a client's retry has the same one, and so has a
  variant that changes nothing the server computes (another seed, other whitespace, another client
  id, ``stream`` flipped, the keys in another order, an alias of the route). A body over
  :data:`CANONICAL_MAX_BYTES` is known by its bytes (its parse would hold the event loop).
- A request whose connection to server ``pid`` failed before the answer began (or while it was being
  relayed) was *in flight* at that server's end (:func:`in_flight`). How the server ended is learnt
  from the policy (:func:`ended`); only an ending a request can cause counts as a crash
  (:func:`is_crash`): the server exited on its own (a signal other than SIGKILL, an exit status), an
  out-of-memory or fatal GPU error. A hang does not count (a server that stops making progress says
  nothing of the requests it was serving; the hang judges the server), nor does a SIGKILL from
  outside, a planned restart, a GPU reset or a stop: the requests in flight there are innocent and
  replayed as before.
- :func:`admit` answers, for each request before it is sent: ``SERVE`` (as any request; also while the
  end it was in flight at is not judged yet — it cannot reach a next server before that end is judged,
  since the next server is started after it), ``SERIAL`` (a suspect: in flight at a crash — it goes to
  the next server through the suspects' lane, one suspect at a time, while other traffic flows
  normally), or ``REFUSE`` (charged: refused until ``refused_until``).
- A request is *charged* with the crashes it was in flight at only when it was the one suspect sent to
  a server and not answered (:func:`sent_alone`, :func:`answered`) and that server crashed under it,
  after an earlier crash it was in flight at too: that is the one case where the request alone can be
  shown to end the server. Being in flight at two crashes among other requests charges nobody. Once
  charged, it is refused for ``refuse_s``, and every other request is cleared of the crashes charged to
  it (an innocent that was in flight at them is no suspect any more).
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

from llama_guard.core.canonical import canonical_body, route
from llama_guard.model.types import RestartCause

MAX_MARKS = 4096  # fingerprints remembered at once
MAX_ENDINGS = 64  # server ends remembered (pid → crash or not), and servers' lone suspects
CANONICAL_MAX_BYTES = 256 * 1024  # bodies up to this size are fingerprinted by their canonical form
#: Restart causes a request can bring about (with :func:`is_crash`'s exception for SIGKILL).
REQUEST_CAUSES = frozenset({RestartCause.CRASH, RestartCause.OOM, RestartCause.CUDA_ERROR})


@dataclass(frozen=True)
class Fingerprint:
    """A request as its retries and variants repeat it: ``method``, ``target`` (its route,
    :func:`~llama_guard.core.canonical.route`) and the hex SHA-256 of its body's canonical form
    (:func:`~llama_guard.core.canonical.canonical_body`)."""

    method: str
    target: str
    body_sha256: str

    @classmethod
    def of(cls, method: str, target: str, body: bytes, *, body_sha256: str | None = None) -> Fingerprint:
        """The fingerprint of a request (``target``: origin form; ``body``: its bytes as received). A
        body over :data:`CANONICAL_MAX_BYTES` is known by its bytes: ``body_sha256`` (their hex SHA-256,
        hashed as they arrived) when given, else hashed here. The canonical form costs a JSON parse:
        at most a few ms on the event loop, whatever the body."""
        if len(body) > CANONICAL_MAX_BYTES:
            digest = body_sha256 or hashlib.sha256(body).hexdigest()
        else:
            digest = hashlib.sha256(canonical_body(body)).hexdigest()
        return cls(method, route(method, target), digest)


class Admit(enum.Enum):
    """How a request may be sent now."""

    SERVE = "serve"    # as any request
    SERIAL = "serial"  # a suspect: alone, one suspect at a time
    REFUSE = "refuse"  # charged with crashes: refused until its mark's refused_until


@dataclass(frozen=True)
class Mark:
    """One fingerprint's record: the servers (pids) whose end it was in flight at, since when
    (monotonic s), and, once charged, until when it is refused."""

    pids: frozenset[int]
    since: float
    refused_until: float | None = None


@dataclass(frozen=True)
class Book:
    """The marks, the server ends judged so far (``endings``: pid → whether it was a crash) and the
    suspects each server was sent through the lane (``alone``: pid → fingerprints)."""

    marks: Mapping[Fingerprint, Mark] = field(default_factory=lambda: MappingProxyType({}))
    endings: Mapping[int, bool] = field(default_factory=lambda: MappingProxyType({}))
    alone: Mapping[int, frozenset[Fingerprint]] = field(default_factory=lambda: MappingProxyType({}))

    def crashes(self, fp: Fingerprint) -> tuple[int, ...]:
        """The pids of the crashes ``fp`` was in flight at, in pid order."""
        mark = self.marks.get(fp)
        return tuple(sorted(p for p in mark.pids if self.endings.get(p))) if mark else ()


def is_crash(cause: RestartCause, exit_signal: int | None) -> bool:
    """Whether a server's end, as the policy recorded it (``State.failure.cause``, ``State.exit_signal``), is
    one a request can cause. A SIGKILL the server did not get from us for a hang comes from outside
    (an operator, the kernel's OOM killer acting for the whole host); a hang is the server's."""
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


def sent_alone(book: Book, fp: Fingerprint, pid: int) -> Book:
    """Suspect ``fp`` is being sent to server ``pid`` through the suspects' lane: the book after it."""
    alone = {**book.alone, pid: book.alone.get(pid, frozenset()) | {fp}}
    if len(alone) > MAX_ENDINGS:
        alone.pop(next(iter(alone)))
    return replace(book, alone=MappingProxyType(alone))


def in_flight(book: Book, fp: Fingerprint, pid: int, now: float, refuse_s: float) -> tuple[Book, bool]:
    """``fp`` was in flight when server ``pid`` failed under it: the book after it, and whether ``fp``
    is charged from now on (``pid``'s end was already judged a crash that ``fp`` alone was sent to, and
    ``fp`` was in flight at an earlier crash: then it is refused until ``now + refuse_s``)."""
    marks = _live(book.marks, now, refuse_s)
    mark = marks.get(fp)
    pids = (mark.pids if mark else frozenset()) | {pid}
    marks[fp] = Mark(pids, mark.since if mark else now, mark.refused_until if mark else None)
    if len(marks) > MAX_MARKS:
        for old in sorted(marks, key=lambda f: marks[f].since)[:len(marks) - MAX_MARKS]:
            del marks[old]
    book = replace(book, marks=MappingProxyType(marks))
    charged = _charge(book, fp, pid, now + refuse_s)
    return (charged, True) if charged is not None else (book, False)


def ended(book: Book, pid: int, crash: bool, now: float, refuse_s: float) -> tuple[Book, list[Fingerprint]]:
    """Server ``pid`` ended, a crash or not: the book after it, and the fingerprints charged from now
    on (the one suspect sent alone to this crash, in flight at it and at an earlier one)."""
    if pid in book.endings:
        return book, []
    endings = {**book.endings, pid: crash}
    if len(endings) > MAX_ENDINGS:
        endings.pop(next(iter(endings)))
    marks = _live(book.marks, now, refuse_s)
    for fp, mark in list(marks.items()):
        if pid in mark.pids and not any(endings.get(p, True) for p in mark.pids):
            del marks[fp]  # every server it was in flight at ended without a crash: innocent
    book = replace(book, endings=MappingProxyType(endings), marks=MappingProxyType(marks))
    for fp in book.alone.get(pid, frozenset()):
        charged = _charge(book, fp, pid, now + refuse_s)
        if charged is not None:
            return charged, [fp]
    return book, []


def answered(book: Book, fp: Fingerprint) -> Book:
    """A request ``fp`` got an answer from a server: it is no suspect (a refused mark stays), and no
    longer one of the suspects a server was sent (a crash after it is not its doing)."""
    if any(fp in fps for fps in book.alone.values()):
        book = replace(book, alone=MappingProxyType({pid: fps - {fp} for pid, fps in book.alone.items()}))
    mark = book.marks.get(fp)
    if mark is None or mark.refused_until is not None:
        return book
    return replace(book, marks=MappingProxyType({f: m for f, m in book.marks.items() if f != fp}))


def _charge(book: Book, fp: Fingerprint, pid: int, until: float) -> Book | None:
    """The book with ``fp`` charged (refused until ``until``), its crashes cleared from every other
    request's mark — or None when the crash of ``pid`` does not charge ``fp``: ``pid`` did not crash,
    ``fp`` was not the one suspect sent alone to it, ``fp`` was not in flight at it (not yet known),
    it was in flight at no earlier crash, or it is charged already."""
    mark = book.marks.get(fp)
    if (mark is None or mark.refused_until is not None or not book.endings.get(pid)
            or book.alone.get(pid) != frozenset({fp}) or pid not in mark.pids or len(book.crashes(fp)) < 2):
        return None
    explained = frozenset(book.crashes(fp))
    marks = {fp: replace(mark, refused_until=until)}
    for other, m in book.marks.items():
        if other == fp or m.refused_until is not None:
            marks.setdefault(other, m)
        elif m.pids - explained:
            marks[other] = replace(m, pids=m.pids - explained)
    return replace(book, marks=MappingProxyType(marks))


def _live(marks: Mapping[Fingerprint, Mark], now: float, refuse_s: float) -> dict[Fingerprint, Mark]:
    """``marks`` without the expired ones (a copy)."""
    return {fp: m for fp, m in marks.items()
            if (now < m.refused_until if m.refused_until is not None else now - m.since < refuse_s)}
