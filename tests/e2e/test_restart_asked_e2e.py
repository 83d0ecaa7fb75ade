"""End to end: ``llama-guard restart`` (SIGUSR1) while llama-server is still starting — loading, or restoring
its slots (the report's case: a slot restore that hung) — is carried out once the server is ready, never
logged and dropped. Before: ``restart_requested`` said "ignored: the server is still loading" and the server
then served on, never restarted. The test double's load waits on a file (``$FAKE_LLAMA_LOAD_GATE``), so the
request lands in the start for certain, whatever the host's speed."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from harness import RunPool

pytestmark = [pytest.mark.timeout(120)]


def test_restart_asked_while_the_server_starts_happens_once_it_is_ready(
        tmp_path: Path, fake_server: Path, real_model: Path) -> None:
    gate = tmp_path / "loaded"
    pool = RunPool()
    run = pool.new(tmp_path, str(fake_server), str(real_model), {
        "server": {"env": {"FAKE_LLAMA_LOAD_GATE": str(gate)}}, "health": {"canary": False}})
    try:
        run.start()
        first = run.wait_event("server_starting", 30)["server_pid"]
        run.signal(signal.SIGUSR1)
        asked = run.wait_event("restart_requested", 30)
        assert "deferred" in asked and "ready" in asked["deferred"], asked
        assert "server_ready" not in run.names()
        gate.touch()  # the load (or the restore) ends
        assert run.wait_event("server_ready", 30)["server_pid"] == first
        stopped = run.wait_event("server_stopped", 30)
        second = run.wait_event("server_ready", 30, skip=1)
        assert stopped["server_pid"] == first and second["server_pid"] != first
        names = run.names()
        assert "server_exited" not in names and "server_backoff" not in names, names  # planned, not a failure
    finally:
        leftovers = pool.finish()
    assert leftovers == [], f"server pids {leftovers} outlived their daemon"
