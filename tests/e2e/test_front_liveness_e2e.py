"""End to end: traffic through the front door that does no inference never counts as liveness progress.

The test double's ``completion_hang`` mode stands for a server whose decode is wedged while its HTTP
loop still answers ``/health`` and ``/slots`` (a CPU build cannot be made to wedge on demand). A client
polls those through the front door every second, as a load balancer or an uptime check does; the hang
must still be judged on time.
"""

from __future__ import annotations

import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import RunPool, free_port

pytestmark = [pytest.mark.timeout(120)]

HEALTH = {"interval_s": 1.0, "timeout_s": 2.0, "canary_timeout_s": 2.0, "hang_strikes": 3}


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def test_a_health_poller_through_the_front_door_does_not_hide_a_hung_decode(
        tmp_path: Path, fake_server: Path, real_model: Path) -> None:
    pool = RunPool()
    port = free_port()
    run = pool.new(tmp_path, str(fake_server), str(real_model), {
        "server": {"env": {"FAKE_LLAMA_FAULT": "completion_hang"}},
        "front": {"listen": f"127.0.0.1:{port}", "hold_timeout_s": 30.0},
        "health": HEALTH, "recovery": {"stop_grace_s": 1.0}})
    stop = threading.Event()
    polls: list[tuple[str, int]] = []  # (path, status)

    def poll() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as client:
            while not stop.wait(1.0):
                for path in ("/health", "/slots"):
                    try:
                        polls.append((path, client.get(path).status_code))
                    except httpx.HTTPError:
                        polls.append((path, 0))

    poller = threading.Thread(target=poll, daemon=True)
    try:
        run.start()
        ready = run.wait_event("server_ready", 30)
        poller.start()
        with pytest.raises(httpx.ReadTimeout):  # the decode wedges; the server holds the slot
            httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "Hi", "n_predict": 4}, timeout=3.0)
        hang = run.wait_event("server_hang", 60)
        answered = sum(status == 200 for _, status in polls)
    finally:
        stop.set()
        poller.join(10)
        assert not pool.finish()
    assert hang["server_pid"] == ready["server_pid"]
    # At the rounds' pace (interval 1 s, 3 strikes, probes bounded by 2 s), well within 30 s of ready.
    assert stamp(hang) - stamp(ready) <= 30.0, stamp(hang) - stamp(ready)
    assert answered >= 4, polls  # the poller really was answered 200 all along the hang
