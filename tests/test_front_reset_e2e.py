"""End to end: requests that arrive at the front door during a GPU reset are held and answered.

The daemon runs with the fake NVML (tests/fake_pynvml_mod.py), the fake llama-server and the stub
reset command (tests/stub_reset.py), as in test_reset_e2e.py: a CPU has no GPU to lose or reset. A lost
GPU (NVML's GPU_IS_LOST) makes the daemon stop the server and reset the GPU; the stub takes 2 s (its
timeout is 3 s), and the requests sent meanwhile must all be answered by the server started after the
reset.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

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
