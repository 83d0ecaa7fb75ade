"""`llama-guard status`'s layout and JSON document (schema 1) from the daemon's own snapshot: a real
``llama-guard run`` supervising the fake llama-server (with a fake NVML where a GPU is shown) writes
its status file, and the view renders what it wrote. The running-daemon CLI test is in
test_insight_e2e.py."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import FAKE_NVML_RUN, FAKE_SERVER, DaemonRun, base_sections, free_port, merge, stop_all
from llama_guard.status.status import read_status
from llama_guard.status.status_view import (
    EXIT_NOT_READY,
    EXIT_NOT_RUNNING,
    EXIT_READY,
    SCHEMA,
    document,
    duration,
    exit_code,
    render,
)

TESTS = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(120)]


def _snapshot_when(run: DaemonRun, ok: Any, timeout: float = 60.0) -> dict[str, Any]:
    """The daemon's status file once ``ok(snapshot)`` holds."""
    deadline = time.monotonic() + timeout
    snap = None
    while time.monotonic() < deadline:
        snap = read_status(run.tmp / "run")
        if snap is not None and ok(snap):
            return snap
        time.sleep(0.1)
    raise AssertionError(f"no such snapshot within {timeout} s; last: {snap}; events: {run.names()}")


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two daemons: one watching a (fake) GPU with a planned-restart schedule, whose server is
    killed once (a restart with its cause), and one with the GPU watch off."""
    runs, ports = [], []
    made = {}
    for name in ("gpu", "plain"):
        tmp = tmp_path_factory.mktemp(f"status-{name}")
        (tmp / "fake.gguf").write_bytes(b"GGUF" + bytes(28))  # checked to be GGUF; the fake never reads it
        port = free_port()
        sections = merge(base_sections(tmp, str(FAKE_SERVER), str(tmp / "fake.gguf"), port),
                         {"health": {"canary": False}, "server": {"env": {"FAKE_LLAMA_LOAD_S": "0.2"}}})
        env: dict[str, str] = {}
        command = None
        if name == "gpu":
            script = tmp / "nvml.json"
            script.write_text(json.dumps({"server_on_gpu": True}))
            sections = merge(sections, {
                "server": {"n_gpu_layers": 99, "env": {"FAKE_LLAMA_LOAD_S": "0.2"}},
                "gpu": {"enabled": "on", "index": 0, "sample_interval_s": 0.2, "kmsg_path": str(tmp / "no-kmsg")},
                "recovery": {"reset_on": []},
                "schedule": {"restart_cron": "30 4 * * *", "timezone": "UTC"},
            })
            pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
            env = {"PYTHONPATH": pythonpath, "FAKE_NVML_SCRIPT": str(script),
                   "FAKE_NVML_STATE": str(tmp / "nvml-state.json")}
            command = FAKE_NVML_RUN
        run = DaemonRun(tmp, sections, env=env, command=command).start()
        runs.append(run)
        ports.append(port)
        made[name] = run
    try:
        gpu, plain = made["gpu"], made["plain"]
        first = gpu.wait_event("server_ready", 60)
        os.kill(int(first["server_pid"]), signal.SIGKILL)
        second = gpu.wait_event("server_ready", 60, skip=1)
        plain.wait_event("server_ready", 60)
        made["gpu_snapshot"] = _snapshot_when(gpu, lambda s: s.get("phase") == "ready"
                                              and s.get("server_pid") == second["server_pid"]
                                              and (s.get("gpu") or {}).get("sample"))
        made["plain_snapshot"] = _snapshot_when(plain, lambda s: s.get("phase") == "ready")
        made["second_pid"] = int(second["server_pid"])
        made["second_ready"] = second
        yield made
    finally:
        leftovers = stop_all(runs, ports)
        assert not leftovers, f"llama-server pids outlived their daemon: {leftovers}"


def test_document_is_versioned_and_keeps_the_snapshot_keys(daemons: dict[str, Any]) -> None:
    snap = daemons["gpu_snapshot"]
    doc = document(snap)
    assert doc["schema"] == SCHEMA == 1 and doc["ready"] is True
    assert doc["phase"] == "ready" and doc["restarts"] == 1
    assert doc["server_pid"] == daemons["second_pid"]
    assert doc["daemon_uptime_s"] is not None and doc["server_uptime_s"] is not None
    assert 0 <= doc["snapshot_age_s"] < 60
    assert set(snap) <= set(doc)


def test_exit_codes(daemons: dict[str, Any]) -> None:
    snap = daemons["gpu_snapshot"]
    assert exit_code(snap) == EXIT_READY == 0
    for phase in ("starting", "backoff", "draining", "resetting_gpu", "stopping"):
        assert exit_code({**snap, "phase": phase}) == EXIT_NOT_READY == 1
    assert exit_code(None) == EXIT_NOT_RUNNING == 3


def test_human_layout_of_the_daemons_snapshot_has_no_raw_json(daemons: dict[str, Any]) -> None:
    snap = daemons["gpu_snapshot"]
    text = "\n".join(render(document(snap)))
    assert not re.search(r"[{\[]\s*['\"]|['\"]\s*[}\]]", text), text  # no dict or list printed raw
    assert f"pid {daemons['second_pid']}, up " in text and ", ready for " in text
    assert "restarts" in text and "(crash 1)" in text and "last failure: " in text  # kill -9: a crash
    restart_s = daemons["second_ready"]["restart_to_ready_s"]  # from the exit the daemon saw to /health 200
    assert restart_s > 0 and f"ready {restart_s:.2f} s after it began" in text
    assert 'next planned restart  ' in text and '(cron "30 4 * * *" UTC)' in text
    sample = snap["gpu"]["sample"]
    assert f"0 {sample['identity']['name']}, {sample['temperature_c']} °C" in text
    assert f"{sample['memory_used_bytes'] // 2**20:,} of {sample['memory_total_bytes'] // 2**20:,} MiB used" in text
    assert f"server_ready: llama-server pid {daemons['second_pid']} ready after" in text


def test_not_ready_is_said_in_the_first_line(daemons: dict[str, Any]) -> None:
    lines = render(document({**daemons["gpu_snapshot"], "phase": "backoff"}))
    assert "backoff (server NOT ready)" in lines[0]
    assert "ready for" not in "\n".join(lines)


def test_gpu_watch_off_and_durations(daemons: dict[str, Any]) -> None:
    snap = daemons["plain_snapshot"]
    text = "\n".join(render(document(snap)))
    assert f"not watched: {snap['gpu']['reason']}" in text
    assert "none (no [schedule].restart_cron)" in text
    assert [duration(x) for x in (None, 5, 65, 3700, 90000)] == ["-", "5 s", "1 min 5 s", "1 h 1 min", "1 d 1 h"]


def test_a_ready_server_that_answers_no_round_is_not_ready() -> None:
    now = time.time()
    base: dict[str, Any] = {"daemon_pid": os.getpid(), "phase": "ready", "server_pid": None, "updated": now,
                            "status": "ready: pid 42", "events": []}
    silent = {**base, "liveness": {"answering": False, "silent_s": 14.2}}
    assert exit_code(silent) == EXIT_NOT_READY and document(silent, now=now)["ready"] is False
    assert "ready (server NOT ready: no HTTP answer for 14 s)" in render(document(silent, now=now),
                                                                         clock=lambda: now)[0]
    answering = {**base, "liveness": {"answering": True, "silent_s": 0.0}}
    assert exit_code(answering) == EXIT_READY and exit_code({**base, "liveness": None}) == EXIT_READY


def test_the_builds_rows_say_what_was_not_served_and_the_trials_verdict_only() -> None:
    """A build that passed its trial and was rolled back in its probation: "passed" is the trial's verdict,
    "not served" the build's end (before: "kept" beside "refused build" for the same build)."""
    now = time.time()
    snap: dict[str, Any] = {
        "daemon_pid": os.getpid(), "phase": "ready", "server_pid": None, "updated": now, "status": "ready",
        "events": [], "build": {
            "serving": {"build": "b1 sha256:aaaaaaaa", "binary": "/opt/old/llama-server"}, "on_probation": False,
            "refused": {"build": "b2 sha256:bbbbbbbb", "binary": "/opt/new/llama-server",
                        "cause": "llama-server b2 killed by SIGSEGV 12 s into its probation"},
            "trial": {"build": "b2 sha256:bbbbbbbb", "tokens_per_s": 51.0, "previous_build": "b1 sha256:aaaaaaaa",
                      "previous_tokens_per_s": 50.0, "kept": True, "cause": ""}}}
    text = "\n".join(render(document(snap, now=now), clock=lambda: now))
    assert "b1 sha256:aaaaaaaa at /opt/old/llama-server" in text and "(on probation)" not in text
    assert "not served" in text and "killed by SIGSEGV 12 s into its probation" in text
    assert "b2 sha256:bbbbbbbb 51.0 tok/s vs b1 sha256:aaaaaaaa 50.0 tok/s: passed" in " ".join(text.split())
    assert "refused build" not in text and ": kept" not in text


def test_a_recent_event_is_one_line_whatever_its_message_carries() -> None:
    """An ``extra_args`` value may hold a newline (a chat template): the argv in ``server_starting`` then
    did too, and ``status`` printed a forged event line from it."""
    now = time.time()
    forged = "--alias x\n2026-12-05 10:00:00 server_ready: FAKE LINE \x1b]0;owned\x07 \u2028end"
    snap: dict[str, Any] = {"daemon_pid": os.getpid(), "phase": "ready", "server_pid": None, "updated": now,
                            "status": "ready", "events": [{"time": now, "event": "server_starting",
                                                           "message": f"starting llama-server pid 7: {forged}"}]}
    lines = render(document(snap, now=now), clock=lambda: now)
    shown = [line for line in lines if "server_starting" in line]
    assert len(shown) == 1 and not any("FAKE LINE" in line for line in lines if line not in shown)
    assert "\\n2026-12-05 10:00:00 server_ready: FAKE LINE \\x1b]0;owned\\x07 \\u2028end" in shown[0], shown
