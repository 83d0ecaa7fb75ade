"""End to end: the front door before the REAL llama-server on the REAL SmolLM2 model (CPU).

Each test starts ``python -m llama_guard run`` with ``[front].listen`` set, sends client requests to the
front door and breaks the server under them (kill -9, a drained restart, a crash mid-stream); the
clients must see no restart. The server that never becomes ready is the test double (a real one
always becomes ready or exits).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import FAKE_SERVER, DaemonRun, RunPool, free_port

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


class FrontRun(DaemonRun):
    """A daemon run with the front door on: ``port`` is llama-server's private port, ``front`` the
    front door's, ``metrics`` the exporter's."""

    port: int
    front: int
    metrics: int


@pytest.fixture
def front(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> Iterator[Any]:
    pool = RunPool()

    def make(extra: dict[str, dict[str, object]] | None = None, binary: str = "", model: str = "") -> FrontRun:
        front_port, metrics_port = free_port(), free_port()
        sections: dict[str, dict[str, object]] = {
            "front": {"listen": f"127.0.0.1:{front_port}", "hold_timeout_s": 120.0},
            "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
            "health": {"canary": False, "interval_s": 1.0, "hang_strikes": 5, "timeout_s": 5.0},
            "recovery": {"stable_after_s": 1.0, "max_restarts": 5},
        }
        for name, keys in (extra or {}).items():
            sections.setdefault(name, {}).update(keys)
        run: Any = pool.new(tmp_path, binary or str(llama_server_bin), model or str(real_model), sections)
        run.front, run.metrics = front_port, metrics_port
        return run

    yield make
    leftovers = pool.finish()
    if leftovers:
        pytest.fail(f"llama-server pids {leftovers} outlived their daemon")


def completion(port: int, n_predict: int = 4, timeout: float = 240.0, prompt: str = "Hello") -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/completion", timeout=timeout,
                      json={"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False})


def metric(run: FrontRun, name: str) -> float:
    """The sum of every series of ``name`` on the exporter (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{run.metrics}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_kill_9_while_5_clients_send_all_get_200(front: Any) -> None:
    run = front().start()
    first = run.wait_event("server_ready", 60)["server_pid"]
    with ThreadPoolExecutor(5) as pool:
        answers = [pool.submit(completion, run.front, 6) for _ in range(5)]
        wait_for(lambda: metric(run, "llama_guard_front_requests_in_flight") >= 1, 30, "requests in flight")
        os.kill(first, signal.SIGKILL)
        results = [a.result() for a in answers]
    assert [r.status_code for r in results] == [200] * 5, [r.text for r in results]
    assert all(r.json()["tokens_predicted"] == 6 for r in results)
    second = run.wait_event("server_ready", 60, skip=1)["server_pid"]
    assert second != first
    assert run.wait_event("server_exited")["server_pid"] == first
    assert metric(run, "llama_guard_front_requests_failed_total") == 0
    held = run.wait_event("front_held", 30)
    assert held["failed"] == 0 and held["held"] >= 1


def test_drained_restart_3_long_and_5_new_all_get_200(front: Any) -> None:
    run = front({"server": {"parallel": 3, "ctx_size": 1536}, "schedule": {"drain_timeout_s": 240.0}}).start()
    first = run.wait_event("server_ready", 60)["server_pid"]
    with ThreadPoolExecutor(8) as pool:
        long = [pool.submit(completion, run.front, 24, 280.0, f"Story {i}:") for i in range(3)]
        wait_for(lambda: metric(run, "llama_guard_front_requests_in_flight") >= 3, 30, "3 long requests in flight")
        run.signal(signal.SIGUSR1)  # llama-guard restart: drained
        run.wait_event("restart_requested", 10)
        new = [pool.submit(completion, run.front, 2) for _ in range(5)]
        wait_for(lambda: metric(run, "llama_guard_front_requests_waiting") >= 5, 30, "5 new requests held")
        results = [f.result() for f in long + new]
    assert [r.status_code for r in results] == [200] * 8, [r.text for r in results]
    assert [r.json()["tokens_predicted"] for r in results] == [24] * 3 + [2] * 5
    names = run.names()
    assert "drain_timeout" not in names
    stopped = run.wait_event("server_stopped")
    assert stopped["server_pid"] == first
    ready = run.wait_event("server_ready", 10, skip=1)
    assert ready["server_pid"] != first
    # Timed from the old server's stop (after the drain): the held requests' first token comes after ready.
    token = run.wait_event("restart_first_token", 10)
    assert token["server_pid"] == ready["server_pid"]
    assert 0 < ready["restart_to_ready_s"] <= token["restart_to_first_token_s"]
    assert metric(run, "llama_guard_restart_to_first_token_seconds_count") == 1
    assert [e["event"] for e in run.events()].count("restart_first_token") == 1  # once per restart
    held = run.wait_event("front_held", 10)
    assert held["held"] >= 5 and held["failed"] == 0 and "draining" in held["phase"]
    assert metric(run, "llama_guard_front_requests_failed_total") == 0
    assert metric(run, "llama_guard_front_requests_replayed_total") == 0  # drained: nothing was cut


def test_server_never_ready_held_requests_get_503_within_hold_timeout(front: Any, tmp_path: Path) -> None:
    fake_model = tmp_path / "fake.gguf"
    fake_model.write_bytes(b"GGUF" + bytes(28))
    run = front({"front": {"hold_timeout_s": 2.0}, "server": {"env": {"FAKE_LLAMA_LOAD_S": "3600"}},
                 "health": {"load_timeout_s": 3600.0}},
                binary=str(FAKE_SERVER), model=str(fake_model)).start()
    run.wait_event("server_starting", 30)
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{run.front}/livez", timeout=5).status_code == 200, 20, "livez")
    ready = httpx.get(f"http://127.0.0.1:{run.front}/readyz", timeout=5)
    doc = ready.json()
    assert ready.status_code == 503 and doc == {"ready": False, "phase": "starting", "cause": "starting",
                                                "restart_cause": None, "retry_after_s": doc["retry_after_s"]}
    # no load seen yet: the load is estimated at 5 s (status/readiness.py), less the time it has loaded
    assert 1 <= doc["retry_after_s"] <= 5 and ready.headers["Retry-After"] == str(doc["retry_after_s"])
    start = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: completion(run.front, timeout=30.0), range(3)))
    elapsed = time.monotonic() - start
    assert [r.status_code for r in results] == [503] * 3
    assert all(r.headers["Retry-After"] == "5" for r in results)
    assert all(r.json()["error"]["type"] == "unavailable_error" for r in results)
    assert all(r.json()["error"]["message"].startswith("llama-guard front door: ") for r in results)
    assert elapsed >= 1.9  # held for hold_timeout_s (2 s), then answered (never a hang: the client's 30 s timeout)
    assert metric(run, "llama_guard_front_requests_failed_total") == 3


