"""The daemon stays in charge: nothing blocks its loop, no watcher dies silently, a
server's death is seen at waitpid, the order towards systemd holds, nothing leaks per signal.

Each test is one fault with its sample input (a blocked loop, a hung NVML call, a silent task
death, an escaped or unkillable process, a wrapper binary, undecodable output, the order towards
systemd, a leak or a lost report); every one failed on the code before its fix. In-process tests
drive :class:`Daemon` with small honest watchers and ports (a slow pre-spawn check, a watcher that raises);
the rest run ``llama-guard`` against the real llama-server and model, with a real sd_notify
socket where the order towards systemd matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest
from fake_nvml import FakeNvml
from harness import ROOT, DaemonRun, base_sections, free_port, merge, stop_all, wait_gone
from llama_guard.config import load_config
from llama_guard.core import tasks as tasks_mod
from llama_guard.core.daemon import Daemon
from llama_guard.core.ports import RlimitSettings
from llama_guard.gpu.nvml import Nvml
from llama_guard.gpu.nvml_errors import NvmlHung
from llama_guard.model.inputs import GpuFault, Input, StopRequest
from llama_guard.model.types import GpuFaultKind
from llama_guard.model.watcher import Context, Watcher
from llama_guard.output.eventlog import Emitter
from llama_guard.output.journal import JournalSink
from llama_guard.output.notify import SdNotifier
from llama_guard.vocab.exitcodes import EXIT_CONFIG, EXIT_OK, EXIT_SOFTWARE

pytestmark = pytest.mark.usefixtures("clean_env")


class NotifySocket:
    """A real sd_notify socket (``AF_UNIX`` datagrams), read the way systemd reads it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[tuple[float, str]] = []

    def drain(self) -> list[tuple[float, str]]:
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return self.messages
            self.messages.append((time.monotonic(), data.decode("utf-8", "replace")))

    def close(self) -> None:
        self.sock.close()


def _config(tmp_path: Path, binary: str, model: str | Path, port: int = 18999, **extra: str) -> Path:
    text = (f'[server]\nbinary = "{binary}"\nmodel = "{model}"\nport = {port}\nn_gpu_layers = 0\n'
            f'ctx_size = 512\nthreads = 1\n[gpu]\nenabled = "off"\n[schedule]\nrestart_cron = ""\n'
            f'[runtime]\ndir = "{tmp_path / "run"}"\n[recovery]\nbackoff_initial_s = 0.1\n')
    for section, body in extra.items():
        text += f"[{section}]\n{body}\n"
    path = tmp_path / "lg.toml"
    path.write_text(text)
    return path


class _Recorder(Emitter):
    """An emitter that keeps every event (name, fields) for the test."""

    def __init__(self) -> None:
        super().__init__(min_level="critical", fmt="json", stream=io.StringIO())
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, name: str, **fields: Any) -> None:
        self.events.append((name, fields))
        super().emit(name, **fields)

    def named(self, name: str) -> list[dict[str, Any]]:
        return [f for n, f in self.events if n == name]


# ---------------------------------------------------------------- 1. nothing blocks the loop

