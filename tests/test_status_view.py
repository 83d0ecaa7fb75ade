"""`llama-guard status`'s layout and JSON document (schema 1) from a snapshot; the running-daemon test
is in test_insight_e2e.py."""

from __future__ import annotations

import os

from llama_guard.output.status_view import (
    EXIT_NOT_READY,
    EXIT_NOT_RUNNING,
    EXIT_READY,
    SCHEMA,
    document,
    duration,
    exit_code,
    render,
)

NOW = 1_800_000_000.0


def snapshot(**over: object) -> dict[str, object]:
    snap: dict[str, object] = {
        "daemon_pid": os.getpid(), "phase": "ready", "server_pid": None, "base_url": "http://127.0.0.1:8080",
        "status": "ready: pid 42, 2 restarts", "restarts": 2, "recent_failures": 1,
        "last_failure": "server_oom: CUDA error: out of memory", "updated": NOW - 3,
        "events": [{"time": NOW - 60, "event": "server_ready", "message": "llama-server pid 42 ready after 1.20 s"}],
        "gpu": {"identity": {"index": 0, "name": "NVIDIA H200"},
                "sample": {"identity": {"index": 0, "name": "NVIDIA H200"}, "temperature_c": 41, "power_mw": 125_500,
                           "power_limit_mw": 700_000, "memory_used_bytes": 796 * 2**20,
                           "memory_total_bytes": 143_771 * 2**20, "clock_event_reasons": 0x1}},
        "planned_restarts": {"cron": "30 4 * * *", "timezone": "UTC", "next_fire": "2027-01-15T04:30:00+00:00",
                             "decay": {"enabled": False}, "history": []},
        "metrics": {"listen": None, "ready_since": NOW - 600, "restarts_by_cause": {"oom": 1, "scheduled": 1},
                    "resets": []},
    }
    snap.update(over)
    return snap


def test_document_is_versioned_and_keeps_the_snapshot_keys() -> None:
    doc = document(snapshot(), now=NOW)
    assert doc["schema"] == SCHEMA == 1 and doc["ready"] is True
    assert doc["snapshot_age_s"] == 3.0 and doc["phase"] == "ready" and doc["restarts"] == 2
    assert doc["daemon_uptime_s"] is not None  # this test process
    assert doc["server_uptime_s"] is None  # no server pid


def test_exit_codes() -> None:
    assert exit_code(snapshot()) == EXIT_READY == 0
    for phase in ("starting", "backoff", "draining", "resetting_gpu", "stopping"):
        assert exit_code(snapshot(phase=phase)) == EXIT_NOT_READY == 1
    assert exit_code(None) == EXIT_NOT_RUNNING == 3


def test_human_layout_has_no_raw_json() -> None:
    lines = render(document(snapshot(), now=NOW), clock=lambda: NOW)
    text = "\n".join(lines)
    assert "{" not in text and "}" not in text and "[" not in text.replace("[limits]", "")
    assert "ready for 10 min 0 s" in text
    assert "restarts" in text and "oom 1, scheduled 1" in text and "last failure: server_oom" in text
    assert "next planned restart  2027-01-15T04:30:00+00:00 (cron \"30 4 * * *\" UTC)" in text
    assert "0 NVIDIA H200, 41 °C, 126 W of 700 W, 796 of 143,771 MiB used" in text
    assert "server_ready: llama-server pid 42 ready after 1.20 s" in text


def test_not_ready_is_said_in_the_first_line() -> None:
    lines = render(document(snapshot(phase="backoff"), now=NOW), clock=lambda: NOW)
    assert "backoff (server NOT ready)" in lines[0]
    assert "ready for" not in "\n".join(lines)


def test_gpu_watch_off_and_durations() -> None:
    text = "\n".join(render(document(snapshot(gpu={"watch": "off", "reason": "no NVIDIA driver"}), now=NOW)))
    assert "not watched: no NVIDIA driver" in text
    assert [duration(x) for x in (None, 5, 65, 3700, 90000)] == ["-", "5 s", "1 min 5 s", "1 h 1 min", "1 d 1 h"]


def test_a_ready_server_that_answers_no_round_is_not_ready() -> None:
    silent = snapshot(liveness={"answering": False, "silent_s": 14.2})
    assert exit_code(silent) == EXIT_NOT_READY and document(silent, now=NOW)["ready"] is False
    assert "ready (server NOT ready: no HTTP answer for 14 s)" in render(document(silent, now=NOW),
                                                                         clock=lambda: NOW)[0]
    answering = snapshot(liveness={"answering": True, "silent_s": 0.0})
    assert exit_code(answering) == EXIT_READY and exit_code(snapshot(liveness=None)) == EXIT_READY