def test_stream_that_cannot_be_resumed_ends_with_an_sse_error_naming_why_and_is_not_replayed(front: Any) -> None:
    # The stream asks for logprobs (n_probs): a resume would compute them from another context, so the
    # kill -9 mid-stream ends it as before — one error event that says why — and nothing is sent again.
    run = front().start()
    first = run.wait_event("server_ready", 60)["server_pid"]
    body = {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "stream": True, "n_probs": 1}
    lines: list[str] = []
    with httpx.stream("POST", f"http://127.0.0.1:{run.front}/completion", json=body, timeout=120.0) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-accel-buffering"] == "no"  # a reverse proxy in front passes each event at once
        for line in resp.iter_lines():  # ends cleanly: the body was closed, not broken
            lines.append(line)
            if len(lines) == 2:
                os.kill(first, signal.SIGKILL)
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    filled = [line for line in lines if line and not line.startswith(":")]
    assert filled[-2] == "event: error" and filled[-1].startswith("data: ")
    error = json.loads(events[-1])
    assert error["type"] == "error" and error["error"]["code"] == 502 and "incomplete" in error["error"]["message"]
    assert "cannot be resumed" in error["error"]["message"] and "logprobs" in error["error"]["message"], error
    assert all("content" in json.loads(e) for e in events[:-1])  # the tokens that came before, untouched
    assert "[DONE]" not in lines
    second = run.wait_event("server_ready", 60, skip=1)["server_pid"]
    # A replay would be sent as soon as the next server is ready: a request sent after that, and its end
    # in the server's output, are the marker that the second server's task list is complete before it.
    assert completion(run.front, n_predict=1).status_code == 200
    run.wait_event("server_line", 60, where=lambda e: e["server_pid"] == second and "stop processing" in e["line"])
    lines_of_second = [e["line"] for e in run.events() if e["event"] == "server_line" and e["server_pid"] == second]
    assert len([line for line in lines_of_second if "processing task" in line]) == 1, lines_of_second  # the marker
    assert metric(run, "llama_guard_front_requests_replayed_total") == 0
    assert metric(run, 'llama_guard_front_requests_failed_total{reason="stream_cut"}') == 1