class SlowPreSpawn:
    """A child set-up port whose pre-spawn check takes ``wait_s`` (as the wait for the old server's
    VRAM can)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.began = asyncio.Event()
        self.waited_out = False  # the wait ran its whole length

    async def before_spawn(self, ctx: Context, previous_pid: int | None) -> str | None:
        self.began.set()
        await asyncio.sleep(self.wait_s)
        self.waited_out = True
        return None

    def child_rlimits(self) -> RlimitSettings:
        return ()


def test_decision_step_stays_short_and_pings_keep_their_period_during_a_10s_pre_spawn_wait(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """A 10 s pre-spawn wait (the VRAM-release wait) ran inside the decision step: no
    watchdog ping and no stop request for its whole length. Now every step is short, WATCHDOG=1
    keeps its period on a real notify socket, and SIGTERM's stop request ends the daemon at once."""
    manager = NotifySocket(tmp_path / "notify")
    # WatchdogSec=2: a ping is due every second (half of it); pings closer than 0.5 s are skipped.
    notifier = SdNotifier({"NOTIFY_SOCKET": str(manager.path), "WATCHDOG_USEC": "2000000"}, pid=os.getpid())
    slow = SlowPreSpawn(10.0)
    path = _config(tmp_path, str(llama_server_bin), real_model)
    daemon = Daemon(load_config(path), path, _Recorder(), notifier=notifier, child=slow)
    async def go() -> tuple[int, bool]:
        task = asyncio.ensure_future(daemon.run())
        await asyncio.wait_for(slow.began.wait(), 10)
        await asyncio.sleep(3.0)  # the scenario: the stop comes well inside the 10 s wait
        daemon.queue.put_nowait(StopRequest("SIGTERM received"))
        code = await asyncio.wait_for(task, 15)
        return code, slow.waited_out

    try:
        code, waited_out = asyncio.run(go())
        pings = [t for t, text in manager.drain() if text == "WATCHDOG=1"]
    finally:
        manager.close()
    assert code == EXIT_OK
    # The stop request was taken and the daemon ended while the wait still ran: no decision step held the wait
    # (a step inside it would have kept the stop request queued until the wait's end).
    assert not waited_out, "the stop waited for the pre-spawn wait"
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    # WatchdogSec=2: a gap of 2 s is what systemd would act on.
    assert len(pings) >= 3 and max(gaps) < 2.0, f"watchdog pings {len(pings)}, largest gap {max(gaps):.2f} s"


def _fifo(tmp_path: Path) -> Path:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    return fifo


