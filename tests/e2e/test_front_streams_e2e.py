"""End to end with the test double: streams whose server ends before their first event, answers that never
begin, streams that stop after a while — the ends a CPU cannot time on the real llama-server (a death right
after a stream's headers, every time; a server that sends headers and then nothing, or only pings).

A client here is an SDK that cannot retry a stream (its 200 headers came): one request, and any error
event or exception is a failure — no client retry is ever made.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import RunPool, free_port

pytestmark = [pytest.mark.timeout(180)]


@contextlib.contextmanager
def started(tmp_path: Path, fake_server: Path, real_model: Path, env: dict[str, str],
            front: dict[str, object] | None = None) -> Iterator[Any]:
    """A started daemon before the test double with ``env`` (its cues) and ``front`` keys; ``front``/
    ``metrics`` its ports, ``requests`` the file of POSTs the servers received."""
    pool = RunPool()
    port, metrics = free_port(), free_port()
    requests = tmp_path / "requests.log"
    run: Any = pool.new(tmp_path, str(fake_server), str(real_model), {
        "server": {"env": {**env, "FAKE_LLAMA_REQUESTS": str(requests)}},
        "front": {"listen": f"127.0.0.1:{port}", "hold_timeout_s": 60.0, **(front or {})},
        "metrics": {"listen": f"127.0.0.1:{metrics}"},
        "health": {"canary": False, "interval_s": 1.0, "timeout_s": 5.0, "hang_strikes": 5},
        "recovery": {"max_restarts": 10, "stable_after_s": 1.0}})
    run.front, run.metrics_port, run.requests = port, metrics, requests
    run.start()
    try:
        run.wait_event("server_ready", 30)
        yield run
    finally:
        leftovers = pool.finish()
    if leftovers:
        pytest.fail(f"server pids {leftovers} outlived their daemon")


def metric(run: Any, series: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series))


def servers_of(run: Any, text: str) -> list[str]:
    """The pids of the servers that received a POST whose body holds ``text``, in order."""
    lines = run.requests.read_text().splitlines() if run.requests.exists() else []
    return [line.split(" ", 1)[0] for line in lines if text in line]


def sdk_stream(run: Any, prompt: str, n_predict: int = 3) -> list[dict[str, Any]]:
    """One streamed completion, as an SDK that cannot retry a stream reads it: its events' data; an
    error event, a missing end or a transport error fails the test."""
    body = {"prompt": prompt, "n_predict": n_predict, "stream": True}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"http://127.0.0.1:{run.front}/completion", json=body, timeout=90) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            assert not line.startswith("event: error"), line
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                assert "error" not in events[-1], events[-1]
    assert events and events[-1]["stop"], events
    return events


FAULT_FREE = ["x", "x", "x", ""]  # the double's stream of 3 tokens, then its final event


@pytest.mark.parametrize(("ends", "ping"), [(2, False), (3, False), (2, True)],
                         ids=["two-ends", "three-ends", "two-ends-after-a-ping"])
def test_a_stream_whose_server_ends_again_and_again_before_its_first_event_completes(
        tmp_path: Path, fake_server: Path, real_model: Path, ends: int, ping: bool) -> None:
    # Each server sends the stream's headers (the client has its 200) — and, with ping, an SSE comment
    # as llama-server's pings are — then is killed (-9: no crash a request causes) before the first
    # event. The client's one stream is continued by the next server's, as many times as servers end.
    env = {"FAKE_LLAMA_HEADERS_THEN_ABORT": str(tmp_path / "died"), "FAKE_LLAMA_HEADERS_THEN_ABORT_TIMES": str(ends),
           "FAKE_LLAMA_HEADERS_THEN_SIGNAL": "KILL", "FAKE_LLAMA_PING_FIRST": "1" if ping else ""}
    with started(tmp_path, fake_server, real_model, env) as run:
        prompt = f"ended {ends} times before the first event"
        events = sdk_stream(run, prompt)
        assert [e["content"] for e in events] == FAULT_FREE
        assert len(set(servers_of(run, prompt))) == ends + 1
        assert metric(run, "llama_guard_front_requests_replayed_total") == ends
        assert metric(run, 'llama_guard_front_requests_total{code="cut"}') == 0


def test_a_stream_cut_mid_way_is_resumed_with_the_budget_less_what_was_sent(
        tmp_path: Path, fake_server: Path, real_model: Path) -> None:
    # The server sends 2 of 5 token events and dies (kill -9); the next one gets the request with the
    # text sent after the prompt and n_predict 3, and the client's one stream goes on to its end.
    env = {"FAKE_LLAMA_CUT_AFTER": "2", "FAKE_LLAMA_CUT_MARK": str(tmp_path / "cut")}
    with started(tmp_path, fake_server, real_model, env) as run:
        events = sdk_stream(run, "cut mid-way", n_predict=5)
        assert [e["content"] for e in events] == ["x"] * 5 + [""]
        lines = run.requests.read_text().splitlines()
        assert len(lines) == 2 and lines[0].split()[0] != lines[1].split()[0], lines
        assert metric(run, "llama_guard_front_streams_resumed_total") == 1
        assert metric(run, 'llama_guard_front_requests_total{code="cut"}') == 0


@pytest.mark.parametrize("ping_s", ["", "0.3"], ids=["silent", "pings"])
def test_a_stream_that_never_sends_its_first_event_ends_with_504_and_is_evidence(
        tmp_path: Path, fake_server: Path, real_model: Path, ping_s: str) -> None:
    # Headers, then nothing (or only llama-server's SSE pings, which its HTTP thread sends while the
    # decode hangs): the stream ends at first_event_timeout_s with a 504 error event, and the policy
    # hears of a stalled stream.
    env = {"FAKE_LLAMA_SILENT_AFTER": "0", "FAKE_LLAMA_PING_S": ping_s}
    with started(tmp_path, fake_server, real_model, env, {"first_event_timeout_s": 2.0}) as run:
        body = {"prompt": "never begins", "n_predict": 3, "stream": True}
        answer = httpx.post(f"http://127.0.0.1:{run.front}/completion", json=body, timeout=90)
        assert answer.status_code == 200
        lines = [line for line in answer.text.splitlines() if line and not line.startswith(":")]
        assert lines[0] == "event: error" and len(lines) == 2, lines
        error = json.loads(lines[1][len("data: "):])["error"]
        assert error["code"] == 504 and "first_event_timeout_s" in error["message"], error
        stalled = run.wait_event("server_stream_stalled", 30)
        assert stalled["server_pid"] == run.wait_event("server_ready", 1)["server_pid"]
        assert metric(run, 'llama_guard_front_requests_failed_total{reason="first_event_timeout"}') == 1


def test_a_whole_answer_whose_body_never_comes_gets_504(tmp_path: Path, fake_server: Path, real_model: Path) -> None:
    # A JSON answer's status line and Content-Length, then no byte of its body.
    with started(tmp_path, fake_server, real_model, {"FAKE_LLAMA_SILENT_AFTER": "0"},
                 {"first_event_timeout_s": 2.0}) as run:
        answer = httpx.post(f"http://127.0.0.1:{run.front}/completion", timeout=90,
                            json={"prompt": "no body", "n_predict": 3})
        assert answer.status_code == 504 and "first_event_timeout_s" in answer.json()["error"]["message"]
        run.wait_event("server_stream_stalled", 30)


def test_a_begun_stream_that_gets_only_pings_is_stalled(tmp_path: Path, fake_server: Path, real_model: Path) -> None:
    # Two events, then only SSE pings: pings are no event, so the stream is reported stalled.
    env = {"FAKE_LLAMA_SILENT_AFTER": "2", "FAKE_LLAMA_PING_S": "0.3"}
    with started(tmp_path, fake_server, real_model, env, {"stall_timeout_s": 2.0}) as run:
        with httpx.stream("POST", f"http://127.0.0.1:{run.front}/completion", timeout=90,
                          json={"prompt": "stops after two", "n_predict": 5, "stream": True}) as resp:
            assert resp.status_code == 200
            stalled = run.wait_event("server_stream_stalled", 30)
        assert stalled["stalled_s"] >= 2.0
