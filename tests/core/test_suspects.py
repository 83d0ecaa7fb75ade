"""The rule for requests in flight at llama-server crashes (core/suspects.py, pure): suspects go alone,
a request sent alone into its second crash is refused for a bounded time, innocents are served and
cleared, and the fingerprint sees through what does not change the computation."""

from __future__ import annotations

import hashlib
import json
import signal

from llama_guard.core.suspects import (
    CANONICAL_MAX_BYTES,
    MAX_MARKS,
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
from llama_guard.model.types import RestartCause

POISON = Fingerprint.of("POST", "/completion", b'{"prompt": "boom"}')
INNOCENT = Fingerprint.of("POST", "/completion", b'{"prompt": "hello"}')
REFUSE_S = 600.0


def test_the_fingerprint_is_method_route_and_what_the_body_computes() -> None:
    assert Fingerprint.of("POST", "/completion", b'{"prompt": "boom"}') == POISON  # a retry is the same request
    assert Fingerprint.of("GET", "/slots?x=1", b"") != Fingerprint.of("GET", "/slots", b"")
    assert Fingerprint.of("PUT", "/completion", b'{"prompt": "boom"}') != POISON
    assert Fingerprint.of("POST", "/v1/completions", b'{"prompt": "boom"}') != POISON  # another handler
    assert POISON != INNOCENT and len(POISON.body_sha256) == 64


def test_the_fingerprint_sees_through_what_does_not_change_the_computation() -> None:
    # The variants of one poisoned prompt: a new seed, other whitespace, another client id,
    # the stream flag; and more of the kind: keys in another order, 0.0 for 0, an alias of the route,
    # a query string on an inference POST, request ids and a slot id.
    base = Fingerprint.of("POST", "/v1/chat/completions",
                          b'{"messages": [{"role": "user", "content": "boom now"}], "temperature": 0}')
    for target, body in (
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "boom now"}], "temperature": 0, '
                                     b'"seed": 42}'),
            ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"  boom\\n\\tnow "}],"temperature":0}'),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "boom now"}], "temperature": 0, '
                                     b'"user": "client-7", "metadata": {"trace": "x"}, "id": "r1"}'),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "boom now"}], "temperature": 0, '
                                     b'"stream": true, "stream_options": {"include_usage": true}}'),
            ("/v1/chat/completions", b'{"temperature": 0.0, "messages": [{"content": "boom now", "role": "user"}]}'),
            ("/chat/completions?client=9", b'{"messages": [{"role": "user", "content": "boom now"}], '
                                           b'"temperature": 0, "id_slot": 1, "request_id": "abc"}')):
        assert Fingerprint.of("POST", target, body) == base, (target, body)
    # What changes the computation is kept: the text, the sampling, n_probs, the decode's length.
    for body in (b'{"messages": [{"role": "user", "content": "boom later"}], "temperature": 0}',
                 b'{"messages": [{"role": "user", "content": "boom now"}], "temperature": 0.5}',
                 b'{"messages": [{"role": "user", "content": "boom now"}], "temperature": 0, "n_probs": 5}',
                 b'{"messages": [{"role": "user", "content": "boom now"}], "temperature": 0, "max_tokens": 9}'):
        assert Fingerprint.of("POST", "/v1/chat/completions", body) != base, body


def test_a_body_that_is_no_json_object_is_known_by_its_bytes() -> None:
    for body in (b"not json", b'["prompt", "boom"]', b'{"prompt": "\xff', b"\xff\xfe", b"[" * 100_000,
                 b'{"prompt": "\\ud800"}'):
        assert Fingerprint.of("POST", "/completion", body).body_sha256 == hashlib.sha256(body).hexdigest(), body
    assert Fingerprint.of("POST", "/completion", b"a  b") != Fingerprint.of("POST", "/completion", b"a b")
    # A body over CANONICAL_MAX_BYTES: its bytes, as hashed while they arrived (or here).
    big = json.dumps({"prompt": "x" * CANONICAL_MAX_BYTES, "seed": 1}).encode()
    assert Fingerprint.of("POST", "/completion", big).body_sha256 == hashlib.sha256(big).hexdigest()
    assert Fingerprint.of("POST", "/completion", big, body_sha256="ab" * 32).body_sha256 == "ab" * 32
    assert Fingerprint.of("POST", "/completion", big[:-1] + b', "seed": 2}') != Fingerprint.of(
        "POST", "/completion", big)


