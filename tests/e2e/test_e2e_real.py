"""End to end: llama-guard supervising the REAL llama-server on the REAL SmolLM2 model (CPU).

Each test starts ``python -m llama_guard run`` as a subprocess and reads its JSON events.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from harness import wait_gone

pytestmark = pytest.mark.real


def chat(port: int, content: str = "Say hello", max_tokens: int = 16, timeout: float | None = 60.0,
         ignore_eos: bool = False) -> dict[str, Any]:
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=timeout,
                      json={"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                            "ignore_eos": ignore_eos})
    resp.raise_for_status()
    data: dict[str, Any] = resp.json()
    return data


def test_ready_and_answers(real: Any) -> None:
    run = real().start()
    ready = run.wait_event("server_ready", 60)
    started = run.wait_event("server_starting")
    assert ready["server_pid"] == started["server_pid"]
    assert "--metrics" in started["argv"] and "--flash-attn on" in started["argv"]
    answer = chat(run.port)
    assert answer["choices"][0]["message"]["content"]
    assert answer["timings"]["predicted_n"] >= 1
    # Every line of the server is kept (debug level) and attributed to its pid.
    lines = [e for e in run.events() if e["event"] == "server_line"]
    assert any("listening on" in e["line"] for e in lines)
    assert {e["server_pid"] for e in lines} == {ready["server_pid"]}
    # The status snapshot sees the same server.
    out = subprocess.run([sys.executable, "-m", "llama_guard", "status", "--config", str(run.config), "--json"],
                         capture_output=True, text=True, timeout=30, check=True)
    assert f'"server_pid": {ready["server_pid"]}' in out.stdout and '"phase": "ready"' in out.stdout


def test_kill_9_is_restarted(real: Any) -> None:
    run = real().start()
    first = run.wait_event("server_ready", 60)["server_pid"]
    os.kill(first, signal.SIGKILL)
    exited = run.wait_event("server_exited", 10)
    assert exited["server_pid"] == first and exited["signal"] == signal.SIGKILL
    second = run.wait_event("server_ready", 60, skip=1)["server_pid"]
    assert second != first and psutil.pid_exists(second)
    assert chat(run.port)["choices"]


def test_sigstop_is_detected_as_hang_and_replaced(real: Any) -> None:
    run = real({"recovery": {"stop_grace_s": 1.0}}).start()
    first = run.wait_event("server_ready", 60)["server_pid"]
    os.kill(first, signal.SIGSTOP)
    hang = run.wait_event("server_hang", 30)
    assert hang["server_pid"] == first and hang["failures"] == 2
    second = run.wait_event("server_ready", 60, skip=1)["server_pid"]
    assert second != first
    assert wait_gone(first), "the stopped server was not reaped"
    assert chat(run.port)["choices"]


def test_long_generation_on_the_only_slot_is_not_a_hang(real: Any) -> None:
    # A long completion on the only slot: rounds see it processing and advancing, send no canary
    # (it would queue behind the answer, then take the answer's slot): no hang.
    # Six strikes (~6 s without progress) keep a CPU-starved host from looking stuck.
    run = real({"health": {"interval_s": 0.5, "canary_timeout_s": 0.5, "hang_strikes": 6}}).start()
    run.wait_event("server_ready", 60)
    # The client waits as long as the host needs (a busy 2-core host decodes a few tokens/s); the
    # daemon's verdict is what is tested, not the host's speed.
    answer = chat(run.port, "Write a long story about a lighthouse.", max_tokens=300, timeout=280,
                  ignore_eos=True)
    assert answer["timings"]["predicted_n"] == 300
    assert "server_hang" not in run.names()
    # Rounds ran during the answer: busy, advancing, and no canary among them.
    rounds = [e for e in run.events() if e["event"] == "server_probe"]
    during = [r for r in rounds if r["busy"]]
    assert any(r["progressed"] for r in during), rounds
    assert during and all(r["canary"] == "not_sent" for r in during), during


def test_config_rejected_at_boot_exits_78_after_one_attempt(real: Any) -> None:
    run = real({"server": {"extra_args": ["--no-flash-attn"]}}).start()
    assert run.wait_exit(60) == 78
    names = run.names()
    assert names.count("server_starting") == 1
    failure = run.wait_event("server_boot_failure")
    assert "--no-flash-attn" in failure["cause"]


def test_missing_model_exits_78(real: Any, tmp_path: Path) -> None:
    run = real({"server": {"model": str(tmp_path / "missing.gguf")}}).start()
    assert run.wait_exit(60) == 78
    assert run.names().count("server_starting") == 0  # refused before any start (the model check)
    assert "missing.gguf" in run.wait_event("server_boot_failure")["cause"]


def test_port_taken_exits_78(real: Any) -> None:
    import socket
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        # Retried for [recovery].port_wait_s (the holder named), then the verdict naming it.
        run = real({"server": {"port": holder.getsockname()[1]}, "recovery": {"port_wait_s": 3.0}}).start()
        assert run.wait_exit(60) == 78
        cause = run.wait_event("server_boot_failure")["cause"]
        assert f"pid {os.getpid()}" in cause and "choose another [server].port" in cause, cause
    finally:
        holder.close()


def test_sigterm_stops_server_and_exits_0(real: Any) -> None:
    run = real().start()
    pid = run.wait_event("server_ready", 60)["server_pid"]
    run.signal(signal.SIGTERM)
    assert run.wait_exit(30) == 0
    assert wait_gone(pid, 1.0)
    assert run.wait_event("server_stopped")["server_pid"] == pid


def test_sigkill_of_the_daemon_takes_the_server_down(real: Any) -> None:
    run = real().start()
    pid = run.wait_event("server_ready", 60)["server_pid"]
    run.signal(signal.SIGKILL)
    run.wait_exit(10)
    assert wait_gone(pid, 5.0), "llama-server survived a SIGKILL of llama-guard (PR_SET_PDEATHSIG)"


def test_child_environment(real: Any) -> None:
    run = real({"server": {"env": {"LLAMA_GUARD_TEST_MARK": "x1"}}})
    run.env["NOTIFY_SOCKET"] = "/nonexistent/notify"
    run.env["WATCHDOG_USEC"] = "1000000"
    run.start()
    pid = run.wait_event("server_ready", 60)["server_pid"]
    env = psutil.Process(pid).environ()
    assert env.get("LLAMA_GUARD_TEST_MARK") == "x1"
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert os.getpgid(pid) == pid  # its own process group


def test_sighup_bad_file_keeps_running_good_file_restarts(real: Any) -> None:
    run = real().start()
    first = run.wait_event("server_ready", 60)["server_pid"]
    good = run.config.read_text()
    run.config.write_text(good + "\n[server\n")
    run.signal(signal.SIGHUP)
    err = run.wait_event("config_error", 10)
    assert "invalid TOML" in err["reason"]
    # Kept running: the same server answers after the bad file (and below, the next start is the good
    # file's: a restart for the bad one would have been the second server_starting).
    assert chat(run.port)["choices"] and psutil.pid_exists(first)
    run.config.write_text(good.replace("ctx_size = 1024", "ctx_size = 2048"))
    run.signal(signal.SIGHUP)
    reloaded = run.wait_event("config_reloaded", 10)
    assert "server" in reloaded["changed"] and "server.ctx_size: 1024 → 2048" in reloaded["values"], reloaded
    assert "server.ctx_size 1024 → 2048" in reloaded["message"], reloaded
    second = run.wait_event("server_ready", 60, skip=1)["server_pid"]
    assert second != first
    assert "--ctx-size 2048" in run.wait_event("server_starting", skip=1)["argv"]


def test_llama_guard_restart_waits_for_a_running_completion(real: Any) -> None:
    run = real().start()
    first = run.wait_event("server_ready", 60)["server_pid"]
    with ThreadPoolExecutor(1) as client:
        # ignore_eos: the model cannot stop early, so the answer's length is the request's. No deadline of
        # the test's own: 200 tokens take 4 s on a quiet 2-core host and minutes beside three busy workers
        # (pytest-timeout bounds the test).
        answer = client.submit(chat, run.port, "Tell a long story.", max_tokens=200, timeout=None,
                               ignore_eos=True)
        # The answer is under way: a liveness round saw the slot busy and advancing (no 1-token canary does).
        run.wait_event("server_probe", 120, where=lambda e: bool(e.get("busy") and e.get("progressed")))
        out = subprocess.run([sys.executable, "-m", "llama_guard", "restart", "--config", str(run.config)],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        # The client got its full answer (a failed one raises here, with its cause).
        assert answer.result()["timings"]["predicted_n"] == 200
    second = run.wait_event("server_ready", 60, skip=1)["server_pid"]
    assert second != first
    names = run.names()
    assert names.index("restart_requested") < names.index("server_restart")
    assert "server_exited" not in names and "server_backoff" not in names
