"""End to end: a request that crashes llama-server is not replayed into crash after crash.

The test double stands for the crash on demand (``$FAKE_LLAMA_ABORT_PROMPT``: a POST whose body holds
the text aborts the server, as grammar, JSON-schema, template and image crashes do on real builds);
``$FAKE_LLAMA_REQUESTS`` records every POST each server received, so the tests count what was sent
where. Each test: at most two crashes for the poisoned request, then 422; every other request 200.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import RunPool, free_port

pytestmark = [pytest.mark.timeout(120)]

POISON = "BOOM-crashes-the-server"


@contextlib.contextmanager
def started(tmp_path: Path, fake_server: Path, real_model: Path, env: dict[str, str],
            recovery: dict[str, object] | None = None, health: dict[str, object] | None = None) -> Iterator[Any]:
    """A started daemon before the test double with ``env`` (the fault cues) and ``recovery`` and
    ``health`` keys over the test's own; ``front``/``metrics`` its ports, ``requests`` the file of POSTs
    the servers received."""
    pool = RunPool()
    front, metrics = free_port(), free_port()
    requests = tmp_path / "requests.log"
    run: Any = pool.new(tmp_path, str(fake_server), str(real_model), {
        "server": {"env": {**env, "FAKE_LLAMA_REQUESTS": str(requests)}},
        "front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": 60.0},
        "metrics": {"listen": f"127.0.0.1:{metrics}"},
        "health": {"canary": False, "interval_s": 1.0, "timeout_s": 5.0, "hang_strikes": 5, **(health or {})},
        "recovery": {"max_restarts": 10, "stable_after_s": 1.0, **(recovery or {})}})
    run.front, run.metrics_port, run.requests = front, metrics, requests
    run.start()
    try:
        run.wait_event("server_ready", 30)
        yield run
    finally:
        leftovers = pool.finish()
    if leftovers:
        pytest.fail(f"server pids {leftovers} outlived their daemon")


@pytest.fixture
def crashy(tmp_path: Path, fake_server: Path, real_model: Path) -> Iterator[Any]:
    """A started daemon before the test double that aborts on POISON, each decode 0.5 s."""
    with started(tmp_path, fake_server, real_model,
                 {"FAKE_LLAMA_ABORT_PROMPT": POISON, "FAKE_LLAMA_DECODE_S": "0.5"}) as run:
        yield run


def post(run: Any, path: str, prompt: str, timeout: float = 90.0) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{run.front}{path}", json={"prompt": prompt, "n_predict": 1}, timeout=timeout)


def sent(run: Any, text: str) -> list[str]:
    """The pids of the servers that received a POST whose body holds ``text``, in order."""
    lines = run.requests.read_text().splitlines() if run.requests.exists() else []
    return [line.split(" ", 1)[0] for line in lines if text in line]


def metric(run: Any, series: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series))


def test_a_crashing_request_costs_two_crashes_then_422_and_innocents_all_get_200(crashy: Any) -> None:
    run = crashy
    with ThreadPoolExecutor(12) as pool:
        innocents = [pool.submit(post, run, "/completion", f"hello {i}") for i in range(4)]
        poisoned = pool.submit(post, run, "/completion", POISON)
        deadline = time.monotonic() + 60
        later = []
        while not poisoned.done() and time.monotonic() < deadline:  # new traffic flows across both crashes
            later.append(pool.submit(post, run, "/completion", f"later {len(later)}"))
            time.sleep(0.3)
        answer = poisoned.result()
        results = [f.result() for f in innocents + later]
    assert answer.status_code == 422, answer.text
    message = answer.json()["error"]["message"]
    assert "in flight at two llama-server crashes" in message and "refused until" in message
    assert [r.status_code for r in results] == [200] * len(results), [r.text for r in results if r.status_code != 200]
    servers = sent(run, POISON)
    assert len(servers) == 2 and servers[0] != servers[1], servers  # the replay went to the next server, once
    assert len([e for e in run.events() if e["event"] == "server_exited"]) == 2
    refused = run.wait_event("front_request_refused", 10)
    assert refused["path"] == "/completion" and len(refused["server_pids"]) == 2
    # A retry of it, now: refused at once, not sent; an innocent request is served.
    again = post(run, "/completion", POISON)
    assert again.status_code == 422 and len(sent(run, POISON)) == 2
    assert post(run, "/completion", "after").status_code == 200
    assert metric(run, 'llama_guard_front_requests_failed_total{reason="crashed_twice"}') == 2
    assert metric(run, "llama_guard_front_crash_refusals_total") == 1
    assert "daemon_exit" not in run.names()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_sdk_style_retries_of_a_crashing_request_do_not_end_the_daemon(crashy: Any, stream: bool) -> None:
    run = crashy
    # An SDK client whose timeout (0.3 s) is shorter than the crashing request takes (0.5 s): it leaves
    # before each crash and sends the request again, as a new one, until it gets an answer. A stream's
    # client leaves after the stream's headers (sent when the server takes the request), before its
    # first event: that crash counts against the request all the same.
    statuses: list[int | str] = []
    deadline = time.monotonic() + 60
    body = {"prompt": POISON, "n_predict": 1, "stream": stream}
    while time.monotonic() < deadline and 422 not in statuses:
        try:
            statuses.append(httpx.post(f"http://127.0.0.1:{run.front}/v1/chat/completions", json=body,
                                       timeout=0.3).status_code)
        except httpx.TimeoutException:
            statuses.append("timeout")
        time.sleep(0.3)
    assert statuses[-1] == 422, statuses
    # Under load a copy the client sent again can reach the same server before that server's crash; what
    # the goal bounds is the servers it crashed: at most two.
    assert len(set(sent(run, POISON))) <= 2 and len([e for e in run.events() if e["event"] == "server_exited"]) <= 2
    assert post(run, "/completion", "still served").status_code == 200
    assert "daemon_exit" not in run.names()


def test_a_cut_slots_erase_or_props_post_is_not_replayed(crashy: Any) -> None:
    run = crashy
    for path in ("/slots?action=erase", "/props"):
        answer = post(run, path, f"{POISON} {path}")
        assert answer.status_code == 502, answer.text
        assert "it is not sent again" in answer.json()["error"]["message"]
        assert len(sent(run, f"{POISON} {path}")) == 1  # one server got it, the next one never
        run.wait_event("server_ready", 30, skip=len(sent(run, POISON)))
    assert metric(run, 'llama_guard_front_requests_failed_total{reason="not_replayable"}') == 2
    assert post(run, "/completion", "served").status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_server_that_dies_between_its_headers_and_its_body_has_the_request_replayed(
        tmp_path: Path, fake_server: Path, real_model: Path, stream: bool) -> None:
    # The first server sends the status line and headers (a whole answer's Content-Length, or a
    # stream's), then dies before the first body byte: the client has been sent nothing, so the request
    # is unanswered and goes to the next server, which answers it in full.
    with started(tmp_path, fake_server, real_model, {"FAKE_LLAMA_HEADERS_THEN_ABORT": str(tmp_path / "died")}) as run:
        prompt = f"cut after the headers, stream={stream}"
        body = {"prompt": prompt, "n_predict": 3, "stream": stream}
        answer = httpx.post(f"http://127.0.0.1:{run.front}/completion", json=body, timeout=90)
        assert answer.status_code == 200, answer.text
        if stream:
            events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")]
            assert [e["content"] for e in events] == ["x", "x", "x", ""] and events[-1]["stop"], answer.text
        else:
            assert answer.json()["content"] == "x"
        servers = sent(run, prompt)
        assert len(servers) == 2 and servers[0] != servers[1], servers
        assert metric(run, "llama_guard_front_requests_replayed_total") == 1
        assert metric(run, 'llama_guard_front_requests_total{code="cut"}') == 0


def only_an_error_event(run: Any, prompt: str) -> dict[str, Any]:
    """Stream a completion of ``prompt`` through the front door; its answer must be a 200 stream whose
    body is one SSE error event and nothing else: returns that event's ``error`` object."""
    answer = httpx.post(f"http://127.0.0.1:{run.front}/completion", timeout=90,
                        json={"prompt": prompt, "n_predict": 3, "stream": True})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in answer.text.splitlines() if line]
    assert lines[0] == "event: error" and len(lines) == 2, lines  # nothing else came
    error: dict[str, Any] = json.loads(lines[1][len("data: "):])["error"]
    return error


