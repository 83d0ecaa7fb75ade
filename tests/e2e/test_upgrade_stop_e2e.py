"""SIGTERM to a serving daemon while it trials a new llama-server build (the front door holding the
clients): the daemon stops as it does in a planned restart's drain — the held request is answered what a
stop gives a held request (503, ``Retry-After``, "llama-guard is stopping llama-server"), the trial's
measurement is cut so that the server under measurement stops on its SIGTERM (before: llama-server went
on answering llama-guard's own measurement and was killed by SIGKILL at ``stop_grace_s``), no outcome of
the trial is recorded (neither kept nor rolled back), and the daemon exits 0 leaving no server behind.

The measurement is long by design (600 tokens at ``--threads 1``: tens of seconds on this host), so that
a stop waiting for it outlasts ``stop_grace_s``."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import free_port
from test_upgrade_e2e import copy_build, reload_with, serving, status_when, wait_until

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

HOLD_S = 600.0
LONG_TRIAL = {"probation_s": 1.0, "trial_runs": 1, "trial_tokens": 600, "max_slowdown_pct": 75.0,
              "trial_timeout_s": 600.0}


def waiting(metrics: int) -> float:
    """``llama_guard_front_requests_waiting``: the requests the front door holds now."""
    for line in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=30).text.splitlines():
        if line.startswith("llama_guard_front_requests_waiting"):
            return float(line.split()[-1])
    return 0.0


def held_request(port: int, answers: list[Any]) -> threading.Thread:
    """A completion through the front door in a thread; its (status, Retry-After, body) or error."""
    def send() -> None:
        try:
            answer = httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "Hi", "n_predict": 2},
                                timeout=HOLD_S)
            answers.append((answer.status_code, answer.headers.get("Retry-After"), answer.text))
        except httpx.HTTPError as exc:
            answers.append(repr(exc))
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("stage", ["old", "new"])
def test_sigterm_during_a_trial_stops_like_a_stop_during_a_drain(
        tmp_path: Path, llama_server_bin: Path, real_model: Path, stage: str) -> None:
    """``stage``: which build's measurement the SIGTERM comes in (the serving one after its drain, or
    the new one after its load)."""
    new = copy_build(llama_server_bin, tmp_path / "new-build")
    metrics = free_port()
    with serving(tmp_path, llama_server_bin, real_model, upgrade=LONG_TRIAL, front={"hold_timeout_s": HOLD_S},
                 server={"threads": 1}, recovery={"stop_grace_s": 10.0},
                 metrics={"listen": f"127.0.0.1:{metrics}"}) as run:
        first = run.wait_event("server_ready")["server_pid"]
        reload_with(run, new)
        run.wait_event("upgrade_preflight_passed", 120)
        if stage == "new":  # the old build's long measurement first: then the new build's
            run.wait_event("server_starting", 600, skip=1)
        measured = status_when(tmp_path, lambda s: s["phase"] == "trial" and (s["server_pid"] == first) == (
            stage == "old"))
        answers: list[Any] = []
        client = held_request(run.front, answers)
        wait_until(lambda: waiting(metrics) >= 1, 60)
        run.signal(signal.SIGTERM)
        assert run.wait_exit(120) == 0
        client.join(60)
        assert len(answers) == 1 and answers[0][:2] == (503, "5"), answers
        assert "llama-guard is stopping llama-server" in answers[0][2], answers
        stopping = run.wait_event("daemon_stopping")
        assert "the trial of a new build is abandoned while measuring" in stopping["reason"], stopping
        stopped = run.wait_event("server_stopped", where=lambda e: e["server_pid"] == measured["server_pid"])
        assert "SIGKILL" not in str(stopped), stopped
        names = run.names()
        assert "server_stop_timeout" not in names, names
        assert not {"upgrade_trial_passed", "upgrade_rolled_back", "upgrade_kept"} & set(names), names
