"""A fault that lasts half a minute does not end the daemon at the default restart settings.

The server binary is a small wrapper around the real llama-server: for the first 30 s after its first
start, each start prints llama-server's first load line and is killed with SIGKILL before it can be
ready (as the kernel's OOM killer does while another job holds the host's memory; the kill comes
from the wrapper itself, so how fast this host loads the model cannot let a start escape it); after
that it is the real server, unchanged. With the shipped
[recovery] defaults the daemon rides the blip out and serves; with the old defaults (0.1 s × 3, five
restarts) the same blip ended it as a crash loop within seconds.

A fault that prints the same line on every start for half a minute (the CUDA driver not there
while it reloads) is ridden out too: the same failure on consecutive starts becomes a verdict only
when it still holds ``repeat_confirm_s`` after its first start.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import DaemonRun, RunPool
from llama_guard.config.sections import RecoveryConfig
from llama_guard.vocab.exitcodes import EXIT_CRASH_LOOP

pytestmark = [pytest.mark.real, pytest.mark.timeout(240)]

BLIP_S = 30

WRAPPER = """#!/bin/sh
# llama-server for the first {blip} s after its first start is killed as it begins to load; then the real one.
start="{dir}/blip-start"
[ -s "$start" ] || date +%s > "$start"
if [ $(( $(date +%s) - $(cat "$start") )) -lt {blip} ]; then
  date +%s.%N >> "{dir}/killed-starts"
  echo "main: loading model" >&2
  kill -KILL $$
fi
exec "{real}" "$@"
"""

SAME_LINE_WRAPPER = """#!/bin/sh
# For the first {blip} s after its first start: the CUDA runtime finds no device (the same line, exit 1).
start="{dir}/blip-start"
[ -s "$start" ] || date +%s > "$start"
if [ $(( $(date +%s) - $(cat "$start") )) -lt {blip} ]; then
  date +%s.%N >> "{dir}/failed-starts"
  echo "ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected" >&2
  exit 1
fi
exec "{real}" "$@"
"""

DEFAULTS = RecoveryConfig()
RESTARTS = {"backoff_initial_s": DEFAULTS.backoff_initial_s, "backoff_factor": DEFAULTS.backoff_factor,
            "backoff_max_s": DEFAULTS.backoff_max_s, "max_restarts": DEFAULTS.max_restarts,
            "restart_window_s": DEFAULTS.restart_window_s}
OLD = {"backoff_initial_s": 0.1, "backoff_factor": 3.0, "max_restarts": 5}


@pytest.fixture
def blip(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> Any:
    pool = RunPool()

    def make(recovery: dict[str, object], script: str = WRAPPER) -> DaemonRun:
        wrapper = tmp_path / "llama-server-blip"
        wrapper.write_text(script.format(blip=BLIP_S, dir=tmp_path, real=llama_server_bin))
        wrapper.chmod(0o755)
        return pool.new(tmp_path, str(wrapper), str(real_model), {"recovery": recovery})

    yield make
    leftovers = pool.finish()
    if leftovers:
        pytest.fail(f"llama-server pids {leftovers} outlived their daemon")


def test_a_30_s_blip_is_ridden_out_at_the_default_restart_settings(blip: Any, tmp_path: Path) -> None:
    run = blip(RESTARTS).start()
    ready = run.wait_event("server_ready", BLIP_S + 90)
    killed = (tmp_path / "killed-starts").read_text().split()
    first = float(killed[0])
    assert len(killed) >= 4, killed  # the blip covered several starts
    assert run.proc is not None and run.proc.poll() is None
    assert "crash_loop" not in run.names()
    exits = [e for e in run.events() if e["event"] == "server_exited"]
    assert len(exits) == len(killed) and all(e["signal"] == 9 for e in exits), exits
    waits = [e["backoff_s"] for e in run.events() if e["event"] == "server_backoff"]
    expected = [0.0] + [min(DEFAULTS.backoff_initial_s * DEFAULTS.backoff_factor ** i, DEFAULTS.backoff_max_s)
                        for i in range(len(waits) - 1)]
    assert waits == pytest.approx(expected)  # the first restart at once, then the default backoff
    assert time.time() - first >= BLIP_S
    assert httpx.get(f"http://127.0.0.1:{run.port}/health", timeout=10).status_code == 200
    assert ready["server_pid"] == run.wait_event("server_starting", skip=len(killed))["server_pid"]


def test_the_old_defaults_gave_up_on_the_same_blip(blip: Any) -> None:
    run = blip(OLD).start()
    assert run.wait_exit(BLIP_S) == EXIT_CRASH_LOOP
    assert "crash_loop" in run.names() and "server_ready" not in run.names()


def test_a_30_s_fault_printing_the_same_line_each_start_is_ridden_out(blip: Any, tmp_path: Path) -> None:
    run = blip({**RESTARTS, "repeat_confirm_s": DEFAULTS.repeat_confirm_s}, SAME_LINE_WRAPPER).start()
    run.wait_event("server_ready", BLIP_S + DEFAULTS.repeat_confirm_s + 60)
    failed = (tmp_path / "failed-starts").read_text().split()
    assert len(failed) >= 2, failed  # the same line on consecutive starts: a chain the rule saw
    assert run.proc is not None and run.proc.poll() is None
    assert "server_boot_failure" not in run.names() and "crash_loop" not in run.names()
    assert httpx.get(f"http://127.0.0.1:{run.port}/health", timeout=10).status_code == 200