def test_which_server_ends_a_request_can_cause() -> None:
    assert is_crash(RestartCause.CRASH, signal.SIGABRT) and is_crash(RestartCause.CRASH, signal.SIGSEGV)
    assert is_crash(RestartCause.CRASH, None)  # an exit status
    assert is_crash(RestartCause.OOM, None) and is_crash(RestartCause.CUDA_ERROR, signal.SIGABRT)
    assert not is_crash(RestartCause.HANG, signal.SIGKILL)  # a hang is the server's: it judges the server
    assert not is_crash(RestartCause.CRASH, signal.SIGKILL)  # a kill -9 from outside
    for planned in (RestartCause.OPERATOR, RestartCause.SCHEDULE, RestartCause.DECAY, RestartCause.CONFIG_CHANGE,
                    RestartCause.XID, RestartCause.GPU_LOST):
        assert not is_crash(planned, signal.SIGTERM)


def test_a_request_sent_alone_into_its_second_crash_is_refused_for_refuse_s_then_served() -> None:
    book = Book()
    assert admit(book, POISON, 0.0) == (Admit.SERVE, None)
    book, refused = in_flight(book, POISON, 100, 1.0, REFUSE_S)
    assert not refused and admit(book, POISON, 1.0) == (Admit.SERVE, None)  # the end is not judged yet
    book, refused_fps = ended(book, 100, True, 1.5, REFUSE_S)
    assert refused_fps == [] and admit(book, POISON, 2.0) == (Admit.SERIAL, None)  # a suspect: alone
    book = sent_alone(book, POISON, 200)
    book, refused = in_flight(book, POISON, 200, 5.0, REFUSE_S)  # the replay failed under the next one
    assert not refused and admit(book, POISON, 5.0) == (Admit.SERIAL, None)
    book, refused_fps = ended(book, 200, True, 5.5, REFUSE_S)
    assert refused_fps == [POISON] and book.crashes(POISON) == (100, 200)
    assert admit(book, POISON, 6.0) == (Admit.REFUSE, 5.5 + REFUSE_S)
    assert admit(book, POISON, 5.5 + REFUSE_S) == (Admit.SERVE, None)  # bounded
    assert admit(book, INNOCENT, 6.0) == (Admit.SERVE, None)


def test_in_flight_at_two_crashes_among_others_charges_nobody() -> None:
    # A monitor's request in flight at two crashes, never the one suspect sent to them: a suspect
    # still, never refused; the request that crashed the third server alone is.
    book = Book()
    for pid in (100, 200):
        book, refused = in_flight(book, INNOCENT, pid, pid / 100, REFUSE_S)
        book, _ = in_flight(book, POISON, pid, pid / 100, REFUSE_S)
        book, refused_fps = ended(book, pid, True, pid / 100 + 0.5, REFUSE_S)
        assert not refused and refused_fps == []
    assert admit(book, INNOCENT, 3.0)[0] is Admit.SERIAL and admit(book, POISON, 3.0)[0] is Admit.SERIAL
    book = sent_alone(book, POISON, 300)
    book, _ = in_flight(book, POISON, 300, 3.0, REFUSE_S)
    book, refused_fps = ended(book, 300, True, 3.5, REFUSE_S)
    assert refused_fps == [POISON] and book.crashes(POISON) == (100, 200, 300)
    # ... and the innocent in flight at the crashes charged to it is cleared of them.
    assert INNOCENT not in book.marks and admit(book, INNOCENT, 4.0) == (Admit.SERVE, None)


