"""End to end: a wedged llama-server (``/health`` 200, idle slots, every completion HTTP 500 "compute
error", SIGTERM ignored — a reported router-child failure), with clients sending through the front door.

Before: only the liveness rounds judged it (``hang_strikes`` rounds of a failing canary, 15 s at the
shipped defaults) and its stop waited the whole ``stop_grace_s`` (15 s) for a SIGTERM it ignores: the
replacement came 29 s after the first 500, and the clients got every 500 meanwhile (28 in the report).
Now a run of ``[front].hold_after_errors`` 5xx answers with no success between makes the front door hold
new requests while one liveness round confirms at once; a canary that fails too is the verdict, and the
server judged broken is stopped with the short grace of a hung one. The held requests go to the next server.

The test double stands for the wedge (``wedged`` with ``$FAKE_LLAMA_WEDGED_ONCE``: only the first server
is wedged, its replacement answers). Shipped ``[health]`` and ``stop_grace_s``: the figures are those of an
operator's daemon.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import RunPool, free_port
from llama_guard.config.listen import FrontConfig
from llama_guard.config.sections import HealthConfig, RecoveryConfig

pytestmark = [pytest.mark.timeout(180)]

SHIPPED_HEALTH: dict[str, object] = {name: getattr(HealthConfig(), name) for name in (
    "interval_s", "timeout_s", "canary_timeout_s", "hang_strikes", "silent_limit_s")}
RUN = FrontConfig().hold_after_errors  # the shipped run of 5xx after which the front door holds

# What each client sends: a raw completion, a chat completion, a streamed completion (a kind of
# request the report did not name).
BODIES: tuple[tuple[str, dict[str, object]], ...] = (
    ("/completion", {"prompt": "Hello", "n_predict": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    ("/completion", {"prompt": "Tell me", "n_predict": 4, "stream": True}),
)


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


class Clients:
    """One thread per entry of BODIES, each sending its request again as soon as it has its answer
    (paced ``pause_s`` apart, as an SDK's user would send), recording ``(time.time(), status)``."""

    def __init__(self, port: int, pause_s: float = 0.3) -> None:
        self.answers: list[tuple[float, int, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(port, path, body, pause_s), daemon=True)
                         for path, body in BODIES]

    def _loop(self, port: int, path: str, body: dict[str, object], pause_s: float) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120.0) as client:
            while not self._stop.is_set():
                try:
                    status = client.post(path, json=body).status_code
                except httpx.HTTPError:
                    status = 0
                with self._lock:
                    self.answers.append((time.time(), status, path))
                self._stop.wait(pause_s)

    def start(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)

    def seen(self) -> list[tuple[float, int, str]]:
        with self._lock:
            return list(self.answers)


@pytest.fixture
def wedged(tmp_path: Path, fake_server: Path, real_model: Path) -> Iterator[Any]:
    pool = RunPool()
    front = free_port()
    run: Any = pool.new(tmp_path, str(fake_server), str(real_model), {
        "server": {"env": {"FAKE_LLAMA_FAULT": "wedged", "FAKE_LLAMA_WEDGED_ONCE": str(tmp_path / "wedged")}},
        "front": {"listen": f"127.0.0.1:{front}"},
        "health": SHIPPED_HEALTH,
        "recovery": {"stop_grace_s": RecoveryConfig().stop_grace_s}})
    run.front = front
    run.start()
    try:
        yield run
    finally:
        leftovers = pool.finish()
    if leftovers:
        pytest.fail(f"server pids {leftovers} outlived their daemon")


def test_wedged_server_is_replaced_and_clients_see_few_500s(wedged: Any) -> None:
    first = wedged.wait_event("server_ready", 30)
    clients = Clients(wedged.front).start()
    try:
        second = wedged.wait_event("server_ready", 120, skip=1)
        # Every client gets answers from the replacement (held requests were replayed to it).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            after = [a for a in clients.seen() if a[0] > stamp(second)]
            if {path for _, status, path in after if status == 200} >= {p for p, _ in BODIES} and len(after) >= 6:
                break
            time.sleep(0.1)
    finally:
        clients.stop()
    answers = clients.seen()
    errors = [a for a in answers if a[1] >= 500]
    replaced_s = stamp(second) - errors[0][0] if errors else None
    print(f"wedged server: {len(errors)} x 5xx seen by the clients; first 500 -> replacement ready: {replaced_s} s; "
          f"{len(answers)} answers in all")
    assert second["server_pid"] != first["server_pid"]
    verdict = wedged.wait_event("server_completion_error")
    assert verdict["server_pid"] == first["server_pid"] and verdict["status_code"] == 500
    # The server ignored SIGTERM: it was killed after the short grace of a server judged broken.
    killed = wedged.wait_event("server_stop_timeout")
    assert killed["server_pid"] == first["server_pid"] and killed["grace_s"] < RecoveryConfig().stop_grace_s
    # At most the run, plus one per other client whose request was in flight when the run was complete.
    assert 1 <= len(errors) <= RUN + len(BODIES) - 1, errors
    assert all(status == 500 for _, status, _ in errors), errors
    # Nothing but 200 from the replacement; no client was refused by the front door itself.
    assert all(status == 200 for when, status, _ in answers if when > stamp(second)), answers
    assert all(status in (200, 500) for _, status, _ in answers), answers
    held = wedged.wait_event("front_held", where=lambda e: "confirming" in e["phase"])
    assert held["failed"] == 0 and held["forwarded"] + held["replayed"] >= 1, held
