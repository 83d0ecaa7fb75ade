"""More hostile users and environments at the front door (before the REAL llama-server).

A reload that would move llama-server onto the daemon's own listening port, a stop with many
requests held, a body that never ends: each gets a clear answer, and the daemon keeps serving.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
from front_fixtures import metric, served, wait_metric
from harness import free_port
from llama_guard.front.source import CLOSE_TIMEOUT_S

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

BODY = b'{"prompt":"Hi","n_predict":1}'
REQUEST = b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)


def raw(port: int, data: bytes, *, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    if data:
        sock.sendall(data)
    return sock


def test_reload_that_moves_llama_server_onto_the_front_port_is_refused(door: Any) -> None:
    """Turning the front door off by reload and giving llama-server the clients' port: the front
    door keeps its listener until a daemon restart, so the server could never bind it — refused,
    the running server keeps serving."""
    run = door()
    text = re.sub(r'listen = "127\.0\.0\.1:\d+"', 'listen = ""', run.config.read_text())
    run.config.write_text(re.sub(r"^port = \d+", f"port = {run.front}", text, flags=re.M))
    run.signal(signal.SIGHUP)
    error = run.wait_event("config_error", 30)
    assert str(run.front) in error["reason"], error
    assert served(run.front)
    names = run.names()
    assert "config_reloaded" not in names and "restart_requested" not in names, names
    assert run.proc.poll() is None


def test_sigterm_with_held_requests_and_idle_connections_answers_503_and_exits_at_once(door: Any) -> None:
    """SIGTERM during a drain, 20 requests held and 5 keep-alive connections idle: every held
    request gets its 503 at once; the stop drains the stream in flight until its client leaves, and
    once the server is gone the daemon exits well within the front door's close timeout — an idle
    connection must not hold up the exit."""
    metrics = free_port()
    run = door(extra={"schedule": {"drain_timeout_s": 120.0}, "server": {"ctx_size": 8192},
                      "metrics": {"listen": f"127.0.0.1:{metrics}"}})
    client, resp, _chunks = long_stream(run.front, 8000)  # keeps the drain going
    run.signal(signal.SIGUSR1)
    run.wait_event("restart_requested", 10)
    held = [raw(run.front, REQUEST) for _ in range(20)]
    idle = [raw(run.front, b"") for _ in range(5)]
    wait_metric(metrics, "llama_guard_front_requests_waiting", 20)  # all 20 are held
    wait_metric(metrics, "llama_guard_front_connections", 26)  # and the idle ones are open (+ the stream's)
    run.signal(signal.SIGTERM)
    # At once: the 503s come while the stop's drain still waits for the stream (its client leaves only below).
    heads = [sock.recv(12) for sock in held]
    assert heads == [b"HTTP/1.1 503"] * 20, heads
    resp.close()  # the stream's client leaves: nothing is in flight, the stop's drain ends
    client.close()
    assert run.wait_exit(30) == 0
    exited = time.time()
    for sock in held + idle:
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass
        sock.close()
    last = datetime.fromisoformat(run.wait_event("daemon_exit", 5)["timestamp"]).timestamp()
    assert exited - last < CLOSE_TIMEOUT_S - 1.0, exited - last


def test_a_body_that_never_ends_gets_413_and_a_close_soon(door: Any) -> None:
    """A chunked body sent as fast as the network allows, never ending: 413 once it passes
    max_body_bytes, then the connection is closed within seconds — the front door does not go on
    reading and dropping the client's bytes (aiohttp lingers 10 s by default) — and others are served."""
    run = door()
    sock = raw(run.front, b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"400\r\n" + b"a" * 1024 + b"\r\n"
    begin = time.monotonic()
    sent = 0
    with contextlib.suppress(OSError):
        while time.monotonic() - begin < 30:
            sock.sendall(chunk)
            sent += len(chunk)
    closed_s = time.monotonic() - begin
    answer = b""
    with contextlib.suppress(OSError):
        while part := sock.recv(65536):
            answer += part
    sock.close()
    assert closed_s < 6.0, (closed_s, sent)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:80]
    assert served(run.front)