def test_an_innocent_co_suspect_keeps_only_the_crashes_nobody_was_charged_with() -> None:
    other = Fingerprint.of("POST", "/completion", b'{"prompt": "other"}')
    book, _ = in_flight(Book(), INNOCENT, 50, 0.5, REFUSE_S)
    book, _ = ended(book, 50, True, 0.6, REFUSE_S)  # an earlier crash, not the poison's
    book, _ = in_flight(book, POISON, 100, 1.0, REFUSE_S)
    book, _ = in_flight(book, INNOCENT, 100, 1.0, REFUSE_S)
    book, _ = in_flight(book, other, 150, 1.2, REFUSE_S)  # its server's end is not judged yet
    book, _ = ended(book, 100, True, 1.5, REFUSE_S)
    book = sent_alone(book, POISON, 200)
    book, _ = in_flight(book, other, 200, 2.0, REFUSE_S)
    book, _ = in_flight(book, POISON, 200, 2.0, REFUSE_S)
    book, refused_fps = ended(book, 200, True, 2.5, REFUSE_S)
    assert refused_fps == [POISON]
    assert book.marks[INNOCENT].pids == {50} and admit(book, INNOCENT, 3.0)[0] is Admit.SERIAL
    assert book.marks[other].pids == {150}


def test_two_suspects_sent_to_one_crash_are_neither_charged() -> None:
    # The first suspect's client left (the lane went on to the next suspect while the server still
    # worked on the first): the crash is not pinned on either.
    book = Book()
    for fp in (POISON, INNOCENT):
        book, _ = in_flight(book, fp, 100, 1.0, REFUSE_S)
    book, _ = ended(book, 100, True, 1.5, REFUSE_S)
    for fp in (POISON, INNOCENT):
        book = sent_alone(book, fp, 200)
        book, refused = in_flight(book, fp, 200, 2.0, REFUSE_S)
        assert not refused
    book, refused_fps = ended(book, 200, True, 2.5, REFUSE_S)
    assert refused_fps == [] and admit(book, INNOCENT, 3.0)[0] is Admit.SERIAL


def test_a_suspect_answered_before_the_culprit_went_alone_shields_nothing() -> None:
    # The lane sends an innocent suspect first (answered in full), then the poisoned one to the same
    # server: the crash is the poisoned one's.
    book = Book()
    for fp in (POISON, INNOCENT):
        book, _ = in_flight(book, fp, 100, 1.0, REFUSE_S)
    book, _ = ended(book, 100, True, 1.5, REFUSE_S)
    book = answered(sent_alone(book, INNOCENT, 200), INNOCENT)
    book = sent_alone(book, POISON, 200)
    book, _ = in_flight(book, POISON, 200, 2.0, REFUSE_S)
    book, refused_fps = ended(book, 200, True, 2.5, REFUSE_S)
    assert refused_fps == [POISON] and not book.alone[200] - {POISON}


def test_a_crash_sent_alone_that_is_the_first_charges_nothing() -> None:
    book = sent_alone(Book(), INNOCENT, 100)  # left in the lane after it was cleared: one crash only
    book, _ = in_flight(book, INNOCENT, 100, 1.0, REFUSE_S)
    book, refused_fps = ended(book, 100, True, 1.5, REFUSE_S)
    assert refused_fps == [] and admit(book, INNOCENT, 2.0)[0] is Admit.SERIAL


def test_the_second_crash_judged_before_the_failure_is_seen_refuses_at_once() -> None:
    book, _ = in_flight(Book(), POISON, 100, 1.0, REFUSE_S)
    book, _ = ended(book, 100, True, 1.5, REFUSE_S)
    book = sent_alone(book, POISON, 200)
    book, refused_fps = ended(book, 200, True, 5.0, REFUSE_S)  # the policy saw the exit first
    assert refused_fps == []
    book, refused = in_flight(book, POISON, 200, 5.1, REFUSE_S)
    assert refused and admit(book, POISON, 5.2)[0] is Admit.REFUSE
    book = sent_alone(book, POISON, 300)
    book, refused = in_flight(book, POISON, 300, 5.3, REFUSE_S)
    book, refused_fps = ended(book, 300, True, 5.4, REFUSE_S)
    assert not refused and refused_fps == []  # announced once


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
        book = sent_alone(book, POISON, pid)
        book, _ = ended(book, pid, False, 800.0, REFUSE_S)
    assert len(book.endings) <= 64 and len(book.alone) <= 64