def test_fifo_model_fails_check_at_once(tmp_path: Path, llama_server_bin: Path) -> None:
    """`llama-guard check` with a FIFO as [server].model hung forever in open()."""
    path = _config(tmp_path, str(llama_server_bin), _fifo(tmp_path))
    out = subprocess.run([sys.executable, "-m", "llama_guard", "check", "--config", str(path)],
                         capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert out.returncode == EXIT_CONFIG, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    line = next(x for x in out.stdout.splitlines() if " model " in x)
    assert line.startswith("FAIL") and "FIFO" in line and "not a regular file" in line


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_model_that_is_not_a_regular_file_ends_run_with_78(tmp_path: Path, llama_server_bin: Path,
                                                          kind: str) -> None:
    """`run` with a FIFO model started llama-server onto it (it blocked in open); a
    directory went the same way. Now a configuration error at once: exit 78."""
    if kind == "fifo":
        model = _fifo(tmp_path)
    else:
        model = tmp_path / "models"
        model.mkdir()
    path = _config(tmp_path, str(llama_server_bin), model)
    out = subprocess.run([sys.executable, "-m", "llama_guard", "run", "--config", str(path)],
                         capture_output=True, text=True, timeout=60, cwd=str(ROOT))  # blocked in open: never exits
    assert out.returncode == EXIT_CONFIG, out.stderr[-2000:]
    assert "not a regular file" in out.stderr


def test_fifo_model_on_reload_is_refused_at_once_and_never_starves(tmp_path: Path, llama_server_bin: Path,
                                                                   real_model: Path) -> None:
    """Each reload naming a FIFO model took a default-executor thread for good; six starved
    it and the daemon stopped acting. Now each one is refused at once (config_error), READY=1
    follows each, and a later good reload still applies."""
    path = _config(tmp_path, str(llama_server_bin), real_model)
    good = path.read_text()
    manager = NotifySocket(tmp_path / "notify")
    notifier = SdNotifier({"NOTIFY_SOCKET": str(manager.path)}, pid=os.getpid())
    emitter = _Recorder()
    daemon = Daemon(load_config(path), path, emitter, notifier=notifier)
    fifo = _fifo(tmp_path)

    async def go() -> None:
        daemon.ctx = Context(get_config=lambda: daemon.config, initial=daemon.state,
                             emit=emitter.emit, post=daemon.queue.put_nowait,
                             post_threadsafe=daemon.queue.put_nowait, clock=time.monotonic,
                             loop=asyncio.get_running_loop())
        path.write_text(good.replace(str(real_model), str(fifo)))
        for _ in range(8):
            # each within 5 s: below one model-check timeout (MODEL_CHECK_TIMEOUT_S, 10 s), so none waited one out
            await asyncio.wait_for(daemon.reloader.reload(), 5)
            manager.drain()  # as systemd reads: the datagram queue is short
        path.write_text(good.replace("threads = 1", "threads = 2"))
        await asyncio.wait_for(daemon.reloader.reload(), 5)

    try:
        asyncio.run(go())
        messages = [text for _, text in manager.drain()]
    finally:
        manager.close()
    errors = emitter.named("config_error")
    assert len(errors) == 8 and all("FIFO" in e["reason"] for e in errors)
    assert daemon.config.server.threads == 2  # the good reload after them applied
    assert sum(m.startswith("READY=1") for m in messages) == 9


# ---------------------------------------------------------------- 2. NVML behind a deadline

def test_hung_nvml_call_raises_in_time_names_the_call_and_does_not_pile_up() -> None:
    """A hung NVML call blocked the sampler for good (no gpu_lost, workers piling up
    behind its lock, shutdown hanging on it). Now the call times out naming itself, later calls
    fail at once, close() returns at once, and a call that comes back heals the session."""
    fake = FakeNvml()
    nvml = Nvml(module=fake, call_timeout_s=0.3)
    nvml.open()
    fake.hang("nvmlDeviceGetTemperature")
    t0 = time.monotonic()
    with pytest.raises(NvmlHung) as first:
        nvml.sample()
    assert first.value.call == "nvmlDeviceGetTemperature" and first.value.first
    assert time.monotonic() - t0 >= 0.25  # its timeout (returning at all: the call itself never does)
    with pytest.raises(NvmlHung) as later:
        nvml.sample()
    assert not later.value.first  # refused, not a second call stuck behind it
    nvml.close()  # returns while the call is still stuck: not held up by it
    assert nvml.stuck_call is not None
    fake.unhang("nvmlDeviceGetTemperature")
    deadline = time.monotonic() + 2
    while nvml.stuck_call is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nvml.sample().temperature_c == 45


def test_hung_nvml_degrades_the_gpu_watch_then_counts_as_a_lost_gpu(tmp_path: Path) -> None:
    """Through the GPU watcher: gpu_nvml_timeout names the call, the watch says degraded,
    and a hang that persists is posted as a lost GPU; closing the watcher stays bounded."""
    from llama_guard.gpu.watcher import GpuSource

    fake = FakeNvml()
    path = _config(tmp_path, "/bin/true", tmp_path / "m.gguf",
                   gpu='enabled = "on"\nsample_interval_s = 0.1\nkmsg_path = "/nonexistent/kmsg"')
    path.write_text(path.read_text().replace('[gpu]\nenabled = "off"\n', ""))
    config = load_config(path)
    emitter = _Recorder()
    posted: list[Input] = []
    source = GpuSource(nvml_module=fake, nvml_call_timeout_s=0.3, hung_as_lost_s=1.0)

    async def go() -> None:
        ctx = Context(get_config=lambda: config,
                      emit=emitter.emit, post=posted.append, post_threadsafe=posted.append,
                      clock=time.monotonic, loop=asyncio.get_running_loop())
        assert await source.start(ctx) is None
        task = asyncio.ensure_future(source.run(ctx))
        await asyncio.sleep(0.3)
        fake.hang("nvmlDeviceGetPowerUsage")
        deadline = time.monotonic() + 10
        while not any(isinstance(p, GpuFault) for p in posted) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        task.cancel()
        await source.close()  # returns while the call is still stuck (it is unhung only below)

    asyncio.run(go())
    timeouts = emitter.named("gpu_nvml_timeout")
    assert len(timeouts) == 1 and timeouts[0]["call"] == "nvmlDeviceGetPowerUsage"
    faults = [p for p in posted if isinstance(p, GpuFault)]
    assert len(faults) == 1 and faults[0].kind is GpuFaultKind.GPU_LOST
    assert "nvmlDeviceGetPowerUsage" in faults[0].reason
    assert source.degraded and (source.snapshot() or {})["watch"].startswith("degraded")
    fake.unhang("nvmlDeviceGetPowerUsage")


# ---------------------------------------------------------------- 3. every task supervised

class Raising(Watcher):
    """A watcher whose run() raises every time (a bug in a watcher)."""

    name = "raising"

    def __init__(self) -> None:
        self.runs = 0

    async def run(self, ctx: Context) -> None:
        self.runs += 1
        await asyncio.sleep(0.01)
        raise ValueError(f"watcher bug #{self.runs}")


def test_watcher_that_raises_is_reported_restarted_and_then_ends_the_daemon_with_70(
        tmp_path: Path, llama_server_bin: Path, real_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watcher task that raised ended silently (collected only at shutdown). Now each
    failure is a watcher_failed event with the exception, the watcher is restarted with backoff,
    and one that keeps failing ends the daemon with exit 70 (systemd restarts it)."""
    monkeypatch.setattr(tasks_mod, "WATCHER_BACKOFF_S", 0.05)
    path = _config(tmp_path, str(llama_server_bin), real_model)
    emitter = _Recorder()
    raising = Raising()
    daemon = Daemon(load_config(path), path, emitter, watchers=[raising])
    code = asyncio.run(asyncio.wait_for(daemon.run(), 60))
    failed = emitter.named("watcher_failed")
    assert code == EXIT_SOFTWARE
    assert raising.runs == tasks_mod.WATCHER_MAX_FAILURES + 1
    assert [f["failures"] for f in failed] == list(range(1, tasks_mod.WATCHER_MAX_FAILURES + 2))
    assert "ValueError: watcher bug #1" in failed[0]["error"] and "restarting" in failed[0]["action"]
    assert "exiting with status 70" in failed[-1]["action"]
    assert emitter.named("daemon_exit")[-1]["exit_code"] == EXIT_SOFTWARE


class BrokenReadyCheck:
    """A KV slot port whose restore (the check before ready) raises: a failure inside the daemon's
    own health task."""

    async def before_spawn(self, ctx: Context, binary: Path, env: Mapping[str, str]) -> None:
        return None

    async def restore(self, ctx: Context, pid: int) -> None:
        raise RuntimeError("ready check bug")

    async def after_drain(self, ctx: Context, pid: int) -> None:
        return None

    async def before_reset_stop(self, ctx: Context, pid: int) -> None:
        return None


def test_failure_in_a_core_task_ends_the_daemon_with_70_and_stops_the_server(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """The per-server tasks (output, health) were fire-and-forget: an exception there left
    the server unwatched for good. Now it is a watcher_failed event and exit 70, server stopped."""
    port = free_port()
    path = _config(tmp_path, str(llama_server_bin), real_model, port=port)
    emitter = _Recorder()
    daemon = Daemon(load_config(path), path, emitter, slots=BrokenReadyCheck())
    code = asyncio.run(asyncio.wait_for(daemon.run(), 120))
    assert code == EXIT_SOFTWARE
    failed = emitter.named("watcher_failed")
    assert failed and failed[0]["watcher"] == "core.health probe" and "ready check bug" in failed[0]["error"]
    pid = emitter.named("server_starting")[0]["server_pid"]
    assert wait_gone(pid, 5)


# ---------------------------------------------------------------- 7. order towards systemd, 8. leaks

def test_reloads_leave_no_finished_tasks_behind(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """Each SIGHUP left a finished task in a list for the daemon's lifetime (RSS grew
    linearly). Now SIGHUP goes through the queue and finished tasks are dropped."""
    path = _config(tmp_path, str(llama_server_bin), real_model)
    emitter = _Recorder()
    daemon = Daemon(load_config(path), path, emitter, child=SlowPreSpawn(60.0))

    async def go() -> tuple[int, int]:
        task = asyncio.ensure_future(daemon.run())
        await asyncio.sleep(0.5)
        before = len(daemon.tasks.tasks)
        for _ in range(200):
            os.kill(os.getpid(), signal.SIGHUP)
            await asyncio.sleep(0.005)
        deadline = time.monotonic() + 10
        reload = daemon.reloader.task
        if reload is not None:
            await asyncio.wait([reload], timeout=max(0.0, deadline - time.monotonic()))
        await asyncio.sleep(0.1)
        after = len(daemon.tasks.tasks)
        daemon.queue.put_nowait(StopRequest("test over"))
        await asyncio.wait_for(task, 10)
        return before, after

    before, after = asyncio.run(go())
    assert len(emitter.named("config_reloaded")) + len(emitter.named("reload_ignored")) == 200
    assert after <= before


def test_failing_status_write_is_an_event_and_leaves_no_empty_pid_file(tmp_path: Path) -> None:
    """A status write that failed was a bare stderr line (no journald event), and a pid
    file write that failed half-way left an empty pid file."""
    from llama_guard.status.status import PID_NAME, StatusFile

    run = tmp_path / "run"
    run.mkdir()
    reasons: list[str] = []
    status = StatusFile(run, on_error=reasons.append)
    # A full disk, as a file size limit: every write of data fails with EFBIG after open().
    code = ("import resource, signal, sys, json; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0));"
            "from pathlib import Path; from llama_guard.status.status import StatusFile;"
            "r = []; StatusFile(Path(sys.argv[1]), on_error=r.append).write({'a': 1}); print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=30,
                         cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT / "supervisor")})
    assert out.returncode == 0, out.stderr
    assert "too large" in out.stdout.lower() or "File too large" in out.stdout
    assert not (run / PID_NAME).exists()  # never an empty pid file
    assert [p.name for p in run.iterdir()] == []
    status.write({"ok": True})
    assert reasons == [] and (run / PID_NAME).read_text().strip() == str(os.getpid())


def test_daemon_reports_a_failing_status_write_as_an_event(tmp_path: Path) -> None:
    """The daemon's status file reports through the event log (status_write_failed)."""
    blocker = tmp_path / "run"
    blocker.write_text("a file where the runtime directory should be")
    path = _config(tmp_path, "/bin/true", tmp_path / "m.gguf")
    emitter = _Recorder()
    daemon = Daemon(load_config(path), path, emitter)
    daemon.status.write()
    daemon.status.write()
    events = emitter.named("status_write_failed")
    assert len(events) == 1 and events[0]["runtime_dir"] == str(blocker)


def test_journal_fallback_follows_the_log_level(tmp_path: Path) -> None:
    """With the journal socket gone, the stderr fallback printed every server line (debug)
    although [log].level = "info"."""
    stream = io.StringIO()
    sink = JournalSink(tmp_path / "no-journal-socket", fallback=stream, level_prefix=False)
    emitter = Emitter(min_level="info", fmt="json", stream=io.StringIO(), sinks=[sink], sink_level="debug")
    emitter.set_level("info")
    emitter.emit("server_line", server_pid=1, line="srv  update_slots: debug chatter", family="harmless")
    emitter.emit("server_exited", server_pid=1, exit_text="exit status 1", phase="ready")
    assert sink.flush(5)
    text = stream.getvalue()
    assert "debug chatter" not in text and "server_exited" in text
    emitter.set_level("debug")
    emitter.emit("server_line", server_pid=1, line="now shown", family="harmless")
    assert sink.flush(5)
    assert "now shown" in stream.getvalue()
    sink.close()


# ---------------------------------------------------------------- end to end against the real server

@pytest.fixture
def runs() -> Any:
    started: list[DaemonRun] = []
    ports: list[int] = []
    yield started, ports
    leftovers = stop_all(started, ports)
    assert not leftovers, f"llama-server outlived its daemon: {leftovers}"


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _sections(tmp_path: Path, binary: str, model: Path, port: int) -> dict[str, dict[str, object]]:
    return merge(base_sections(tmp_path, binary, str(model), port),
                 {"health": {"interval_s": 30.0}, "recovery": {"stop_grace_s": 3.0}})


def test_setsid_grandchild_holding_stdout_does_not_hide_the_servers_death(
        tmp_path: Path, llama_server_bin: Path, real_model: Path, runs: Any) -> None:
    """A grandchild that left the process group (setsid) kept the server's stdout open:
    a kill -9 of the server was noticed only ~29 s later, as a hang. Now the exit is seen from
    waitpid within about a second, the grandchild is named and killed."""
    started, ports = runs
    port = free_port()
    ports.append(port)
    nap = f"600.{os.getpid()}{port}"  # this test's own sleeps (another worker may run one too)
    wrapper = _script(tmp_path, "llama-server-setsid", (
        "#!/bin/sh\n"
        f"setsid sleep {nap} &\n"
        f'exec "{llama_server_bin}" "$@"\n'))
    run = DaemonRun(tmp_path, _sections(tmp_path, str(wrapper), real_model, port)).start()
    started.append(run)
    pid = run.wait_event("server_ready", 120)["server_pid"]
    escaped = [p for p in psutil.process_iter(["pid", "cmdline"])
               if (p.info["cmdline"] or [])[:2] == ["sleep", nap] and p.pid != pid]
    assert escaped, "the setsid grandchild did not start"
    os.kill(pid, signal.SIGKILL)
    # Noticed while the grandchild (sleep 600) still holds the server's output: not at the pipe's end.
    exited = run.wait_event("server_exited", 30, where=lambda e: e["server_pid"] == pid)
    assert exited["signal"] == signal.SIGKILL
    named = run.wait_event("server_escaped_process", 5)
    assert named["escaped_pid"] in {p.pid for p in escaped} and named["escaped_name"] == "sleep"
    # The one that held the server's output is gone; other "sleep {nap}"s are the wrapper's own runs
    # for llama-guard's probes of the binary (--help, --version), which hold no server output.
    assert wait_gone(named["escaped_pid"], 5)
    assert "server_hang" not in run.names()
    run.wait_event("server_ready", 120, skip=1)
    for p in psutil.process_iter(["cmdline"]):
        if (p.info["cmdline"] or [])[:2] == ["sleep", nap]:
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_wrapper_script_that_forks_the_server_becomes_ready(
        tmp_path: Path, llama_server_bin: Path, real_model: Path, runs: Any) -> None:
    """A `binary` that is a wrapper forking the real llama-server never became ready
    (readiness insisted that the direct child owns the port). Now a descendant may own it, and
    server_ready says which."""
    started, ports = runs
    wrapper = _script(tmp_path, "llama-server-wrapper", (
        "#!/bin/sh\n"
        f'"{llama_server_bin}" "$@" &\n'
        "wait $!\n"))
    port = free_port()
    ports.append(port)
    run = DaemonRun(tmp_path, _sections(tmp_path, str(wrapper), real_model, port)).start()
    started.append(run)
    ready = run.wait_event("server_ready", 120)
    assert ready["port_pid"] != ready["server_pid"]
    assert psutil.Process(ready["port_pid"]).ppid() == ready["server_pid"]
    assert "descendant" in ready["port_owner"]
    run.signal(signal.SIGTERM)
    assert run.wait_exit(30) == EXIT_OK
    assert wait_gone(ready["port_pid"], 5)


def _odd_binary(tmp_path: Path, llama_server_bin: Path) -> Path:
    """A llama-server whose --help also prints bytes that are not UTF-8 (a build with a Latin-1
    banner); otherwise the real server."""
    return _script(tmp_path, "llama-server-odd", (
        "#!/bin/sh\n"
        'if [ "$1" = "--help" ]; then printf "\\377\\376 caf\\351 build\\n"; fi\n'
        f'exec "{llama_server_bin}" "$@"\n'))


def test_binary_printing_non_utf8_help_check_has_no_traceback(tmp_path: Path, llama_server_bin: Path,
                                                              real_model: Path) -> None:
    """`check` died with a UnicodeDecodeError traceback on a binary whose --help is not UTF-8."""
    odd = _odd_binary(tmp_path, llama_server_bin)
    path = _config(tmp_path, str(odd), real_model)
    out = subprocess.run([sys.executable, "-m", "llama_guard", "check", "--config", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert "Traceback" not in out.stderr, out.stderr
    lines = {x.split()[1]: x.split()[0] for x in out.stdout.splitlines() if len(x.split()) > 1}
    assert lines.get("binary") == "OK" and lines.get("flags") == "OK", out.stdout


def test_binary_printing_non_utf8_help_runs_with_mlock(tmp_path: Path, llama_server_bin: Path,
                                                       real_model: Path, runs: Any) -> None:
    """`run` with mlock = true exited 70 ("internal error: UnicodeDecodeError")."""
    started, ports = runs
    odd = _odd_binary(tmp_path, llama_server_bin)
    port = free_port()
    ports.append(port)
    sections = _sections(tmp_path, str(odd), real_model, port)
    sections["server"]["mlock"] = True
    run = DaemonRun(tmp_path, sections).start()
    started.append(run)
    starting = run.wait_event("server_starting", 60)
    assert "--mlock" in starting["argv"] or "mmap+mlock" in starting["argv"]
    run.wait_event("server_ready", 120)
    run.signal(signal.SIGTERM)
    assert run.wait_exit(30) == EXIT_OK


def test_sighup_right_after_sigterm_sends_no_ready_after_stopping(
        tmp_path: Path, llama_server_bin: Path, real_model: Path, runs: Any) -> None:
    """A SIGHUP one second after SIGTERM sent READY=1 during the stop, and STOPPING=1 went
    out only when the server was gone. Read from a real notify socket: STOPPING=1 first, no
    READY=1 after it, the reload ignored with an event."""
    started, ports = runs
    manager = NotifySocket(tmp_path / "notify")
    # A wrapper that takes 2 s to stop (as a server finishing its requests would): the SIGHUP
    # surely arrives during the stop.
    slow_stop = _script(tmp_path, "llama-server-slow-stop", (
        "#!/bin/sh\n"
        f'"{llama_server_bin}" "$@" &\n'
        "child=$!\n"
        "trap 'sleep 2; kill $child 2>/dev/null; exit 0' TERM\n"
        "wait $child\n"))
    port = free_port()
    ports.append(port)
    sections = _sections(tmp_path, str(slow_stop), real_model, port)
    sections["recovery"]["stop_grace_s"] = 10.0
    run = DaemonRun(tmp_path, sections, env={"NOTIFY_SOCKET": str(manager.path)}).start()
    started.append(run)
    try:
        run.wait_event("server_ready", 120)
        time.sleep(0.3)
        run.signal(signal.SIGTERM)
        time.sleep(0.3)
        run.signal(signal.SIGHUP)
        assert run.proc is not None
        deadline = time.monotonic() + 30
        while run.proc.poll() is None and time.monotonic() < deadline:
            manager.drain()
            time.sleep(0.02)
        exited_at = time.monotonic()
        assert run.wait_exit(1) == EXIT_OK
        received = manager.drain()
        messages = [text for _, text in received]
    finally:
        manager.close()
    kinds = [m.splitlines()[0] for m in messages]
    assert "STOPPING=1" in kinds
    first_stop = kinds.index("STOPPING=1")
    assert "READY=1" not in kinds[first_stop:], kinds
    assert kinds.index("READY=1") < first_stop
    ignored = run.wait_event("reload_ignored", 1)
    assert "stopping" in ignored["reason"]
    # STOPPING=1 went out when the stop began, not when the server was gone (its stop takes 2 s).
    stopping_at = next(t for t, text in received if text.startswith("STOPPING=1"))
    assert exited_at - stopping_at > 1.5


def test_status_and_restart_import_only_what_they_use(tmp_path: Path) -> None:
    """`llama-guard status` imported pydantic, an HTTP client and asyncio (0.22 s) to read one JSON
    file. Now it imports none of them, with --runtime-dir or with a config file."""
    config = tmp_path / "lg.toml"
    config.write_text(f'[runtime]\ndir = "{tmp_path / "run"}"\n')
    code = ("import sys; from llama_guard.app.cli import main; main(sys.argv[1:]);"
            "print(sorted(m for m in ('pydantic', 'httpx', 'aiohttp', 'asyncio', 'pydantic_settings')"
            " if m in sys.modules))")
    for argv in (["status", "--runtime-dir", str(tmp_path / "run")], ["status", "--config", str(config)],
                 ["restart", "--config", str(config)]):
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=30,
                             cwd=str(ROOT))
        assert out.stdout.strip().splitlines()[-1] == "[]", (argv, out.stdout, out.stderr)
        assert str(tmp_path / "run") in out.stderr  # it looked in the configured directory


def test_kernel_log_thread_that_raises_is_reported_restarted_then_fails_its_watcher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel-log thread had no handler at all: an exception ended Xid detection from
    the kernel log silently. Now each failure is watcher_failed, the reader is restarted with
    backoff, and one that keeps failing makes the GPU watcher task raise (supervised: exit 70)."""
    from llama_guard.gpu import kmsg
    from llama_guard.gpu.watcher import GpuSource
    from llama_guard.gpu.xid_intake import KMSG_MAX_FAILURES

    def broken_poll(self: Any, timeout_s: float) -> list[str]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(kmsg.KmsgReader, "poll", broken_poll)
    log = tmp_path / "kmsg"
    log.write_text("")
    path = _config(tmp_path, "/bin/true", tmp_path / "m.gguf",
                   gpu=f'enabled = "on"\nsample_interval_s = 0.05\nkmsg_path = "{log}"')
    path.write_text(path.read_text().replace('[gpu]\nenabled = "off"\n', ""))
    config = load_config(path)
    emitter = _Recorder()
    source = GpuSource(nvml_module=FakeNvml())
    source.kmsg_backoff_s = 0.01

    async def go() -> BaseException | None:
        ctx = Context(get_config=lambda: config,
                      emit=emitter.emit, post=lambda _: None, post_threadsafe=lambda _: None,
                      clock=time.monotonic, loop=asyncio.get_running_loop())
        assert await source.start(ctx) is None
        try:
            await asyncio.wait_for(source.run(ctx), 10)
        except RuntimeError as exc:
            return exc
        finally:
            await source.close()
        return None

    error = asyncio.run(go())
    failed = [f for f in emitter.named("watcher_failed") if f["watcher"] == "gpu.kmsg"]
    assert len(failed) == KMSG_MAX_FAILURES and "Input/output error" in failed[0]["error"]
    assert "restarting" in failed[0]["action"] and "giving up" in failed[-1]["action"]
    assert error is not None and "kernel-log reader failed" in str(error)