def test_an_absolute_form_request_target_goes_to_llama_server_and_nowhere_else(door: Any) -> None:
    """``POST http://host/completion`` (the absolute form a client configured with a proxy sends,
    which a server must accept, RFC 9112 section 3.2.2) is answered by llama-server — not a 500 from
    the front door — and the host it names is never contacted; a target that would read as a user
    name in front of another host (``@host/``) is refused by the parser; ``OPTIONS *`` gets a 400."""
    run = door()
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    other.settimeout(1.0)
    elsewhere = f"127.0.0.1:{other.getsockname()[1]}"
    for target in (f"http://{elsewhere}/completion", f"@{elsewhere}/completion"):
        sock = raw(run.front, f"POST {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                              f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
        answer = b""
        with contextlib.suppress(OSError):
            while part := sock.recv(65536):
                answer += part
        sock.close()
        expected = b"HTTP/1.1 200" if target.startswith("http") else b"HTTP/1.0 400"
        assert answer.startswith(expected), (target, answer[:200])
        if expected == b"HTTP/1.1 200":
            assert b'"tokens_predicted":1' in answer, answer[-300:]
        with pytest.raises(TimeoutError):
            other.accept()
    other.close()
    sock = raw(run.front, b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 400") and b"request target" in answer, answer
    assert served(run.front)


def long_stream(port: int, n_predict: int) -> tuple[httpx.Client, Any, Iterator[bytes]]:
    """A streaming completion that does not stop at end-of-text; returns its client, response and
    chunk iterator (the first body chunk already came; dropping the iterator closes the response)."""
    client = httpx.Client(timeout=120)
    resp = client.send(client.build_request("POST", f"http://127.0.0.1:{port}/completion", json={
        "prompt": "Once upon a time", "n_predict": n_predict, "ignore_eos": True, "stream": True}), stream=True)
    assert resp.status_code == 200
    chunks = resp.iter_raw()
    next(chunks)
    return client, resp, chunks


def test_clients_that_leave_while_held_give_their_place_back(door: Any) -> None:
    """max_held = 2: two requests held during a drain leave; two later ones are held and answered,
    not refused as if the queue were still full. Each client that left is counted once, as gone, in
    the ``front_held`` event and in ``llama_guard_front_requests_total`` — the stream's client that
    left to end the drain too."""
    metrics = free_port()
    run = door({"max_held": 2}, {"schedule": {"drain_timeout_s": 120.0}, "server": {"ctx_size": 8192},
                                 "metrics": {"listen": f"127.0.0.1:{metrics}"}})
    client, resp, _chunks = long_stream(run.front, 8000)
    run.signal(signal.SIGUSR1)
    run.wait_event("restart_requested", 10)
    left = [raw(run.front, REQUEST) for _ in range(2)]
    wait_metric(metrics, "llama_guard_front_requests_waiting", 2)  # both held: the queue is full
    for sock in left:
        sock.close()
    wait_metric(metrics, "llama_guard_front_requests_waiting", 0)  # they left: their places are free
    later = [raw(run.front, REQUEST) for _ in range(2)]
    resp.close()
    client.close()  # the drain ends, the restart runs, the held ones go
    for sock in later:
        assert sock.recv(12) == b"HTTP/1.1 200"
        sock.close()
    held = run.wait_event("front_held", 30)
    assert (held["held"], held["forwarded"], held["gone"]) == (4, 2, 2), held
    assert metric(metrics, 'llama_guard_front_requests_total{code="gone"}') == 3
    assert metric(metrics, 'llama_guard_front_requests_total{code="200"}') == 2


def test_a_client_that_leaves_mid_stream_frees_the_llama_server_slot(door: Any) -> None:
    """The client closes after the first token of a long stream: llama-server's slot stops
    processing within seconds (its connection from the front door was closed), and the next client
    is answered at once rather than after the abandoned generation."""
    run = door(extra={"server": {"ctx_size": 8192}})
    client, resp, _chunks = long_stream(run.front, 8000)  # a minute or more of decoding
    resp.close()
    client.close()
    deadline = time.monotonic() + 10.0
    while True:
        slots = httpx.get(f"http://127.0.0.1:{run.front}/slots", timeout=10).json()
        if not any(slot["is_processing"] for slot in slots):
            break
        assert time.monotonic() < deadline, slots
        time.sleep(0.2)
    assert served(run.front)


@pytest.mark.parametrize("line", ['listen = "localhost"', 'listen = ":"', 'listen = "1.2.3.4:99999"',
                                  "hold_timeout_s = 0", "hold_timeout_s = -5.0", "max_held = 0"])
def test_a_reload_with_a_bad_front_value_is_refused_and_changes_nothing(door: Any, line: str) -> None:
    run = door()
    key = line.split(" =")[0]
    text = run.config.read_text()
    text = re.sub(rf"^{key} = .*$", line, text, flags=re.M) if f"\n{key} = " in text else \
        text.replace("[front]\n", f"[front]\n{line}\n")
    run.config.write_text(text)
    run.signal(signal.SIGHUP)
    error = run.wait_event("config_error", 30)
    assert f"front.{key}" in error["reason"] and "keeping the running configuration" in error["reason"], error
    assert served(run.front)
    assert "config_reloaded" not in run.names() and run.proc.poll() is None
