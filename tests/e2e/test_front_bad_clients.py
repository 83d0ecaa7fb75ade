"""Bad clients at the front door (before the REAL llama-server): each gets a clear 4xx or a closed
connection, and nobody else notices — other clients are served, the daemon keeps supervising (its
liveness rounds go on, a kill -9 is still handled), its memory stays bounded.

Garbage, an oversized body, a body or a request head trickled a byte at a time, bodies that would
pass the memory budget, 10,000 idle connections.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import time
from typing import Any

import httpx
import psutil
import pytest
from front_fixtures import read_all, served

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


def raw(port: int, data: bytes, *, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    if data:
        sock.sendall(data)
    return sock


def test_garbage_gets_400_and_a_close(door: Any) -> None:
    run = door()
    for junk in (b"\x00\xff\xfe GARBAGE \r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                 b"POST /completion HTTP/1.1\r\nContent-Length: nope\r\n\r\n", b"A" * 20000 + b"\r\n\r\n"):
        answer = read_all(raw(run.front, junk))
        assert answer[:12] in (b"HTTP/1.1 400", b"HTTP/1.0 400"), (junk[:30], answer[:80])
    assert served(run.front)


def test_an_oversized_body_gets_413_before_it_is_sent(door: Any) -> None:
    run = door()
    head = b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
    sock = raw(run.front, head)
    sock.settimeout(10)
    answer = sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413") and b"max_body_bytes" in answer
    big = httpx.post(f"http://127.0.0.1:{run.front}/completion", timeout=30,  # chunked: no Content-Length
                     content=iter([b"x" * 40000, b"y" * 40000]))
    assert big.status_code == 413
    assert served(run.front)


def test_a_body_trickled_a_byte_a_second_gets_408_and_others_are_served(door: Any) -> None:
    run = door()
    sock = raw(run.front, b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    start = time.monotonic()
    answer = b""
    sock.settimeout(0.2)
    while time.monotonic() - start < 10 and not answer:
        with contextlib.suppress(OSError):
            sock.send(b" ")
        with contextlib.suppress(TimeoutError, OSError):
            answer = sock.recv(65536)
        time.sleep(0.8)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]  # within the 10 s of trickling: a byte never renews it
    assert time.monotonic() - start > 1.5  # and not before body_timeout_s
    assert served(run.front)


def test_a_request_head_trickled_a_byte_a_second_is_closed(door: Any) -> None:
    run = door()
    sock = raw(run.front, b"POST /completion HTTP/1.1\r\n")
    start = time.monotonic()
    closed = False
    sock.settimeout(0.2)
    while time.monotonic() - start < 10 and not closed:
        try:
            sock.send(b"X")
            closed = sock.recv(65536) == b""
        except TimeoutError:
            pass
        except OSError:
            closed = True
        time.sleep(0.8)
    sock.close()
    assert closed  # within the 10 s of trickling: a byte never renews header_timeout_s
    assert time.monotonic() - start > 1.5  # and not before it
    assert served(run.front)


def test_bodies_past_the_memory_budget_get_503(door: Any) -> None:
    run = door()
    head = b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n"
    first = raw(run.front, head + b"{" + b" " * 58999)  # 59 kB of the 100 kB budget held; the rest never comes
    deadline = time.monotonic() + 30
    second = b""
    while time.monotonic() < deadline and not second.startswith(b"HTTP/1.1 503"):
        second = read_all(raw(run.front, head + b" " * 60000))  # passes the budget once the first is held
    assert second.startswith(b"HTTP/1.1 503") and b"Retry-After: 5" in second and b"max_buffered_bytes" in second
    first.close()
    assert served(run.front)


def test_10000_idle_connections_hurt_nobody(door: Any) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 10_500:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} < 10500: this test needs 10,000 connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 20_000) if hard != resource.RLIM_INFINITY else 20_000,
                                                hard))
    try:
        run = door({"header_timeout_s": 600.0})  # the daemon inherits the raised limit
        daemon = psutil.Process(run.pid)
        rss_before = daemon.memory_info().rss
        probes_before = len([e for e in run.events() if e["event"] == "server_probe"])
        idle = []
        for _ in range(10_000):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", run.front))
            idle.append(sock)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and daemon.num_fds() < 10_000:
                time.sleep(0.2)
            assert daemon.num_fds() >= 10_000  # the daemon holds them all
            assert served(run.front)
            assert httpx.get(f"http://127.0.0.1:{run.front}/readyz", timeout=10).status_code == 200
            os.kill(run.first, signal.SIGKILL)  # supervision goes on: the crash is seen and undone
            run.wait_event("server_ready", 60, skip=1)
            assert served(run.front)
            time.sleep(2.5)
            probes = len([e for e in run.events() if e["event"] == "server_probe"])
            assert probes > probes_before  # the liveness rounds kept running
            growth_mib = (daemon.memory_info().rss - rss_before) / 2**20
            assert growth_mib < 200, f"the daemon grew by {growth_mib:.0f} MiB for 10,000 idle connections"
        finally:
            for sock in idle:
                sock.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_expect_100_continue_is_answered_before_the_body(door: Any) -> None:
    run = door()
    body = b'{"prompt": "Hi", "n_predict": 1}'
    sock = raw(run.front, b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
    sock.settimeout(10)
    assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue")
    sock.sendall(body)
    sock.settimeout(120)
    answer = sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200")