RESUMED = [  # (path, body, the text of one event): raw prompt, OpenAI completions, OpenAI chat
    ("/completion", {"prompt": "Once upon a time, in a quiet vil", "n_predict": 16}, lambda e: e.get("content", "")),
    ("/v1/completions", {"prompt": "The three primary colors are", "max_tokens": 16},
     lambda e: e["choices"][0]["text"] if e.get("choices") else ""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a short poem about the sea."}],
                              "max_tokens": 16},
     lambda e: (e["choices"][0]["delta"].get("content") or "") if e.get("choices") else ""),
]


def _streamed_text(port: int, path: str, body: dict[str, Any], text_of: Any, kill: int | None = None) -> str:
    """The text of one stream through the front door, read as an SDK that cannot retry it reads it
    (an error event or a transport error fails the test); ``kill``: kill -9 that pid after 5 events."""
    events = 0
    text = ""
    with httpx.stream("POST", f"http://127.0.0.1:{port}{path}", timeout=240.0,
                      json={**body, "stream": True, "temperature": 0}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            assert not line.startswith("event: error"), line
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text += text_of(event)
            events += 1
            if kill is not None and events == 5:
                os.kill(kill, signal.SIGKILL)
    return text


@pytest.mark.timeout(900)  # two streams and a restart, at a loaded 2-core host's speed
@pytest.mark.parametrize(("path", "body", "text_of"), RESUMED, ids=["completion", "v1-completions", "chat"])
def test_a_stream_cut_by_kill_9_mid_way_is_resumed_with_the_uncut_text(front: Any, path: str, body: dict[str, Any],
                                                                       text_of: Any) -> None:
    """kill -9 of the real llama-server after 5 events of a stream at temperature 0: the next server
    continues from the text already sent (after the raw prompt; as the start of the assistant's
    message for a chat) with the rest of the token budget, and the client's one stream ends as the
    uncut one does, text for text."""
    run = front().start()
    pid = run.wait_event("server_ready", 90)["server_pid"]
    reference = _streamed_text(run.front, path, body, text_of)
    assert _streamed_text(run.front, path, body, text_of, kill=pid) == reference
    assert metric(run, "llama_guard_front_streams_resumed_total") == 1
    assert metric(run, "llama_guard_front_requests_failed_total") == 0


def test_first_event_is_relayed_before_the_server_sends_the_second(front: Any, tmp_path: Path) -> None:
    """No byte of a stream waits in the front door for a later one: the double sends its second
    event only once the client holds the first (the gate file), so a relay that buffered would never
    deliver it."""
    fake_model, gate = tmp_path / "fake.gguf", tmp_path / "gate"
    fake_model.write_bytes(b"GGUF" + bytes(28))
    run = front({"server": {"env": {"FAKE_LLAMA_STREAM_GATE": str(gate), "FAKE_LLAMA_EVENT_S": "0"}}},
                binary=str(FAKE_SERVER), model=str(fake_model)).start()
    run.wait_event("server_ready", 30)
    body = {"prompt": "Hi", "n_predict": 3, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{run.front}/completion", json=body, timeout=30.0) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        first = next(chunks)  # a read timeout (30 s) here: the first event was held back
        assert first.startswith(b"data: ") and b'"stop": false' in first and first.count(b"data: ") == 1
        gate.touch()
        rest = b"".join(chunks)
    assert rest.count(b"data: ") == 3 and b'"stop": true' in rest
    wait_for(lambda: metric(run, "llama_guard_front_requests_total") == 1, 10, "the answer counted")


def test_back_to_back_streams_are_never_sent_on_a_connection_the_server_closes(front: Any, tmp_path: Path) -> None:
    """llama-server closes its connection after each streamed answer (while its headers say Keep-Alive):
    the front door must not hand that connection to the next request, which would fail on it, be
    counted as in flight at a server failure and be replayed after a pause."""
    fake_model = tmp_path / "fake.gguf"
    fake_model.write_bytes(b"GGUF" + bytes(28))
    # The headers first, the events 50 ms later (as llama-server answers: the headers before the
    # prefill), and the close half a second after the stream: after the next request is sent.
    env = {"FAKE_LLAMA_EVENT_S": "0.05", "FAKE_LLAMA_CLOSE_AFTER_S": "0.5"}
    run = front({"server": {"env": env}}, binary=str(FAKE_SERVER), model=str(fake_model)).start()
    run.wait_event("server_ready", 30)
    body = {"prompt": "Hi", "n_predict": 2, "stream": True}
    with httpx.Client(base_url=f"http://127.0.0.1:{run.front}", timeout=30.0) as client:
        answers = [client.post("/completion", json=body) for _ in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert all(a.text.count("data: ") == 3 for a in answers)
    assert metric(run, "llama_guard_front_requests_replayed_total") == 0


def test_headers_body_and_api_key_pass_through_to_llama_server(front: Any, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-front-door-test\n")
    key_file.chmod(0o600)
    run = front({"server": {"api_key_file": str(key_file)}}).start()
    run.wait_event("server_ready", 60)
    url = f"http://127.0.0.1:{run.front}/completion"
    no_key = httpx.post(url, json={"prompt": "Hi", "n_predict": 1}, timeout=60)
    assert no_key.status_code == 401  # llama-server's own check: the front door adds none of its own
    good = httpx.post(url, json={"prompt": "Hi", "n_predict": 1}, timeout=60,
                      headers={"Authorization": "Bearer sk-front-door-test"})
    assert good.status_code == 200 and good.json()["tokens_predicted"] == 1
    assert good.headers["server"] == "llama.cpp"  # the server's own headers come back
    text = run.log_path.read_text()
    assert "sk-front-door-test" not in text and '"prompt"' not in text  # neither header nor body logged


def test_livez_and_readyz_on_the_metrics_listener_without_the_front_door(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    pool = RunPool()
    metrics_port = free_port()
    run = pool.new(tmp_path, str(llama_server_bin), str(real_model),
                   {"metrics": {"listen": f"127.0.0.1:{metrics_port}"}, "health": {"canary": False}})
    try:
        run.start()
        base = f"http://127.0.0.1:{metrics_port}"
        wait_for(lambda: _status(base + "/livez") == 200, 30, "livez")
        run.wait_event("server_ready", 60)
        assert httpx.get(base + "/readyz", timeout=5).json() == {"ready": True, "phase": "ready", "cause": None,
                                                                 "restart_cause": None, "retry_after_s": None}
        live = httpx.get(base + "/livez", timeout=5)
        assert live.status_code == 200 and live.json()["live"] is True
        assert "llama_guard_phase" in httpx.get(base + "/metrics", timeout=5).text
    finally:
        assert not pool.finish()


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_no_canary_in_rounds_where_a_client_request_completed(front: Any) -> None:
    run = front({"health": {"canary": True, "interval_s": 1.0, "canary_timeout_s": 30.0}}).start()
    pid = run.wait_event("server_ready", 60)["server_pid"]
    run.wait_event("server_probe", 30, where=lambda e: e["canary_ok"] is True)  # idle: the canary runs
    busy_from = len(run.events())
    deadline = time.monotonic() + 8.0
    while time.monotonic() < deadline:  # steady traffic: a request completes in every round
        assert completion(run.front, 1).status_code == 200
    probes = [e for e in run.events()[busy_from:] if e["event"] == "server_probe" and e["server_pid"] == pid]
    assert probes and any(e["canary_ok"] is None for e in probes), probes


def _sse_stream(port: int, n_predict: int) -> tuple[int, str]:
    """One streamed completion through ``port``: its status and how it ended ("done": the last event
    has ``"stop": true``, "error": an SSE error event, "json": the front door's own JSON error)."""
    body = {"prompt": "Write a long story about a lighthouse.", "n_predict": n_predict, "ignore_eos": True,
            "stream": True, "cache_prompt": False}
    # Every stream is now served to its end — replayed at each server end before its first event, resumed
    # after it — so the last of 64 waits in llama-server's queue (4 slots) behind the others' tokens.
    with httpx.stream("POST", f"http://127.0.0.1:{port}/completion", json=body, timeout=600.0) as resp:
        lines = list(resp.iter_lines())
    if resp.status_code != 200:
        return resp.status_code, "json" if lines and json.loads(lines[0])["error"] else "?"
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    ended = "error" if "event: error" in lines else "done" if events and events[-1].get("stop") else "?"
    return 200, ended


@pytest.mark.timeout(900)
def test_three_kills_under_64_streams_every_client_gets_an_end_and_nothing_stays_held(front: Any) -> None:
    """kill -9 three times in a row while 64 streams run through the front door, the second one as soon as
    the restarted server is ready (while the held requests are being released): every client gets an end
    (no client waits on its read timeout), the front door holds nothing afterwards, and the next
    server answers a new stream in full. A stream still in llama-server's queue at a kill (its headers
    sent, no event yet) is sent again and continued by the next server's stream."""
    run = front({"server": {"parallel": 4, "ctx_size": 2048}, "recovery": {"max_restarts": 10},
                 "front": {"hold_timeout_s": 120.0}}).start()
    run.wait_event("server_ready", 60)
    with ThreadPoolExecutor(64) as pool:
        streams = [pool.submit(_sse_stream, run.front, 12) for _ in range(64)]
        wait_for(lambda: metric(run, "llama_guard_front_requests_in_flight") >= 4, 30, "streams in flight")
        for kill in range(3):
            pid = run.wait_event("server_ready", 90, skip=kill)["server_pid"]
            os.kill(pid, signal.SIGKILL)
            if kill == 1:
                continue  # the third kill follows the next ready at once
            time.sleep(1.0)
        results = [f.result() for f in streams]  # an httpx.ReadTimeout here is a wedged request
    assert all(end in ("done", "error") if status == 200 else (status, end) == (502, "json")
               for status, end in results), results
    run.wait_event("server_ready", 90, skip=3)
    wait_for(lambda: metric(run, "llama_guard_front_requests_waiting") == 0
             and metric(run, "llama_guard_front_requests_in_flight") == 0, 30, "nothing held or in flight")
    assert _sse_stream(run.front, 4) == (200, "done")
    # Each client that did not get its whole stream is counted once, by its reason: a 502 before the
    # stream began (failed twice unanswered), an error event in it (cut after its first event, or failed
    # twice before it: a stream's headers go out before its first event).
    assert metric(run, "llama_guard_front_requests_failed_total") == sum(end != "done" for _, end in results)
    assert metric(run, "llama_guard_front_requests_replayed_total") >= 1  # the streams queued at a kill (4 slots)
    assert metric(run, 'llama_guard_front_requests_failed_total{reason="upstream_failed"}') >= \
        sum(status == 502 for status, _ in results)


def _at(event: dict[str, Any]) -> float:
    """An event's wall-clock time, seconds since the epoch."""
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def _tokens_for(run: FrontRun, seconds: float, cap: int) -> int:
    """How many tokens the real server generates in about ``seconds`` on this host (measured now over
    64 tokens, at most ``cap``): the test's long request lasts about that long whatever the host's
    speed. A shared host's speed can change by 2-3x within a test: callers ask for a margin of that."""
    timings = completion(run.front, 64).json()["timings"]
    return max(16, min(cap, int(timings["predicted_per_second"] * seconds)))


def test_planned_restart_whose_drain_outlasts_hold_timeout_fails_no_request(front: Any) -> None:
    """The shipped promise at a small scale: a drain longer than ``hold_timeout_s`` (a long generation),
    new requests arriving during it: every one is 200, held until the next server is ready, and the
    events say what the clients saw. The generation is made to outlast ``hold_timeout_s`` whatever the
    host's speed: the test stops the server (SIGSTOP) for longer than that in the middle of it (liveness
    is slowed so that the pause is no hang)."""
    hold_s = 12.0  # covers the next server's stop and load (up to 5 s seen on a loaded 2-core host)
    run = front({"front": {"hold_timeout_s": hold_s}, "server": {"parallel": 1, "ctx_size": 8192},
                 "schedule": {"drain_timeout_s": 240.0}, "health": {"hang_strikes": 40}}).start()
    first = run.wait_event("server_ready", 60)["server_pid"]
    n_long = _tokens_for(run, 5.0, 4000)  # still generating at the pause even if the host speeds up 4x
    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(completion, run.front, n_long, 240.0, "Tell a long story:")
        wait_for(lambda: metric(run, "llama_guard_front_requests_in_flight") >= 1, 30, "the long request in flight")
        run.signal(signal.SIGUSR1)  # llama-guard restart: drained
        run.wait_event("restart_requested", 10)
        os.kill(first, signal.SIGSTOP)
        paused = time.monotonic()
        in_flight_then = not long.done()
        new = [pool.submit(completion, run.front, 2) for _ in range(3)]
        wait_for(lambda: metric(run, "llama_guard_front_requests_waiting") >= 3, 30, "3 new requests held")
        time.sleep(max(0.0, paused + hold_s + 1.0 - time.monotonic()))
        os.kill(first, signal.SIGCONT)
        results = [f.result() for f in [long, *new]]
    assert in_flight_then, "the generation ended before the pause: lengthen it"
    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    assert results[0].json()["tokens_predicted"] == n_long
    requested, stopped = run.wait_event("restart_requested"), run.wait_event("server_stopped")
    drain_s = _at(stopped) - _at(requested)
    assert stopped["server_pid"] == first and drain_s > hold_s, drain_s  # the drain did outlast hold_timeout_s
    assert "drain_timeout" not in run.names()
    held = run.wait_event("front_held", 10)
    assert (held["held"], held["forwarded"], held["failed"], held["gone"], held["refused"]) == (3, 3, 0, 0, 0)
    assert held["longest_s"] > hold_s and "draining" in held["phase"]
    done = run.wait_event("planned_restart_done", 10)
    assert done["unavailable_s"] >= drain_s - 0.5  # what the clients saw: held from the drain's start
    assert metric(run, "llama_guard_front_requests_failed_total") == 0


def test_sigterm_during_a_generation_lets_it_finish_refuses_new_requests_and_exits_0(front: Any) -> None:
    # The generation is kept going across the stop whatever the host's speed: the test stops the server
    # (SIGSTOP) around the stop and the refused request, and lets it go on after (SIGCONT).
    run = front().start()
    server = run.wait_event("server_ready", 60)["server_pid"]
    n_long = _tokens_for(run, 4.0, 1800)  # still generating at the pause even if the host speeds up 4x
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(completion, run.front, n_long, 240.0, "Tell a long story:")
        wait_for(lambda: metric(run, "llama_guard_front_requests_in_flight") >= 1, 30, "the long request in flight")
        os.kill(server, signal.SIGSTOP)
        in_flight_then = not long.done()
        run.signal(signal.SIGTERM)
        run.wait_event("daemon_stopping", 10)
        refused = completion(run.front, 2, timeout=30.0)
        # At once: refused while the stop's drain still waits for the generation (its server is stopped: the
        # generation cannot end, and a drain that gave up would have cut it — it completes in full below).
        drain_on = not long.done()
        os.kill(server, signal.SIGCONT)
        answer = long.result()
    assert in_flight_then, "the generation ended before the pause: lengthen it"
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "5" and drain_on
    assert answer.status_code == 200 and answer.json()["tokens_predicted"] == n_long
    assert run.wait_exit(60) == 0
    names = run.names()
    assert "stop_drain_timeout" not in names and "server_stop_timeout" not in names
    assert names.index("daemon_stopping") < names.index("server_stopped")


def test_the_exit_drain_outlasting_drain_timeout_s_still_ends_when_the_requests_do(front: Any, tmp_path: Path) -> None:
    """The exit drain has one deadline, the policy's ([front].stop_drain_s): the drain's own wait no longer
    gives up silently at [schedule].drain_timeout_s. Before, a request that ended after drain_timeout_s (well
    within stop_drain_s) left the drain waiting out stop_drain_s and ending in stop_drain_timeout. The double
    holds its stream after the first event until the gate file exists, so the request stays in flight across
    drain_timeout_s whatever the host's speed (the real server, under a loaded host, answered no request)."""
    fake_model, gate = tmp_path / "fake.gguf", tmp_path / "gate"
    fake_model.write_bytes(b"GGUF" + bytes(28))
    run = front({"schedule": {"drain_timeout_s": 1.0}, "front": {"stop_drain_s": 60.0},
                 "health": {"hang_strikes": 30},
                 "server": {"env": {"FAKE_LLAMA_STREAM_GATE": str(gate), "FAKE_LLAMA_EVENT_S": "0"}}},
                binary=str(FAKE_SERVER), model=str(fake_model)).start()
    run.wait_event("server_ready", 30)
    body = {"prompt": "Hi", "n_predict": 3, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{run.front}/completion", json=body, timeout=120.0) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        assert next(chunks).startswith(b"data: ")  # in flight, held at the gate
        run.signal(signal.SIGTERM)
        stopping = _at(run.wait_event("daemon_stopping", 10))
        # A liveness round (each is an event) more than drain_timeout_s after the drain began: the old
        # drain wait had given up by then.
        run.wait_event("server_probe", 30, where=lambda e: _at(e) > stopping + 2.0)
        gate.touch()
        rest = b"".join(chunks)
    assert rest.count(b"data: ") == 3 and b'"stop": true' in rest
    assert run.wait_exit(120) == 0
    names = run.names()
    assert "stop_drain_timeout" not in names and "server_hang" not in names
    assert names.index("daemon_stopping") < names.index("server_stopped")
