"""End to end (the real daemon, the fake llama-server for CUDA lines, the NVML test double): a
failure that repeats identically on consecutive starts is a verdict — exit 78 after three starts,
the line, the build (``--version``) and the fix named — and the same crash after the server ran
stably is a restart, never a verdict."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import FAKE_NVML_RUN, FAKE_SERVER, DaemonRun, base_sections, free_port, merge, server_pids_of

TESTS = Path(__file__).resolve().parents[1]
BUILD = "version: 4242 (fake0001); built with GNU 12.2.0 for Linux x86_64"

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
def runs() -> Iterator[list[DaemonRun]]:
    made: list[DaemonRun] = []
    yield made
    for run in made:
        run.stop()
        port = int(run.port)  # type: ignore[attr-defined]
        for pid in server_pids_of(port):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"fake llama-server pid {pid} outlived its daemon")


def fake_run(tmp_path: Path, fault: str, extra: dict[str, dict[str, object]] | None = None,
             *, nvml: bool = False) -> DaemonRun:
    port = free_port()
    (tmp_path / "fake.gguf").write_bytes(b"GGUF" + bytes(28))
    sections = merge(base_sections(tmp_path, str(FAKE_SERVER), str(tmp_path / "fake.gguf"), port), {
        "server": {"env": {"FAKE_LLAMA_FAULT": fault, "FAKE_LLAMA_LOAD_S": "0.2"}},
        "health": {"canary": False},
        "recovery": {"max_restarts": 10, "backoff_initial_s": 0.2},
    })
    env: dict[str, str] = {}
    if nvml:
        script = tmp_path / "nvml.json"
        script.write_text(json.dumps({"server_on_gpu": False}))
        sections = merge(sections, {"server": {"n_gpu_layers": 99},
                                    "gpu": {"enabled": "on", "index": 0, "sample_interval_s": 0.2,
                                            "kmsg_path": str(tmp_path / "no-kmsg")}})
        env = {"PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p),
               "FAKE_NVML_SCRIPT": str(script), "FAKE_NVML_STATE": str(tmp_path / "nvml-state.json")}
    run = DaemonRun(tmp_path, merge(sections, extra or {}), env=env, command=FAKE_NVML_RUN if nvml else None)
    run.port = port  # type: ignore[attr-defined]
    return run


def test_no_cuda_device_on_every_start_is_78_after_three_naming_line_build_and_fix(
        tmp_path: Path, runs: list[DaemonRun]) -> None:
    run = fake_run(tmp_path, "gpu_unavailable", nvml=True)
    runs.append(run)
    t0 = time.monotonic()
    run.start()
    assert run.wait_exit(60) == 78
    took = time.monotonic() - t0
    failure = run.wait_event("server_boot_failure")
    assert failure["consecutive_starts"] == 3, failure
    assert "no CUDA-capable device is detected" in failure["cause"], failure
    assert "n_gpu_layers = 0" in failure["fix"] and failure["build"] == BUILD, failure
    assert run.names().count("server_starting") == 3
    assert run.wait_event("daemon_exit")["exit_code"] == 78
    print(f"no CUDA device on every start: exit 78 after 3 starts in {took:.1f} s")


def test_a_crash_on_the_first_request_after_every_start_is_78_naming_line_and_build(
        tmp_path: Path, runs: list[DaemonRun]) -> None:
    run = fake_run(tmp_path, "crash_first_request")
    runs.append(run)
    run.start()
    url = f"http://127.0.0.1:{run.port}/completion"  # type: ignore[attr-defined]
    for i in range(3):
        run.wait_event("server_ready", 30, skip=i)
        with pytest.raises(httpx.HTTPError):
            httpx.post(url, json={"prompt": "x", "n_predict": 1}, timeout=10.0)
    assert run.wait_exit(30) == 78
    verdict = run.wait_event("server_failure_repeated")
    assert "an illegal memory access was encountered" in verdict["cause"], verdict
    assert verdict["build"] == BUILD and BUILD in verdict["cause"], verdict
    assert verdict["consecutive_starts"] == 3
    assert run.names().count("server_cuda_error") == 3


def test_the_same_crash_after_a_stable_run_is_a_restart_never_a_verdict(
        tmp_path: Path, runs: list[DaemonRun]) -> None:
    run = fake_run(tmp_path, "crash_first_request", {"recovery": {"stable_after_s": 1.0}})
    runs.append(run)
    run.start()
    url = f"http://127.0.0.1:{run.port}/completion"  # type: ignore[attr-defined]
    for i in range(4):
        run.wait_event("server_ready", 30, skip=i)
        time.sleep(1.6)  # it ran stably before the crash (in production: hours of traffic)
        with pytest.raises(httpx.HTTPError):
            httpx.post(url, json={"prompt": "x", "n_predict": 1}, timeout=10.0)
    run.wait_event("server_ready", 30, skip=4)
    names = run.names()
    assert "server_failure_repeated" not in names and "server_boot_failure" not in names, names
    assert names.count("server_cuda_error") == 4
    run.signal(signal.SIGTERM)
    assert run.wait_exit(30) == 0


def test_a_load_that_stalls_at_the_same_line_on_every_start_is_78_naming_it(
        tmp_path: Path, runs: list[DaemonRun]) -> None:
    # A load that stops for good after the same line (a model read from a hung mount): the line,
    # then the process waits for ever without output, CPU time or an HTTP answer.
    stall = tmp_path / "stalling-llama-server"
    stall.write_text("#!/bin/sh\n"
                     'if [ "$1" = "--version" ]; then echo "version: 4242 (fake0001)"; exit 0; fi\n'
                     f'if [ "$1" = "--help" ]; then exec "{FAKE_SERVER}" --help; fi\n'  # it answers --help
                     "echo '0.00.120.000 I llama_model_loader: - kv  22: tokenizer.ggml.merges arr[str,48900]' >&2\n"
                     "exec sleep 600\n")
    stall.chmod(0o755)
    run = fake_run(tmp_path, "", {"server": {"binary": str(stall)}, "health": {"load_stall_s": 5.0}})
    runs.append(run)
    t0 = time.monotonic()
    run.start()
    assert run.wait_exit(90) == 78
    took = time.monotonic() - t0
    assert run.names().count("server_load_stalled") == 3
    failure = run.wait_event("server_boot_failure")
    assert "tokenizer.ggml.merges" in failure["line"] and failure["consecutive_starts"] == 3, failure
    assert "load_stall_s" in failure["fix"] and failure["build"] == "version: 4242 (fake0001)", failure
    print(f"a load stalling at the same line: exit 78 after 3 starts in {took:.1f} s")
