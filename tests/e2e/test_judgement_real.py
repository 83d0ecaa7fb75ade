"""End to end with the REAL llama-server (CPU build) on the REAL SmolLM2 model: a server
frozen right after spawn, a SIGSTOPped ready server at the shipped [health] defaults, a server busy
with long prompt batches at those defaults, and a context the server cannot run (ctx_size = 1)."""

from __future__ import annotations

import os
import random
import signal
import stat
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from llama_guard.config.sections import HealthConfig

pytestmark = pytest.mark.real

# The shipped [health] defaults (config.HealthConfig): the liveness judgement is tested as it ships.
SHIPPED = {name: getattr(HealthConfig(), name) for name in ("interval_s", "timeout_s", "canary_timeout_s",
                                                            "hang_strikes", "load_stall_s", "progress_cpu_s")}


def frozen_once(tmp: Path, binary: Path) -> Path:
    """A launcher that freezes (SIGSTOP to itself) on its first start, before it execs the real
    llama-server, and execs it at once on later starts: no line, no CPU time, no HTTP answer."""
    mark = tmp / "frozen.mark"
    script = tmp / "frozen-once.sh"
    script.write_text(f'#!/bin/sh\nif [ ! -e "{mark}" ]; then : > "{mark}"; kill -STOP $$; fi\n'
                      f'exec "{binary}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def test_server_frozen_right_after_spawn_is_replaced(real: Any, tmp_path: Path, llama_server_bin: Path) -> None:
    stall_s = 3.0
    run = real({"health": {"load_stall_s": stall_s, "load_timeout_s": 600.0}},
               binary=str(frozen_once(tmp_path, llama_server_bin))).start()
    first = run.wait_event("server_starting", 30)["server_pid"]
    stalled = run.wait_event("server_load_stalled", stall_s + 20)
    assert stalled["server_pid"] == first and stalled["stalled_s"] >= stall_s
    ready = run.wait_event("server_ready", 60)
    assert ready["server_pid"] != first
    # The real load that followed, under the same small load_stall_s, was never taken for a stall.
    assert len([e for e in run.events() if e["event"] == "server_load_stalled"]) == 1
    assert "server_load_timeout" not in run.names()


def test_sigstopped_ready_server_is_found_within_20_s_and_killed_within_2_s_at_shipped_defaults(real: Any) -> None:
    # The shipped [health] and [recovery] (stop_grace_s too): the verdict's bound is hang_strikes x
    # interval_s + timeout_s of timers (18 s), and a server judged hung gets 1 s, not stop_grace_s.
    run = real({"health": dict(SHIPPED)}).start()
    first = run.wait_event("server_ready", 60)["server_pid"]
    stopped_at = time.time()
    os.kill(first, signal.SIGSTOP)
    hang = run.wait_event("server_hang", 45)
    assert hang["server_pid"] == first and hang["failures"] == SHIPPED["hang_strikes"]
    assert stamp(hang) - stopped_at <= 20.0, stamp(hang) - stopped_at
    gone = run.wait_event("server_stopped", 30)
    assert gone["server_pid"] == first
    assert stamp(gone) - stamp(hang) <= 2.0, stamp(gone) - stamp(hang)
    assert run.wait_event("server_ready", 60, skip=1)["server_pid"] != first


def long_prompt(words: int, rng: random.Random) -> str:
    vocab = ["lighthouse", "harbour", "storm", "keeper", "signal", "night", "wave", "ship", "lamp", "rock",
             "north", "salt", "rope", "bell", "fog", "tide", "gull", "stone", "wind", "shore"]
    return " ".join(rng.choice(vocab) for _ in range(words))


@pytest.mark.timeout(400)
def test_busy_with_long_prompt_batches_is_never_hung_at_shipped_defaults(real: Any) -> None:
    # One 8192-token batch per prompt: each ~4000-token prefill is one long ubatch of CPU work.
    run = real({"server": {"ctx_size": 8192, "batch_size": 8192, "ubatch_size": 8192},
                "health": dict(SHIPPED)}).start()
    pid = run.wait_event("server_ready", 120)["server_pid"]
    rng = random.Random(12)
    done: list[float] = []
    errors: list[str] = []
    # over 2x the verdict's window (hang_strikes x interval_s + timeout_s = 18 s): two prefills or more, each
    # longer than that window alone on this 2-core host (~25 s)
    until = time.monotonic() + 40.0

    def client() -> None:
        while time.monotonic() < until:
            start = time.monotonic()
            try:
                resp = httpx.post(f"http://127.0.0.1:{run.port}/completion", timeout=300,
                                  json={"prompt": long_prompt(3000, rng), "n_predict": 4, "cache_prompt": False})
                resp.raise_for_status()
                done.append(time.monotonic() - start)
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
                return

    worker = threading.Thread(target=client)
    worker.start()
    worker.join(timeout=400)
    assert not errors, errors
    assert done, "no long prompt finished"
    # The server prints its timings as it releases the slot, around the answer: wait for the line.
    run.wait_event("server_line", 30, where=lambda e: "prompt eval time" in e["line"])
    names = run.names()
    assert "server_hang" not in names and "server_stopped" not in names, names
    assert [e["server_pid"] for e in run.events() if e["event"] == "server_ready"] == [pid]


def test_ctx_size_1_is_a_boot_failure_naming_the_abort(real: Any) -> None:
    run = real({"server": {"ctx_size": 1}, "recovery": {"max_restarts": 5}}).start()
    assert run.wait_exit(120) == 78
    names = run.names()
    assert names.count("server_starting") == 3, names  # the same abort three times, then no more starts
    exits = [e for e in run.events() if e["event"] == "server_exited"]
    assert len(exits) == 3 and all(e.get("last_error") for e in exits), exits
    failure = run.wait_event("server_boot_failure")
    assert exits[-1]["last_error"] in failure["cause"] and failure["line"] == exits[-1]["last_error"]
    assert failure["build"].startswith("version: ") and failure["build"] in failure["cause"], failure
    assert "server_ready" not in names
