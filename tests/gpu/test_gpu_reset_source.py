"""GpuSource.reset() in-process, on a FakeNvml: the preconditions and the command's answers.

These run without root (the credentials the reset precondition reads are replaced where a test
needs "root with CAP_SYS_ADMIN"); the whole sequence
with the real daemon is in test_reset_e2e.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from fake_nvml import FakeNvml
from llama_guard.config import Config
from llama_guard.core import privileges
from llama_guard.gpu import DeviceSelector, Nvml, persistence
from llama_guard.gpu.reset import ResetExecutor, run_bounded
from llama_guard.gpu.watcher import GpuSource
from llama_guard.model.inputs import GpuHolder
from llama_guard.model.watcher import Context

TESTS = Path(__file__).resolve().parents[1]


def creds_of(euid: int) -> privileges.Credentials:
    """Credentials of a process with ``euid`` (root: every capability; others: none)."""
    caps = (1 << 41) - 1 if euid == 0 else 0
    return privileges.Credentials(euid, euid, (), caps, caps, 0, 0, (1 << 41) - 1, False)


def make(fake: FakeNvml, command: list[str], tmp: Path, *, euid: int = 0) -> tuple[GpuSource, Context]:
    cfg = Config.model_validate({"gpu": {"vram_release_timeout_s": 1.0},
                                 "recovery": {"reset_command": command, "reset_timeout_s": 2.0,
                                              "foreign_wait_s": 0.3}})
    src = GpuSource()
    src.nvml = Nvml(DeviceSelector(), module=fake)
    src.identity = src.nvml.open()
    src.executor = ResetExecutor(src.nvml, halt_xid=src._halt_xid, resume_xid=src._resume_xid,
                                 credentials=lambda: creds_of(euid), poll_s=0.05)
    src._can_reset = True
    events: list[tuple[str, dict[str, object]]] = []
    ctx = Context(get_config=lambda: cfg,
                  emit=lambda name, **f: events.append((name, f)), post=lambda e: None,
                  post_threadsafe=lambda e: None, clock=lambda: 0.0, loop=asyncio.get_running_loop())
    return src, ctx


@pytest.fixture
def foreign_pid() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "30"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def stub(tmp: Path) -> list[str]:
    return [sys.executable, str(TESTS / "stub_reset.py"), "--gpu-reset", "-i", "{index}"]


async def test_not_root_is_reported_as_a_fact_and_nothing_runs(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STUB_RESET_RECORD", str(tmp_path / "rec"))
    fake = FakeNvml()
    src, ctx = make(fake, stub(tmp_path), tmp_path, euid=1000)
    facts = await src.inspect_reset(ctx, None)
    assert facts.can_run is False and "uid 1000, not root" in facts.cannot_run
    assert facts.gpu_index == 0 and facts.previous_released and facts.holders == ()
    assert not (tmp_path / "rec").exists() and fake.calls["nvmlShutdown"] == 0


async def test_foreign_process_is_named_with_its_mib(tmp_path: Path, foreign_pid: int) -> None:
    fake = FakeNvml()
    fake.gpus[0].values["processes"] = [(foreign_pid, 1 << 30)]
    src, ctx = make(fake, stub(tmp_path), tmp_path)
    facts = await src.inspect_reset(ctx, None)
    assert facts.can_run and facts.holders == (GpuHolder(foreign_pid, 1024, "sleep"),)
    assert fake.calls["nvmlShutdown"] == 0  # NVML was never released: nothing was about to be reset


async def test_previous_server_still_on_the_gpu_is_reported(tmp_path: Path, foreign_pid: int) -> None:
    fake = FakeNvml()
    fake.gpus[0].values["processes"] = [(foreign_pid, 1 << 30)]
    src, ctx = make(fake, stub(tmp_path), tmp_path)
    facts = await src.inspect_reset(ctx, foreign_pid)  # "our" old server that does not leave
    assert facts.previous_released is False and facts.waited_s >= 1.0


async def test_success_releases_nvml_runs_the_command_and_verifies(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STUB_RESET_RECORD", str(tmp_path / "rec"))
    monkeypatch.setenv("STUB_RESET_SLEEP_S", "0")
    fake = FakeNvml()
    src, ctx = make(fake, stub(tmp_path), tmp_path)
    done = await src.reset(ctx, 0)
    assert done.ok and done.exit_status == 0 and done.verified, done
    assert "successfully reset" in done.output and done.command.endswith("--gpu-reset -i 0")
    assert fake.calls["nvmlShutdown"] == 1 and fake.calls["nvmlInit"] == 2  # released, then re-opened
    assert (tmp_path / "rec").read_text().count("--gpu-reset") == 1
    assert not src.nvml.suspended  # type: ignore[union-attr]


async def test_lost_gpu_does_not_block_the_reset_on_the_vram_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   gone_pid: int) -> None:
    # NVML cannot list processes on a lost GPU; the old server having exited must be enough.
    monkeypatch.setenv("STUB_RESET_SLEEP_S", "0")
    fake = FakeNvml()
    src, ctx = make(fake, stub(tmp_path), tmp_path)
    fake.lose_gpu()
    facts = await src.inspect_reset(ctx, gone_pid)
    assert facts.previous_released  # seen gone, not the VRAM-release timeout run out (that one is not released)
    done = await src.reset(ctx, 0)
    # The command ran; the fake GPU stays lost, so the verification fails.
    assert done.exit_status == 0 and not done.verified and not done.ok
    assert "does not answer NVML after the reset" in done.detail, done


async def test_long_failure_output_keeps_its_first_lines() -> None:
    code = ("print('The following GPUs could not be reset:');"
            "print('  GPU 00000000:1A:00.0: In use by another client');"
            "print('advice ' * 200); raise SystemExit(3)")
    status, output, detail = await run_bounded([sys.executable, "-c", code], 10.0)
    assert status == 3 and "exited 3" in detail
    assert "In use by another client" in output and len(output) < 450


async def test_command_past_its_timeout_is_killed() -> None:
    status, _, detail = await run_bounded([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert status is None and "did not finish within" in detail


async def test_missing_command() -> None:
    status, _, detail = await run_bounded(["/nonexistent/nvidia-smi", "--gpu-reset"], 1.0)
    assert status is None and "cannot run /nonexistent/nvidia-smi" in detail


@pytest.mark.parametrize(("euid", "expect_call", "word"), [(0, True, "enabled by llama-guard"),
                                                           (1000, False, "needs llama-guard to run as root")])
async def test_enable_persistence_only_as_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, euid: int,
                                               expect_call: bool, word: str) -> None:
    monkeypatch.setattr(persistence, "reset_precondition", lambda: privileges.reset_precondition(creds_of(euid)))
    fake = FakeNvml()
    src, ctx = make(fake, stub(tmp_path), tmp_path)
    events: list[tuple[str, dict[str, object]]] = []
    ctx.emit = lambda name, **f: events.append((name, f))
    assert src.nvml is not None
    await persistence.enable_persistence(ctx, src.nvml, src._gpu_lane, 0)
    assert (fake.calls["nvmlDeviceSetPersistenceMode"] == 1) is expect_call
    assert events and word in str(events[-1][1]["action"])


async def test_in_use_with_persistence_on_retries_once_with_persistence_off_and_restores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A reset command that fails "In use by another client" the first time and succeeds after.
    script = tmp_path / "reset.py"
    counter = tmp_path / "count"
    script.write_text(
        "import pathlib, sys\n"
        f"p = pathlib.Path({str(counter)!r})\n"
        "n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1))\n"
        "if n == 0:\n"
        "    print('The following GPUs could not be reset:')\n"
        "    print('  GPU 00000000:1A:00.0: In use by another client')\n"
        "    sys.exit(255)\n"
        "print('GPU 00000000:1A:00.0 was successfully reset.')\n")
    fake = FakeNvml()
    fake.gpus[0].values["persistence"] = 1
    src, ctx = make(fake, [sys.executable, str(script)], tmp_path)
    done = await src.reset(ctx, 0)
    assert done.ok, done
    assert counter.read_text() == "2"
    assert fake.persistence_writes == [0, 1]  # off for the retry, then restored
    assert "persistence" in done.fields


async def test_in_use_without_persistence_is_a_plain_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "reset.py"
    script.write_text("import sys\nprint('GPU 0: In use by another client')\nsys.exit(255)\n")
    fake = FakeNvml()
    fake.gpus[0].values["persistence"] = 0
    src, ctx = make(fake, [sys.executable, str(script)], tmp_path)
    done = await src.reset(ctx, 0)
    assert done.exit_status == 255 and not done.ok and "In use" in done.output
    assert fake.persistence_writes == []


def test_gpu_busy_is_the_servers_tree_in_nvml_per_process_samples() -> None:
    # A wrapper (sh) whose child is the process that uses the GPU.
    proc = subprocess.Popen(["/bin/sh", "-c", "sleep 30; true"])
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = psutil.Process(proc.pid).children()[0].pid
        fake = FakeNvml()
        source = GpuSource(nvml_module=fake)
        assert source.gpu_busy(proc.pid) is None  # the watch is off (not started): cannot tell
        source.nvml = Nvml(module=fake)
        assert source.gpu_busy(proc.pid) is False  # an idle GPU
        fake.gpus[0].values["process_util"] = [(child, 64, 20)]
        assert source.gpu_busy(proc.pid) is True
        fake.gpus[0].values["process_util"] = [(4_000_000, 64, 20)]  # someone else's work
        assert source.gpu_busy(proc.pid) is False
        fake.fail("nvmlDeviceGetProcessUtilization", 3)  # no per-process samples on this GPU
        assert source.gpu_busy(proc.pid) is None
        calls = fake.calls["nvmlDeviceGetProcessUtilization"]
        assert source.gpu_busy(proc.pid) is None and fake.calls["nvmlDeviceGetProcessUtilization"] == calls
    finally:
        proc.kill()
        proc.wait()
