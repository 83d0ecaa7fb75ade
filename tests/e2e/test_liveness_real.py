"""Liveness against the REAL llama-server (CPU build) on the REAL SmolLM2 model: a conversation
keeps its KV cache through liveness rounds (host prompt cache off and on, one slot and two), and a
tracked process that spins while its real server is SIGSTOPped is hung within the silence bound,
with ``llama-guard status`` not saying ready meanwhile."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import stat
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from harness import ROOT, DaemonRun
from llama_guard.config.sections import HealthConfig

pytestmark = pytest.mark.real

SHIPPED: dict[str, object] = {name: getattr(HealthConfig(), name) for name in (
    "interval_s", "timeout_s", "canary_timeout_s", "hang_strikes", "silent_limit_s", "progress_cpu_s")}
SYSTEM = ("You are a careful assistant for a harbour office. " + " ".join(
    f"Rule {i}: answer briefly, name the pier, the tide and the ship when you know them, and never invent a "
    f"timetable." for i in range(1, 31)))
TURNS = ("Which pier does the morning ferry use?", "And when is high tide today?", "Thank you. Anything else?")


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def chat(port: int, gap_s: float) -> list[tuple[int, float, float]]:
    """Three turns, ``gap_s`` seconds apart: per turn (prompt tokens evaluated, start, end)."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    out = []
    for i, turn in enumerate(TURNS):
        if i:
            time.sleep(gap_s)
        messages.append({"role": "user", "content": turn})
        start = time.time()
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300.0, trust_env=False,
                          json={"messages": messages, "max_tokens": 16, "temperature": 0.0})
        resp.raise_for_status()
        body = resp.json()
        out.append((int(body["timings"]["prompt_n"]), start, time.time()))
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", [1, 2])
@pytest.mark.parametrize("cache_ram", ["0", "default"])
def test_liveness_rounds_between_turns_never_displace_the_conversation(real: Any, parallel: int,
                                                                        cache_ram: str) -> None:
    extra = ["--cache-ram", "0"] if cache_ram == "0" else []
    run = real({"server": {"ctx_size": 4096, "parallel": parallel, "extra_args": extra},
                "health": {"interval_s": 0.5, "timeout_s": 2.0, "canary_timeout_s": 10.0}}).start()
    pid = run.wait_event("server_ready", 120)["server_pid"]
    run.wait_event("server_probe", 30, where=lambda e: e["canary"] == "ok")  # the canary runs before the chat
    turns = chat(run.port, gap_s=2.5)
    evaluated = [t[0] for t in turns]
    assert evaluated[0] > 500, evaluated  # the history: system prompt + first question
    # Turns 2 and 3 evaluate only what is new (the last answer and the question), never the history.
    assert all(n < 60 for n in evaluated[1:]), evaluated
    rounds = [e for e in run.events() if e["event"] == "server_probe" and e["server_pid"] == pid]
    for (_, _, end), (_, start, _) in itertools.pairwise(turns):
        between = [r for r in rounds if end < stamp(r) < start]
        assert len(between) >= 2, (end, start, rounds)  # liveness rounds really ran between the turns
        assert all(r["health_ok"] for r in between), between
        if parallel == 2:  # a slot without the conversation: the canary still runs, on that slot
            assert any(r["canary"] == "ok" for r in between), between
        else:  # the only slot holds the conversation: no canary
            assert all(r["canary"] == "not_sent" for r in between), between
    names = run.names()
    assert "server_hang" not in names and "server_stopped" not in names


def spinning_wrapper(tmp: Path, binary: Path, mark: Path) -> Path:
    """A launcher that runs the real llama-server as its child and, once ``mark`` exists, spins
    a core: the tracked process burns CPU while (the test SIGSTOPs the child) nothing answers."""
    script = tmp / "spin-wrapper.py"
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([{str(binary)!r}, *sys.argv[1:]])\n"
        "while child.poll() is None:\n"
        f"    if os.path.exists({str(mark)!r}):\n"
        "        t = time.monotonic()\n"
        "        while time.monotonic() - t < 0.5:\n"
        "            pass\n"
        "    else:\n"
        "        time.sleep(0.1)\n"
        "sys.exit(child.returncode)\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def status(run: DaemonRun) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llama_guard", "status", "--runtime-dir", str(run.tmp / "run")],
                          capture_output=True, text=True, cwd=str(ROOT / "supervisor"), timeout=60)


@pytest.mark.timeout(300)
def test_a_spinning_process_whose_server_answers_nothing_is_hung_within_the_silence_bound(
        real: Any, tmp_path: Path, llama_server_bin: Path) -> None:
    mark = tmp_path / "spin.mark"
    # the shipped probes, with a silence bound of 20 s instead of 60 (the bound is what is tested, not its size)
    health: dict[str, Any] = {**SHIPPED, "silent_limit_s": 20.0}
    run = real({"health": health, "recovery": {"stop_grace_s": 1.0}},
               binary=str(spinning_wrapper(tmp_path, llama_server_bin, mark))).start()
    ready = run.wait_event("server_ready", 120)
    wrapper = ready["server_pid"]
    assert status(run).returncode == 0
    server = next(p for p in psutil.Process(wrapper).children() if p.name().startswith("llama-server"))
    mark.touch()
    os.kill(server.pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        # Rounds time out while the wrapper's CPU moves: no strike, but not ready either.
        run.wait_event("server_probe", 30, where=lambda e: not e["health_ok"] and (e["cpu_s"] or 0) >= 0.05)
        time.sleep(float(health["interval_s"]) + float(health["timeout_s"]) + 1.0)
        seen = status(run)
        assert seen.returncode == 1, seen.stdout
        assert "NOT ready: no HTTP answer for" in seen.stdout, seen.stdout
        hang = run.wait_event("server_hang", 120)
    finally:
        with_continue(server.pid)
    assert hang["server_pid"] == wrapper
    assert "no HTTP answer at all" in hang["reason"] and "cpu" in hang["reason"], hang
    took = stamp(hang) - stopped_at
    bound = float(health["silent_limit_s"]) + float(health["interval_s"]) + float(health["timeout_s"])
    assert took <= bound + 5.0, (took, bound)
    # While it spun, the rounds with CPU progress were no strikes: the bound is what caught it.
    rounds = [e for e in run.events() if e["event"] == "server_probe" and e["server_pid"] == wrapper
              and not e["health_ok"]]
    assert rounds and all((r["cpu_s"] or 0) >= 0.05 for r in rounds[1:]), rounds
    assert run.wait_event("server_ready", 120, skip=1)["server_pid"] != wrapper


def with_continue(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