def test_a_stream_whose_headers_went_out_and_whose_replay_crashed_too_ends_with_a_422_error_event(
        tmp_path: Path, fake_server: Path, real_model: Path) -> None:
    # Two servers in a row take the stream, send its headers and crash before its first event: the
    # client already has a 200 and the stream's headers, so the refusal comes as the SSE error event.
    env = {"FAKE_LLAMA_HEADERS_THEN_ABORT": str(tmp_path / "died"), "FAKE_LLAMA_HEADERS_THEN_ABORT_TIMES": "2"}
    with started(tmp_path, fake_server, real_model, env) as run:
        prompt = "a stream cut twice before its first event"
        error = only_an_error_event(run, prompt)
        assert error["code"] == 422 and "in flight at two llama-server crashes" in error["message"], error
        assert len(set(sent(run, prompt))) == 2
        assert metric(run, 'llama_guard_front_requests_failed_total{reason="crashed_twice"}') == 1
        assert metric(run, 'llama_guard_front_requests_total{code="cut"}') == 1
        assert httpx.post(f"http://127.0.0.1:{run.front}/completion", timeout=90,  # refused: never sent again
                          json={"prompt": prompt, "n_predict": 3, "stream": True}).status_code == 422
        assert len(sent(run, prompt)) == 2


