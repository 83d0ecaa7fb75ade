"""End to end: requests that arrive at the front door during a GPU reset are held and answered; a stop
during the reset answers them 503 at once.

The daemon runs with the fake NVML (tests/fake_pynvml_mod.py), the fake llama-server and the stub
reset command (tests/stub_reset.py), as in test_reset_e2e.py: a CPU has no GPU to lose or reset. A lost
GPU (NVML's GPU_IS_LOST) makes the daemon stop the server and reset the GPU; the stub takes 2 s (its
timeout is 3 s), and the requests sent meanwhile must all be answered by the server started after the
reset.
"""

from __future__ import annotations

import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from harness import free_port
from test_reset_e2e import MakeRun, gpu_run  # noqa: F401 - the fixture

pytestmark = [pytest.mark.timeout(120)]


def test_requests_arriving_during_a_gpu_reset_are_held_and_answered(gpu_run: MakeRun) -> None:  # noqa: F811
    front = free_port()
    run = gpu_run(extra={"front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": 60.0}},
                  env={"STUB_RESET_SLEEP_S": "2"}).start()
    first = run.wait_event("server_ready", 20)["server_pid"]
    url = f"http://127.0.0.1:{front}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(url, json=body, timeout=10).status_code == 200
    run.set_nvml(lost=True)
    run.wait_event("gpu_lost", 10)
    run.wait_event("server_stopped", 10)
    with ThreadPoolExecutor(4) as pool:
        answers = []
        for _ in range(4):  # arriving while the reset command runs
            answers.append(pool.submit(httpx.post, url, json=body, timeout=60))
            time.sleep(0.2)
        results = [a.result() for a in answers]
    assert [r.status_code for r in results] == [200] * 4
    assert run.wait_event("gpu_reset")["outcome"] == "succeeded"
    assert run.wait_event("server_ready", 10, skip=1)["server_pid"] != first
    held = run.wait_event("front_held", 10)
    assert held["held"] == 4 and held["failed"] == 0 and "resetting_gpu" in held["phase"]


def _stub_running(tag: object) -> bool:
    out = subprocess.run(["pgrep", "-f", f"stub_reset.py --tag {tag}"], capture_output=True, text=True, check=False)
    return bool(out.stdout.strip())


def _waiting(metrics: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llama_guard_front_requests_waiting "))


def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def test_a_stop_during_a_gpu_reset_answers_held_and_new_requests_503_at_once(gpu_run: MakeRun) -> None:  # noqa: F811
    """SIGTERM while the reset command runs: the daemon waits for the command (never interrupted), but
    the requests held for the server that will not come, and new ones, get their 503 at once."""
    front, metrics = free_port(), free_port()
    reset_s = 8.0
    run = gpu_run(extra={"front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": 120.0},
                         "metrics": {"listen": f"127.0.0.1:{metrics}"},
                         "recovery": {"reset_timeout_s": 30.0, "reset_toggles_persistence": False}},
                  env={"STUB_RESET_SLEEP_S": str(reset_s)}).start()
    run.wait_event("server_ready", 20)
    url = f"http://127.0.0.1:{front}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    run.set_nvml(lost=True)
    _until(lambda: _stub_running(run.tmp), 30, "the reset command runs")
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(httpx.post, url, json=body, timeout=60) for _ in range(3)]
        _until(lambda: _waiting(metrics) >= 3, 20, "3 requests held")
        run.signal(signal.SIGTERM)
        results = [h.result() for h in held]
    new = httpx.post(url, json=body, timeout=60)
    assert [r.status_code for r in [*results, new]] == [503] * 4
    assert all(r.headers["Retry-After"] == "5" for r in [*results, new])
    assert _stub_running(run.tmp)  # the command still runs: the answers did not wait for it
    assert run.wait_exit(60) == 0
    assert run.wait_event("gpu_reset")["outcome"] == "succeeded"
