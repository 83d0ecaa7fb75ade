"""``llama-guard tune`` beside a daemon that serves its configuration (the real llama-server and model):
the daemon lends the GPU in a window (drained, stopped, LENT; the front door holds clients), tune runs its
trials, and the daemon serves again when tune ends — on the flags ``--apply`` wrote, else on its own; a
hold that outlasts ``[front].hold_timeout_s`` is answered 503 with ``Retry-After`` the window's time left;
a kill -9 of tune mid-trial leaves no trial server and the daemon serving its old flags; a second tune is
refused while the window is lent. Before, tune refused to run at all while a daemon served its config.

Tune loads the host's two cores: the module runs in the serial lane."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from front_fixtures import daemon_pool, start_with_front
from harness import ROOT
from llama_guard.config import load_config
from llama_guard.tune.apply import apply_changes

pytestmark = pytest.mark.usefixtures("clean_env")

# the knobs left: threads (1 → 2 on this host of two cores) and batch (skipped once the time is short)
TUNE = {"min_ctx_size": 1024, "max_parallel": 1, "cache_types": ["q8_0"], "runs": 4, "tokens": 32}
HEALTH = {"canary": False, "interval_s": 1.0, "hang_strikes": 5, "timeout_s": 5.0}


@pytest.fixture
def serving(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> Iterator[Any]:
    """``make(front, tune, binary)``: a started daemon (front door on, one thread) serving the config."""
    with daemon_pool() as pool:
        def make(front: dict[str, object], tune: dict[str, object] | None = None, binary: str = "") -> Any:
            return start_with_front(pool, tmp_path, Path(binary or llama_server_bin), real_model, {
                "server": {"threads": 1, "parallel": 1, "ctx_size": 1024}, "front": front, "health": HEALTH,
                "schedule": {"drain_timeout_s": 60.0}, "tune": {**TUNE, **(tune or {})}})

        yield make


def _as_a_terminals_foreground_job() -> None:
    """Ctrl-C reaches tune as from a terminal: a test run started in the background of a shell without job
    control inherits SIGINT ignored, and Python leaves an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def tune(run: Any, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "llama_guard", "tune", "--config", str(run.config), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=_as_a_terminals_foreground_job)


def argv_of(event: dict[str, Any]) -> str:
    return str(event["argv"]).split(" ", 1)[1]  # the flags (the binary's path may be a kept copy)


def completion(port: int, timeout: float = 300.0) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=timeout)


def trial_servers(proc: subprocess.Popen[str], timeout: float = 120.0) -> list[psutil.Process]:
    """tune's trial llama-server (its child), once one runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = [p for p in psutil.Process(proc.pid).children(recursive=True) if "llama-server" in p.name()]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("no trial server started")


# A slow build: llama-server itself, stopped (SIGSTOP) two thirds of the time: decode is about three times
# slower whatever the host's load, so that tune finds the real build faster (a knob whose winner does not
# depend on the host: threads does — a loaded host of two cores decodes faster on one thread).
SLOW_BUILD = """#!{python}
import signal, subprocess, sys, time
REAL = {real!r}
args = sys.argv[1:]
if "--port" not in args:  # --version, --help: the real build's answers
    import os
    os.execv(REAL, [REAL, *args])
child = subprocess.Popen([REAL, *args])
def forward(sig, frame):
    child.send_signal(sig)
    child.send_signal(signal.SIGCONT)
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, forward)
while child.poll() is None:
    time.sleep(0.02)
    try:
        child.send_signal(signal.SIGSTOP)
        time.sleep(0.04)
        child.send_signal(signal.SIGCONT)
    except ProcessLookupError:
        break