def test_a_stream_whose_replay_is_answered_with_an_error_ends_with_that_error(
        tmp_path: Path, fake_server: Path, real_model: Path) -> None:
    # The first server sends the stream's headers and crashes; the next one answers the replay with a
    # JSON 500 (its compute fails): the client's stream ends with one error event carrying that status
    # and llama-server's own message.
    env = {"FAKE_LLAMA_HEADERS_THEN_ABORT": str(tmp_path / "died"), "FAKE_LLAMA_FAULT": "completion_500"}
    with started(tmp_path, fake_server, real_model, env) as run:
        error = only_an_error_event(run, "replayed into an error")
        assert error["code"] == 500 and "compute error (fake)" in error["message"], error
        assert metric(run, 'llama_guard_front_requests_failed_total{reason="upstream_failed"}') == 1
        assert metric(run, "llama_guard_front_requests_replayed_total") == 1


def test_a_replay_whose_client_left_before_it_went_is_not_counted_as_replayed(
        tmp_path: Path, fake_server: Path, real_model: Path) -> None:
    # The server sends the stream's headers and crashes; the next one loads for 3 s; the client leaves
    # after 1 s of waiting: the request is never sent again, and the count of replays says so.
    env = {"FAKE_LLAMA_HEADERS_THEN_ABORT": str(tmp_path / "died"), "FAKE_LLAMA_LOAD_S": "3"}
    with started(tmp_path, fake_server, real_model, env) as run:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"http://127.0.0.1:{run.front}/completion", timeout=1.0,
                       json={"prompt": "left while held", "n_predict": 3, "stream": True})
        second = run.wait_event("server_ready", 30, skip=1)["server_pid"]
        # A replay goes as soon as the server is ready: a request sent after that was answered by it
        # (the marker), so any replay of the held one was sent before.
        assert post(run, "/completion", "after the ready").status_code == 200
        assert sent(run, "after the ready") == [str(second)]
        assert len(sent(run, "left while held")) == 1
        assert metric(run, "llama_guard_front_requests_replayed_total") == 0
        assert metric(run, "llama_guard_front_requests_waiting") == 0


def test_one_crashing_prompt_after_another_never_ends_the_daemon(tmp_path: Path, fake_server: Path,
                                                                 real_model: Path) -> None:
    """A client sends a crashing prompt, and after its 422 another one (a new body, on another path
    too): each crashes two servers, the second time right after the server became ready, and is then
    refused. The crashes are the requests' — charged to them — so they never chain into the verdict
    that blames the build (exit 78: under systemd's RestartPreventExitStatus the daemon would stay
    down), nor hold a start back to confirm one (``repeat_confirm_s``); innocent requests get 200."""
    with started(tmp_path, fake_server, real_model, {"FAKE_LLAMA_ABORT_PROMPT": POISON, "FAKE_LLAMA_DECODE_S": "0.3"},
                 recovery={"stable_after_s": 60.0, "repeat_confirm_s": 45.0}) as run:
        for i, path in enumerate(("/completion", "/v1/completions", "/completion")):
            answer = post(run, path, f"{POISON} {i}")
            assert answer.status_code == 422, (i, answer.text)
            assert post(run, "/completion", "hello").status_code == 200
        # No start held back to confirm a chain: a backoff stretched to repeat_confirm_s (45 s) after the chain's
        # first failure is announced (server_backoff's backoff_s), and the charged request releases it — the next
        # start comes before the announced end (the daemon's own clock against its own deadline).
        events = [e for e in run.events() if e["event"] in ("server_backoff", "server_starting")]
        pairs = [(a, b) for a, b in itertools.pairwise(events) if a["event"] == "server_backoff"]
        assert len(pairs) == 6 and all(b["event"] == "server_starting" for _, b in pairs), events
        assert any(a["backoff_s"] > 30.0 for a, _ in pairs), pairs  # the stretched ones were there
        def epoch(iso: str) -> float:
            return datetime.fromisoformat(iso).timestamp()

        late = [(a["backoff_s"], epoch(b["timestamp"]) - epoch(a["timestamp"])) for a, b in pairs
                if epoch(b["timestamp"]) - epoch(a["timestamp"]) >= a["backoff_s"] > 0]
        assert late == [], late
        names = run.names()
        assert names.count("front_request_refused") == 3, names
        assert names.count("server_exited") == 6, names
        assert "server_failure_repeated" not in names and "daemon_exit" not in names, names
        assert run.proc.poll() is None
