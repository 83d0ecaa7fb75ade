"""The rule for requests in flight at llama-server crashes (core/suspects.py, pure): suspects go alone,
a request in flight at two crashes is refused for a bounded time, innocents are served."""

from __future__ import annotations

import signal

from llama_guard.core.suspects import (
    MAX_MARKS,
    Admit,
    Book,
    Fingerprint,
    admit,
    answered,
    ended,
    in_flight,
    is_crash,
)
from llama_guard.core.types import RestartCause

POISON = Fingerprint.of("POST", "/completion", b'{"prompt": "boom"}')
INNOCENT = Fingerprint.of("POST", "/completion", b'{"prompt": "hello"}')
REFUSE_S = 600.0


def test_the_fingerprint_is_method_target_and_body() -> None:
    assert Fingerprint.of("POST", "/completion", b'{"prompt": "boom"}') == POISON  # a retry is the same request
    assert Fingerprint.of("POST", "/completion?x=1", b'{"prompt": "boom"}') != POISON
    assert Fingerprint.of("PUT", "/completion", b'{"prompt": "boom"}') != POISON
    assert POISON != INNOCENT and len(POISON.body_sha256) == 64


def test_which_server_ends_a_request_can_cause() -> None:
    assert is_crash(RestartCause.CRASH, signal.SIGABRT) and is_crash(RestartCause.CRASH, signal.SIGSEGV)
    assert is_crash(RestartCause.CRASH, None)  # an exit status
    assert is_crash(RestartCause.OOM, None) and is_crash(RestartCause.CUDA_ERROR, signal.SIGABRT)
    assert is_crash(RestartCause.HANG, signal.SIGKILL)  # our kill of a hung server
    assert not is_crash(RestartCause.CRASH, signal.SIGKILL)  # a kill -9 from outside
    for planned in (RestartCause.OPERATOR, RestartCause.SCHEDULE, RestartCause.DECAY, RestartCause.CONFIG_CHANGE,
                    RestartCause.XID, RestartCause.GPU_LOST):
        assert not is_crash(planned, signal.SIGTERM)


def test_a_request_in_flight_at_two_crashes_is_refused_for_refuse_s_then_served() -> None:
    book = Book()
    assert admit(book, POISON, 0.0) == (Admit.SERVE, None)
    book, refused = in_flight(book, POISON, 100, 1.0, REFUSE_S)
    assert not refused and admit(book, POISON, 1.0) == (Admit.SERVE, None)  # the end is not judged yet
    book, refused_fps = ended(book, 100, True, 1.5, REFUSE_S)
    assert refused_fps == [] and admit(book, POISON, 2.0) == (Admit.SERIAL, None)  # a suspect: alone
    book, refused = in_flight(book, POISON, 200, 5.0, REFUSE_S)  # the replay failed under the next one
    assert not refused and admit(book, POISON, 5.0) == (Admit.SERIAL, None)
    book, refused_fps = ended(book, 200, True, 5.5, REFUSE_S)
    assert refused_fps == [POISON] and book.crashes(POISON) == (100, 200)
    assert admit(book, POISON, 6.0) == (Admit.REFUSE, 5.5 + REFUSE_S)
    assert admit(book, POISON, 5.5 + REFUSE_S) == (Admit.SERVE, None)  # bounded
    assert admit(book, INNOCENT, 6.0) == (Admit.SERVE, None)


def test_the_second_crash_judged_before_the_failure_is_seen_refuses_at_once() -> None:
    book, _ = in_flight(Book(), POISON, 100, 1.0, REFUSE_S)
    book, _ = ended(book, 100, True, 1.5, REFUSE_S)
    book, _ = ended(book, 200, True, 5.0, REFUSE_S)  # the policy saw the exit first
    book, refused = in_flight(book, POISON, 200, 5.1, REFUSE_S)
    assert refused and admit(book, POISON, 5.2)[0] is Admit.REFUSE
    book, refused = in_flight(book, POISON, 300, 5.3, REFUSE_S)
    assert not refused  # announced once


def test_a_suspect_answered_by_the_next_server_is_cleared() -> None:
    book, _ = in_flight(Book(), INNOCENT, 100, 1.0, REFUSE_S)
    book, _ = ended(book, 100, True, 1.5, REFUSE_S)
    assert admit(book, INNOCENT, 2.0)[0] is Admit.SERIAL
    book = answered(book, INNOCENT)
    assert admit(book, INNOCENT, 2.0)[0] is Admit.SERVE and not book.marks
    # ... so a later crash under it is its first again, not its second.
    book, _ = in_flight(book, INNOCENT, 200, 3.0, REFUSE_S)
    book, refused = ended(book, 200, True, 3.5, REFUSE_S)
    assert not refused and admit(book, INNOCENT, 4.0)[0] is Admit.SERIAL


def test_requests_in_flight_at_an_end_that_is_no_crash_are_innocent() -> None:
    book, _ = in_flight(Book(), INNOCENT, 100, 1.0, REFUSE_S)
    book, _ = ended(book, 100, False, 1.5, REFUSE_S)  # kill -9 from outside, a planned restart
    assert admit(book, INNOCENT, 2.0) == (Admit.SERVE, None) and not book.marks
    book, _ = in_flight(book, INNOCENT, 200, 3.0, REFUSE_S)
    book, refused = ended(book, 200, True, 3.5, REFUSE_S)
    assert not refused and admit(book, INNOCENT, 4.0)[0] is Admit.SERIAL  # one crash only


def test_one_crash_twice_reported_counts_once() -> None:
    book, _ = in_flight(Book(), POISON, 100, 1.0, REFUSE_S)
    book, _ = in_flight(book, POISON, 100, 1.1, REFUSE_S)  # a stream cut and its retry at the same server
    book, _ = ended(book, 100, True, 1.5, REFUSE_S)
    book, refused = ended(book, 100, True, 1.6, REFUSE_S)
    assert not refused and book.crashes(POISON) == (100,) and admit(book, POISON, 2.0)[0] is Admit.SERIAL


def test_marks_expire_and_the_book_is_bounded() -> None:
    book, _ = in_flight(Book(), INNOCENT, 100, 1.0, REFUSE_S)
    book, _ = ended(book, 100, True, 1.5, REFUSE_S)
    book, _ = in_flight(book, POISON, 101, 1.0 + REFUSE_S, REFUSE_S)  # any later update drops expired marks
    assert INNOCENT not in book.marks and POISON in book.marks
    for i in range(MAX_MARKS + 10):
        book, _ = in_flight(book, Fingerprint.of("POST", "/completion", str(i).encode()), 300, 700.0 + i * 1e-3,
                            REFUSE_S)
    assert len(book.marks) == MAX_MARKS and POISON not in book.marks  # the oldest went first
    for pid in range(1000, 1200):
        book, _ = ended(book, pid, False, 800.0, REFUSE_S)
    assert len(book.endings) <= 64
