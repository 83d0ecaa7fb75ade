"""END-TO-END: ``systemctl stop`` during a GPU reset, under the real ``systemd --user`` manager.

The shipped unit runs the real daemon with the NVML test double (tests/run_with_fake_nvml.py), the
fake llama-server (a CUDA OOM on the first completion: the only way to have a GPU reset here) and a
slow stub reset command (tests/stub_reset.py, which records its run only once it has finished). The
unit's TimeoutStopSec is cut to 4 s: only the daemon's EXTEND_TIMEOUT_USEC keeps systemd from
SIGKILLing the reset mid-way. A second SIGTERM during the command must not interrupt it either.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from harness import FAKE_SERVER, base_sections, config_text, free_port, merge
from test_systemd_e2e import unit_text

if TYPE_CHECKING:
    from systemd_fixtures import PrivateJournald, PrivateUserManager

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(120)]

TESTS = Path(__file__).resolve().parents[1]
RESET_S = 12.0  # how long the stub reset command takes
UNIT_STOP_S = 4  # the unit's TimeoutStopSec in this test: far below the reset's duration


def _stub_running(tag: Path) -> bool:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(w.endswith(b"stub_reset.py") for w in cmd) and str(tag).encode() in cmd:
                return True
    return False


@pytest.fixture
def manager(private_user_manager_with_journal: tuple[PrivateUserManager, PrivateJournald]
            ) -> Iterator[tuple[PrivateUserManager, PrivateJournald]]:
    yield private_user_manager_with_journal
    private_user_manager_with_journal[0].systemctl("kill", "-s", "KILL", "llama-guard.service", timeout_s=30)


def test_stop_during_a_reset_waits_for_the_command_and_ends_within_the_unit(
        manager: tuple[PrivateUserManager, PrivateJournald], tmp_path: Path) -> None:
    mgr, journal = manager
    port = free_port()
    (tmp_path / "fake.gguf").write_bytes(b"GGUF" + bytes(28))
    record = tmp_path / "reset-record.jsonl"
    script = tmp_path / "nvml.json"
    script.write_text(json.dumps({"server_on_gpu": True}))
    sections = merge(base_sections(tmp_path, str(FAKE_SERVER), str(tmp_path / "fake.gguf"), port), {
        "server": {"n_gpu_layers": 99, "env": {"FAKE_LLAMA_FAULT": "oom_runtime", "FAKE_LLAMA_LOAD_S": "0.2"}},
        "health": {"canary": False},
        "gpu": {"enabled": "on", "index": 0, "sample_interval_s": 0.2, "vram_release_timeout_s": 3.0,
                "server_on_gpu_timeout_s": 5.0, "kmsg_path": str(tmp_path / "no-kmsg")},
        "recovery": {"reset_command": [sys.executable, str(TESTS / "stub_reset.py"), "--tag", str(tmp_path),
                                       "--gpu-reset", "-i", "{index}"],
                     "reset_timeout_s": 30.0, "stop_grace_s": 3.0},
        "log": {"level": "info", "format": "journald"},
    })
    config = tmp_path / "llama-guard.toml"
    config.write_text(config_text(sections))
    env = (f"PYTHONPATH={TESTS} FAKE_NVML_SCRIPT={script} FAKE_NVML_STATE={tmp_path / 'nvml-state.json'} "
           f"STUB_RESET_RECORD={record} STUB_RESET_SLEEP_S={RESET_S}")
    text = unit_text(config, watchdog_s=10, extra_env=env)
    text = re.sub(r"^ExecStart=.*$", f"ExecStart={sys.executable} {TESTS / 'run_with_fake_nvml.py'} run "
                                     f"--config {config}", text, flags=re.M)
    text = re.sub(r"^TimeoutStopSec=.*$", f"TimeoutStopSec={UNIT_STOP_S}s", text, flags=re.M)
    mgr.install_unit("llama-guard.service", text)
    assert mgr.systemctl("start", "llama-guard.service", timeout_s=60).returncode == 0, (
        (mgr.base / "manager.log").read_text()[-3000:])
    with pytest.raises(httpx.HTTPError):  # the fake server prints a CUDA OOM block and aborts
        httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "x", "n_predict": 1}, timeout=10.0)
    end = time.monotonic() + 20
    while not _stub_running(tmp_path) and time.monotonic() < end:
        time.sleep(0.05)
    seen = [e.get("LLAMA_GUARD_EVENT") for e in journal.entries("SYSLOG_IDENTIFIER=llama-guard")]
    assert _stub_running(tmp_path), seen
    [started] = journal.entries("LLAMA_GUARD_EVENT=gpu_reset_started")
    assert "the reset command (up to 30 s" in started["WAITS_FOR"], started
    assert "server_oom" in started["TRIGGER"], started

    t0 = time.monotonic()
    assert mgr.systemctl("stop", "--no-block", "llama-guard.service", timeout_s=30).returncode == 0
    end = time.monotonic() + 30  # the daemon took the first stop (it says what it waits for)
    while not journal.entries("LLAMA_GUARD_EVENT=daemon_stopping") and time.monotonic() < end:
        time.sleep(0.1)
    # A second SIGTERM to the daemon: still no interruption.
    assert mgr.systemctl("kill", "--kill-whom=main", "-s", "TERM", "llama-guard.service").returncode == 0
    props = mgr.wait_for("llama-guard.service", RESET_S + 30, ActiveState="inactive")
    stop_s = time.monotonic() - t0
    props = mgr.show("llama-guard.service", "ActiveState", "Result", "ExecMainStatus", "ExecMainCode")
    assert props["ActiveState"] == "inactive", props
    assert props["Result"] == "success" and props["ExecMainStatus"] == "0", props  # not SIGKILLed at 4 s
    # The reset command ran to its end (the stub records only then) and was not killed.
    [run] = [json.loads(x) for x in record.read_text().splitlines()]
    assert run["argv"][-3:] == ["--gpu-reset", "-i", "0"]
    stopping = journal.entries("LLAMA_GUARD_EVENT=daemon_stopping")
    assert len(stopping) == 2, stopping
    assert all(e["WAITING_FOR"] == "gpu_reset" and "never interrupted" in e["REASON"] for e in stopping), stopping
    assert "a second signal does not interrupt it" in stopping[1]["REASON"]
    [reset] = journal.entries("LLAMA_GUARD_EVENT=gpu_reset")
    assert reset["OUTCOME"] == "succeeded", reset
    assert journal.entries("LLAMA_GUARD_EVENT=daemon_exit")[-1]["EXIT_CODE"] == "0"
    print(f"stop during a {RESET_S:.0f} s reset command: unit inactive after {stop_s:.1f} s "
          f"(TimeoutStopSec={UNIT_STOP_S}s, extended by the daemon), exit 0, reset succeeded")