sys.exit(child.wait() % 256)
"""


def test_tune_apply_beside_a_serving_daemon_fails_no_client_and_the_daemon_serves_the_tuned_flags(
        serving: Any, tmp_path: Path, llama_server_bin: Path) -> None:
    slow = tmp_path / "slow-llama-server"
    slow.write_text(SLOW_BUILD.format(python=sys.executable, real=str(llama_server_bin)))
    slow.chmod(0o755)
    # short measurements: the slow build is ~3x slower by design, and the window is what is tested here
    run = serving({"hold_timeout_s": 600.0}, {"binaries": [str(llama_server_bin)], "runs": 3, "tokens": 16},
                  binary=str(slow))
    before_text = run.config.read_text()
    first = run.wait_event("server_starting")
    statuses: list[int] = []
    done = threading.Event()

    def clients() -> None:  # one request after another through the front door, all along
        while not done.is_set():
            statuses.append(completion(run.front).status_code)

    loop = threading.Thread(target=clients)
    loop.start()
    try:
        proc = tune(run, "--minutes", "2", "--apply")
        _, err = proc.communicate(timeout=600)
        returned = run.wait_event("lend_returned", 60)
        ready = run.wait_event("server_ready", 120, where=lambda e: e["server_pid"] != run.first)
        after = statuses[:]
        while len(statuses) < len(after) + 2:  # served by the tuned server too
            time.sleep(0.05)
    finally:
        done.set()
        loop.join(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "the GPU is lent" in err and "wrote binary" in err, err[-3000:]
    assert statuses and set(statuses) == {200}, statuses
    requested, granted = run.wait_event("lend_requested"), run.wait_event("lend_granted")
    assert requested["tune_pid"] == granted["tune_pid"] == returned["tune_pid"] == proc.pid
    assert granted["server_pid"] == run.first and returned["end"] == "done"
    held = run.wait_event("front_held", 30, where=lambda e: "lent_to_tune" in e["phase"])
    assert held["held"] >= 1 and held["failed"] == 0 and held["forwarded"] == held["held"], held
    # the file names the real build now (its comment kept); the daemon reloaded it and runs it
    text = run.config.read_text()
    assert load_config(run.config).server.binary == str(llama_server_bin) and text != before_text
    assert "# tuned" not in before_text or "# tuned" in text
    assert run.count("config_reloaded") == 1
    tuned = run.wait_event("server_starting", 10, where=lambda e: e["server_pid"] == ready["server_pid"])
    assert str(first["argv"]).startswith(str(slow)) and str(tuned["argv"]).startswith(str(llama_server_bin))


def test_a_file_written_during_the_window_is_served_after_it(serving: Any) -> None:
    """What ``--apply`` does at the search's end (apply_changes), done by the test while the window is lent
    (tune's own search cannot be told to find a change): the daemon reloads the file before it starts its
    server again, which runs the new flags; the slots saved at the drain are restored (same KV layout)."""
    run = serving({"hold_timeout_s": 600.0}, {"runs": 50, "tokens": 512})
    first = run.wait_event("server_starting")
    assert completion(run.front).status_code == 200  # a conversation in slot 0: saved at the drain
    proc = tune(run, "--minutes", "5")
    try:
        run.wait_event("lend_granted", 120)
        assert run.wait_event("slot_saved", 10)["server_pid"] == run.first
        trial_servers(proc)
        apply_changes(run.config, {"threads": 2})
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert run.wait_event("lend_returned", 60)["end"] == "stopped"
    assert run.wait_event("config_reloaded", 10)
    again = run.wait_event("server_starting", 120, skip=1)
    run.wait_event("server_ready", 120, skip=1)
    assert "--threads 2" in argv_of(again) and "--threads 1" in argv_of(first)
    assert run.wait_event("slot_restored", 10)["server_pid"] == again["server_pid"]  # threads keep the KV layout
    assert completion(run.front).status_code == 200


def test_a_window_that_outlasts_the_hold_answers_503_with_retry_after_and_sigterm_returns_it(serving: Any) -> None:
    run = serving({"hold_timeout_s": 3.0}, {"runs": 50, "tokens": 512})
    before = run.config.read_bytes()
    first = run.wait_event("server_starting")
    proc = tune(run, "--minutes", "5")
    try:
        granted = run.wait_event("lend_granted", 120)
        sent = time.monotonic()
        refused = completion(run.front)
        waited_s = time.monotonic() - sent
        servers = trial_servers(proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert refused.status_code == 503 and "lent to llama-guard tune" in refused.text, refused.text
    retry_after = int(refused.headers["Retry-After"])
    assert granted["bound_s"] - waited_s - 5 <= retry_after <= granted["bound_s"], (retry_after, granted)
    assert proc.returncode == 130 and "unchanged" in err, err[-2000:]
    assert not psutil.wait_procs(servers, timeout=30)[1], "a trial server outlived tune's SIGTERM"
    assert run.wait_event("lend_returned", 60)["end"] == "stopped"
    again = run.wait_event("server_starting", 120, skip=1)
    run.wait_event("server_ready", 120, skip=1)
    assert completion(run.front).status_code == 200
    assert argv_of(again) == argv_of(first) and run.config.read_bytes() == before


def test_kill_9_of_tune_mid_trial_leaves_no_trial_server_and_a_second_tune_is_refused(serving: Any) -> None:
    run = serving({"hold_timeout_s": 600.0}, {"runs": 50, "tokens": 512})
    before = run.config.read_bytes()
    first = run.wait_event("server_starting")
    proc = tune(run, "--minutes", "5", "--apply")
    try:
        run.wait_event("lend_granted", 120)
        servers = trial_servers(proc)
        second = tune(run, "--minutes", "1", "--apply")
        _, second_err = second.communicate(timeout=120)
        assert second.returncode == 1 and f"already lent to tune pid {proc.pid}" in second_err, second_err[-2000:]
        assert "nothing changed" in second_err
        assert run.wait_event("lend_refused", 10)["tune_pid"] == second.pid
        assert all(p.is_running() for p in servers) and run.count("server_starting") == 1
        proc.kill()  # kill -9: no return, no cleanup of its own
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, f"trial servers left running: {alive}"
    returned = run.wait_event("lend_returned", 60)
    assert returned["end"] == "exited" and returned["tune_pid"] == proc.pid
    again = run.wait_event("server_starting", 120, skip=1)
    run.wait_event("server_ready", 120, skip=1)
    assert completion(run.front).status_code == 200
    assert argv_of(again) == argv_of(first) and run.config.read_bytes() == before
