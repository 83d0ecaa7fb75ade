"""The front door's body budget before the REAL llama-server: a client holds only the bytes it has
sent (a declared ``Content-Length`` reserves nothing), slow senders are cut by ``body_timeout_s``
whatever they declare, and the budget bounds real memory — held bodies cost about their size in RSS
and give it back once released."""

from __future__ import annotations

import socket
import time
from typing import Any

import psutil
import pytest
from front_fixtures import metric, read_all, served
from harness import free_port

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

MIB = 1024 * 1024
SHIPPED = {"max_body_bytes": 32 * MIB, "max_buffered_bytes": 512 * MIB}  # the shipped budget


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def declared(port: int, length: int, sent: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % length + sent)
    return sock


def test_16_connections_declaring_32_mib_and_sending_1_byte_do_not_stop_an_honest_post(door: Any) -> None:
    metrics = free_port()
    run = door({**SHIPPED, "body_timeout_s": 8.0}, {"metrics": {"listen": f"127.0.0.1:{metrics}"}})
    squatters = [declared(run.front, 32 * MIB, b"{") for _ in range(16)]
    wait_for(lambda: metric(metrics, "llama_guard_front_connections") >= 16, 30, "16 connections open")
    assert served(run.front)  # 16 x 32 MiB declared = the whole budget: none of it is reserved
    answers = [read_all(sock) for sock in squatters]
    # cut by body_timeout_s (8 s), not by a deadline grown with the 32 MiB each declared
    assert all(a.startswith(b"HTTP/1.1 408") and b"within 8 s ([front].body_timeout_s)" in a for a in answers), \
        answers[0][:120]


def test_held_bodies_cost_their_size_in_rss_and_give_it_back(door: Any) -> None:
    run = door({**SHIPPED, "body_timeout_s": 20.0})
    daemon = psutil.Process(run.pid)
    assert served(run.front)
    baseline = daemon.memory_info().rss
    count, each = 8, 24 * MIB  # 192 MiB held: 24 MiB sent of 32 MiB declared, the rest never comes
    held = [declared(run.front, 32 * MIB, b" " * each) for _ in range(count)]
    wait_for(lambda: daemon.memory_info().rss - baseline >= 0.95 * count * each, 60, "the bodies held")
    with_bodies = daemon.memory_info().rss - baseline
    answers = [read_all(sock) for sock in held]  # 408 at body_timeout_s: the bodies are released
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers)
    assert served(run.front)
    deadline = time.monotonic() + 30
    while daemon.memory_info().rss - baseline > 32 * MIB and time.monotonic() < deadline:
        time.sleep(0.2)
    after = daemon.memory_info().rss - baseline
    print(f"RSS over the baseline: {with_bodies / MIB:.0f} MiB with {count * each / MIB:.0f} MiB of bodies held, "
          f"{after / MIB:.0f} MiB after their release")
    assert with_bodies <= 1.25 * count * each
    assert after <= 32 * MIB
