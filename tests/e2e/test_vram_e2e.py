"""End to end, VRAM admission: the real daemon + the fake llama-server + a fake NVML
in which another process (a real ``sleep``, named by pid) holds the GPU's memory.

The fake NVML stands for a GPU this machine does not have; the foreign process is real so that its
name and pid are read as in production.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import (
    FAKE_NVML_RUN,
    FAKE_SERVER,
    DaemonRun,
    base_sections,
    free_port,
    merge,
    server_pids_of,
    wait_nvml_calls,
)

TESTS = Path(__file__).resolve().parents[1]
GIB = 1024**3
pytestmark = pytest.mark.timeout(90)


class VramRun(DaemonRun):
    port: int
    script: Path
    record: Path

    def set_nvml(self, **changes: object) -> None:
        data = json.loads(self.script.read_text())
        data.update(changes)
        tmp = self.script.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.script)

    def wait_nvml_calls(self, name: str, more: int) -> None:
        wait_nvml_calls(self, self.tmp / "nvml-calls.json", name, more)


# The VRAM checks of a wait (one per [gpu] poll while the VRAM is held): each reads NVML's recovery action,
# which nothing else reads — so its calls count the checks.
CHECK = "nvmlDeviceGetFieldValues"


@pytest.fixture
def foreign() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def make_run(tmp_path: Path) -> Iterator[list[VramRun]]:
    runs: list[VramRun] = []
    yield runs
    for run in runs:
        run.stop()
        for pid in server_pids_of(run.port):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"fake llama-server pid {pid} outlived its daemon")


def start(runs: list[VramRun], tmp: Path, *, gpu: dict[str, object], nvml: dict[str, object],
          env: dict[str, str] | None = None, env_daemon: dict[str, str] | None = None,
          model: Path | None = None) -> VramRun:
    port = free_port()
    script = tmp / "nvml.json"
    script.write_text(json.dumps({"server_on_gpu": True, **nvml}))
    record = tmp / "reset-record.jsonl"
    # The fake server never reads its model, but the daemon checks it is a GGUF file first.
    (tmp / "fake.gguf").write_bytes(b"GGUF" + bytes(28))
    sections = merge(base_sections(tmp, str(FAKE_SERVER), str(model or tmp / "fake.gguf"), port), {
        "server": {"n_gpu_layers": 99, "env": {"FAKE_LLAMA_LOAD_S": "0.2", **(env or {})}},
        "health": {"canary": False},
        "gpu": {"enabled": "on", "index": 0, "sample_interval_s": 0.2, "vram_release_timeout_s": 2.0,
                "server_on_gpu_timeout_s": 5.0, "kmsg_path": str(tmp / "no-kmsg"), **gpu},
        "recovery": {"reset_command": [sys.executable, str(TESTS / "stub_reset.py"), "--gpu-reset", "-i", "{index}"],
                     "reset_timeout_s": 3.0, "foreign_wait_s": 0.5, "max_restarts": 3},
    })
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    run = VramRun(tmp, sections, env={"PYTHONPATH": pythonpath,
                                      "FAKE_NVML_SCRIPT": str(script), "STUB_RESET_RECORD": str(record),
                                      "FAKE_NVML_CALLS": str(tmp / "nvml-calls.json"),
                                      **(env_daemon or {})},
                  command=FAKE_NVML_RUN)
    run.port, run.script, run.record = port, script, record
    runs.append(run)
    return run.start()


HELD = {"memory_total": 80 * GIB, "memory_used": 80 * GIB - 150 * 2**20}  # all but 150 MiB
FREE = {"memory_total": 80 * GIB, "memory_used": 1 * GIB}


def test_start_waits_for_the_foreign_process_then_starts(make_run: list[VramRun], tmp_path: Path,
                                                        foreign: subprocess.Popen[bytes]) -> None:
    run = start(make_run, tmp_path, gpu={"expected_vram_mib": 20_000, "vram_wait_timeout_s": 60.0},
                nvml={"processes": [[foreign.pid, 79 * GIB]], "values": HELD})
    wait = run.wait_event("gpu_vram_wait", 20)
    assert wait["foreign_pid"] == foreign.pid and wait["foreign_name"] == "sleep"
    assert wait["foreign_mib"] == 79 * 1024 and wait["free_mib"] == 150 and wait["need_mib"] == 20_000
    assert f"pid {foreign.pid} (sleep" in wait["message"] and "19850 MiB missing" in wait["message"]
    run.wait_nvml_calls(CHECK, 3)  # it keeps waiting: three more checks, still short, nothing started into OOM
    assert "server_starting" not in run.names()
    run.set_nvml(processes=[], values=FREE)
    ready = run.wait_event("server_ready", 20)
    names = run.names()
    assert names.count("gpu_vram_wait") == 1 and names.count("server_starting") == 1
    assert "server_backoff" not in names and "crash_loop" not in names and "gpu_reset" not in names
    assert ready["server_pid"] in server_pids_of(run.port)


def test_stop_request_while_waiting_for_vram_exits_0_at_once(make_run: list[VramRun], tmp_path: Path,
                                                            foreign: subprocess.Popen[bytes]) -> None:
    run = start(make_run, tmp_path, gpu={"expected_vram_mib": 20_000},
                nvml={"processes": [[foreign.pid, 79 * GIB]], "values": HELD})
    run.wait_event("gpu_vram_wait", 20)
    run.signal(signal.SIGTERM)
    assert run.wait_exit(30) == 0  # the wait (vram_wait_timeout_s, 300 s by default) is not waited out
    names = run.names()
    assert "server_starting" not in names and "server_restart" not in names
    assert names[names.index("gpu_vram_wait") + 1:] == ["daemon_stopping", "daemon_exit"], names


def test_oom_at_load_while_a_foreign_process_holds_the_vram_waits_instead_of_crashing(
        make_run: list[VramRun], tmp_path: Path, foreign: subprocess.Popen[bytes]) -> None:
    # The H200 run (tests/fixtures/h200_vram_wait): no good start yet (need unknown), another process holds all but
    # 150 MiB; the server runs out of memory at load.
    flag = tmp_path / "foreign-holds-vram"
    flag.write_text("1")
    run = start(make_run, tmp_path, gpu={"vram_wait_timeout_s": 60.0},
                nvml={"processes": [[foreign.pid, 79 * GIB]], "values": HELD},
                env={"FAKE_LLAMA_OOM_WHILE": str(flag)})
    oom = run.wait_event("server_oom", 20)
    wait = run.wait_event("gpu_vram_wait", 20)
    assert wait["foreign_pid"] == foreign.pid and "ran out of GPU memory at load" in wait["missing"]
    run.wait_nvml_calls(CHECK, 2)  # two more checks while held
    assert run.names().count("server_starting") == 1  # not started again into the same OOM
    flag.unlink()
    run.set_nvml(processes=[], values=FREE)
    ready = run.wait_event("server_ready", 20)
    assert ready["server_pid"] != oom["server_pid"]
    names = run.names()
    assert "server_backoff" not in names and "crash_loop" not in names and "gpu_reset" not in names
    assert not run.record.exists()  # no reset command ran


def test_the_wait_keeps_systemds_start_timeout_ahead(make_run: list[VramRun], tmp_path: Path,
                                                     foreign: subprocess.Popen[bytes]) -> None:
    # Under systemd (Type=notify, TimeoutStartSec=5min) a wait for VRAM of up to vram_wait_timeout_s
    # before the first READY must not be taken for a start that hangs.
    import socket

    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(address)
        manager.settimeout(0.5)
        run = start(make_run, tmp_path, gpu={"expected_vram_mib": 20_000},
                    nvml={"processes": [[foreign.pid, 79 * GIB]], "values": HELD},
                    env_daemon={"NOTIFY_SOCKET": address})
        run.wait_event("gpu_vram_wait", 20)
        messages: list[str] = []
        deadline = time.monotonic() + 11.5
        while time.monotonic() < deadline:
            try:
                messages.append(manager.recv(4096).decode())
            except TimeoutError:
                continue
    extends = [m for m in messages if "EXTEND_TIMEOUT_USEC=" in m]
    assert len(extends) >= 2, messages  # repeated while the wait lasts (at most every 10 s)
    assert not any("READY=1" in m for m in messages)


def test_the_wait_admits_once_a_real_foreign_process_exits_and_its_memory_is_freed(
        make_run: list[VramRun], tmp_path: Path, real_model: Path) -> None:
    # The H200 run (notes/h200_vram_wait, V1): no [gpu].expected_vram_mib and no good start, so the
    # need is the estimate from the real GGUF; NVML behaves like the real one: the Xid waiter's
    # event wait blocks its full second, every call takes time, and the foreign process stays listed
    # (its memory used) until a while after it exited. It exits unreaped, a zombie, like the hog.
    hog = subprocess.Popen(["sleep", "300"])
    try:
        total = 80 * GIB
        run = start(make_run, tmp_path, gpu={"vram_wait_timeout_s": 60.0},
                    nvml={"processes": [[hog.pid, 79 * GIB, 2.0]], "call_s": 0.005,
                          "values": {"memory_total": total, "memory_used": total - 79 * GIB - 150 * 2**20}},
                    model=real_model)
        wait = run.wait_event("gpu_vram_wait", 40)
        assert wait["foreign_pid"] == hog.pid and wait["free_mib"] == 150
        assert isinstance(wait["need_mib"], int) and wait["need_mib"] > 150  # the GGUF's estimate
        run.wait_nvml_calls(CHECK, 3)  # several checks while it is held
        assert "server_starting" not in run.names()
        hog.kill()  # not reaped: a zombie until the end of the test
        ready = run.wait_event("server_ready", 30)
        names = run.names()
        assert names.count("gpu_vram_wait") == 1 and names.count("server_starting") == 1
        assert "server_backoff" not in names and "gpu_vram_check_failed" not in names
        assert ready["server_pid"] in server_pids_of(run.port)
    finally:
        hog.kill()
        hog.wait()


def test_a_check_that_fails_while_waiting_is_reported_once_and_the_wait_goes_on(
        make_run: list[VramRun], tmp_path: Path, foreign: subprocess.Popen[bytes]) -> None:
    run = start(make_run, tmp_path, gpu={"expected_vram_mib": 20_000, "vram_wait_timeout_s": 60.0},
                nvml={"processes": [[foreign.pid, 79 * GIB]], "values": HELD})
    run.wait_event("gpu_vram_wait", 20)
    run.set_nvml(fail={"nvmlDeviceGetMemoryInfo": 7})  # NVML answers the memory reading with an error
    failed = run.wait_event("gpu_vram_check_failed", 10)
    assert failed["gpu_index"] == 0 and "no memory reading" in failed["reason"]
    # Several failed checks: no start into the other process's memory, one report. A failed check reads no
    # recovery action; the memory reading fails for the sampler (every 0.2 s) and each check (every 1 s):
    # 18 failed readings span at least three checks' polls.
    run.wait_nvml_calls("nvmlDeviceGetMemoryInfo", 18)
    names = run.names()
    assert "server_starting" not in names and names.count("gpu_vram_check_failed") == 1
    run.set_nvml(fail={}, processes=[], values=FREE)
    run.wait_event("server_ready", 20)
    names = run.names()
    assert names.count("server_starting") == 1 and "server_backoff" not in names
