"""END-TO-END: the real llama-guard.service under a private ``systemd --user`` manager.

Marked ``real`` and ``systemd``: they need the real llama-server and the SmolLM2 model
(conftest: ``$LLAMA_SERVER_BIN``, ``$LLAMA_GUARD_TEST_MODEL``; a failure in CI, never a skip),
plus the private user manager and journald from tests/systemd_fixtures.py.

The shipped unit is used with only what a test must change rewritten: ExecStart's binary and
config path, User/Group (the manager runs as root), shorter timeouts, and the sandboxing that a
user manager cannot apply. ``llama-guard run`` must send sd_notify messages through
``llama_guard.output.notify.SdNotifier`` (wiring.make_notifier).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from harness import SERVER_THREADS, free_port

if TYPE_CHECKING:
    from systemd_fixtures import PrivateJournald, PrivateUserManager

pytestmark = [pytest.mark.real, pytest.mark.systemd]

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "llama-guard.service"
LLAMA_GUARD = ROOT / ".venv" / "bin" / "llama-guard"

# Sandboxing a root-run user manager cannot set up; the system unit keeps all of it.
_DROP = re.compile(r"^(User|Group|SupplementaryGroups|AmbientCapabilities|CapabilityBoundingSet|DevicePolicy|"
                   r"DeviceAllow|ProtectSystem|ProtectHome|PrivateTmp|ProtectKernelModules|"
                   r"ProtectControlGroups|ProtectClock|ProtectHostname|RestrictNamespaces|"
                   r"StateDirectory|LogsDirectory|WorkingDirectory|RuntimeDirectory|"
                   r"EnvironmentFile)=.*$", re.M)


def write_config(path: Path, server: Path, port: int, runtime: Path, *, model: Path) -> Path:
    path.write_text(f"""
[server]
binary = "{server}"
model = "{model}"
host = "127.0.0.1"
port = {port}
n_gpu_layers = 0
ctx_size = 1024
parallel = 1
cache_type_k = "f16"
cache_type_v = "f16"
flash_attn = "off"
threads = {SERVER_THREADS}

[health]
interval_s = 1.0
load_timeout_s = 60.0
canary = false

[gpu]
enabled = "off"

[recovery]
stop_grace_s = 5.0
backoff_initial_s = 0.5

[limits]
nofile = 65536

[runtime]
dir = "{runtime}"
""")
    return path


def unit_text(config: Path, *, watchdog_s: int = 3, extra_env: str = "") -> str:
    text = UNIT.read_text()
    text = text.replace("/opt/llama-guard/bin/llama-guard", str(LLAMA_GUARD))
    text = text.replace("/etc/llama-guard/llama-guard.toml", str(config))
    text = _DROP.sub("", text)
    text = re.sub(r"^WatchdogSec=.*$", f"WatchdogSec={watchdog_s}s", text, flags=re.M)
    text = re.sub(r"^RestartSec=.*$", "RestartSec=1s", text, flags=re.M)
    text = re.sub(r"^TimeoutStartSec=.*$", "TimeoutStartSec=60s", text, flags=re.M)
    text = re.sub(r"^TimeoutAbortSec=.*$", "TimeoutAbortSec=3s", text, flags=re.M)
    text = text.replace("[Install]", f"Environment=CUDA_VISIBLE_DEVICES= {extra_env}\n\n[Install]")
    return text


@pytest.fixture
def env(private_user_manager_with_journal: tuple[PrivateUserManager, PrivateJournald],
        tmp_path: Path, llama_server_bin: Path,
        real_model: Path) -> Iterator[tuple[PrivateUserManager, PrivateJournald, Path, str]]:
    """(manager, journal, config path, extra unit Environment) for the real unit."""
    server = llama_server_bin
    extra = ""
    manager, journal = private_user_manager_with_journal
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    config = write_config(tmp_path / "llama-guard.toml", server, free_port(), runtime, model=real_model)
    yield manager, journal, config, extra
    manager.systemctl("stop", "llama-guard.service", timeout_s=60)


def _server_pids(server_binary_name: str = "llama-server") -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "comm").read_text().strip() == server_binary_name:
                    pids.add(int(proc.name))
            except OSError:
                continue
    return pids


def test_start_returns_after_ready_with_status_and_stop_leaves_nothing(
        env: tuple[PrivateUserManager, PrivateJournald, Path, str]) -> None:
    manager, journal, config, extra = env
    manager.install_unit("llama-guard.service", unit_text(config, extra_env=extra))
    t0 = time.monotonic()
    result = manager.systemctl("start", "llama-guard.service", timeout_s=90)
    start_s = time.monotonic() - t0
    assert result.returncode == 0, result.stderr + (manager.base / "manager.log").read_text()[-3000:]
    props = manager.show("llama-guard.service", "ActiveState", "SubState", "StatusText", "MainPID")
    assert props["ActiveState"] == "active"
    assert props["SubState"] == "running"
    assert props["StatusText"].startswith("ready"), props
    # READY came after /health answered: server_ready is in the journal by now.
    ready = journal.entries("LLAMA_GUARD_EVENT=server_ready")
    assert len(ready) == 1
    server_pid = int(ready[0]["SERVER_PID"])
    assert server_pid in manager.unit_pids("llama-guard.service")
    assert journal.entries("LLAMA_SERVER_LINE=1"), "the server's own lines reach the journal"
    server_env = Path(f"/proc/{server_pid}/environ").read_bytes().split(b"\0")
    assert not [v for v in server_env if v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_"))]
    print(f"systemctl start returned after {start_s:.2f} s")

    result = manager.systemctl("stop", "llama-guard.service", timeout_s=60)
    assert result.returncode == 0
    assert manager.show("llama-guard.service", "ActiveState")["ActiveState"] == "inactive"
    assert not Path(f"/proc/{server_pid}").exists()
    assert manager.unit_pids("llama-guard.service") == []


def test_frozen_daemon_is_killed_by_the_watchdog_and_restarted(
        env: tuple[PrivateUserManager, PrivateJournald, Path, str]) -> None:
    manager, journal, config, extra = env
    manager.install_unit("llama-guard.service", unit_text(config, watchdog_s=3, extra_env=extra))
    assert manager.systemctl("start", "llama-guard.service", timeout_s=90).returncode == 0
    first = int(manager.show("llama-guard.service", "MainPID")["MainPID"])
    [first_server] = [int(e["SERVER_PID"]) for e in journal.entries("LLAMA_GUARD_EVENT=server_ready")]
    os.kill(first, signal.SIGSTOP)
    t0 = time.monotonic()
    # WatchdogSec=3 s without a ping: SIGABRT (not delivered to a stopped process), then SIGKILL
    # after TimeoutAbortSec=3 s; the unit waits RestartSec=1 s in "auto-restart" with
    # Result=watchdog.
    props = manager.wait_for("llama-guard.service", 20, SubState="auto-restart")
    assert props.get("SubState") == "auto-restart", props
    killed_s = time.monotonic() - t0
    assert manager.show("llama-guard.service", "Result")["Result"] == "watchdog"  # the watchdog's kill, no other
    assert not Path(f"/proc/{first}").exists()
    assert not Path(f"/proc/{first_server}").exists()  # the server went with it (KillMode=mixed)

    props = manager.wait_for("llama-guard.service", 40, NRestarts="1", ActiveState="active", SubState="running")
    assert props == {"NRestarts": "1", "ActiveState": "active", "SubState": "running"}, props
    waited = time.monotonic() - t0
    second = int(manager.show("llama-guard.service", "MainPID")["MainPID"])
    assert second != first
    assert len(journal.entries("LLAMA_GUARD_EVENT=server_ready")) == 2
    print(f"watchdog: killed after {killed_s:.1f} s, ready again after {waited:.1f} s")


def test_config_error_exits_78_and_is_not_restarted(
        env: tuple[PrivateUserManager, PrivateJournald, Path, str]) -> None:
    manager, _journal, config, extra = env
    config.write_text(config.read_text() + "\n[nonsense]\nkey = 1\n")
    manager.install_unit("llama-guard.service", unit_text(config, extra_env=extra))
    result = manager.systemctl("start", "llama-guard.service", timeout_s=60)
    assert result.returncode != 0
    props = manager.wait_for("llama-guard.service", 10, ActiveState="failed")
    props = manager.show("llama-guard.service", "ActiveState", "SubState", "ExecMainStatus", "NRestarts", "Result")
    assert props["ExecMainStatus"] == "78", props
    # systemd decides at the exit: a unit it will restart waits in SubState=auto-restart; "failed" is final.
    assert props["ActiveState"] == "failed" and props["SubState"] == "failed", props
    assert props["NRestarts"] == "0", props


def test_sighup_reload_sends_reloading_then_ready(
        env: tuple[PrivateUserManager, PrivateJournald, Path, str]) -> None:
    manager, journal, config, extra = env
    manager.install_unit("llama-guard.service", unit_text(config, extra_env=extra))
    assert manager.systemctl("start", "llama-guard.service", timeout_s=90).returncode == 0
    pid = manager.show("llama-guard.service", "MainPID")["MainPID"]
    assert manager.systemctl("reload", "llama-guard.service", timeout_s=30).returncode == 0
    props = manager.wait_for("llama-guard.service", 15, ActiveState="active", SubState="running")
    assert props["ActiveState"] == "active"
    assert manager.show("llama-guard.service", "MainPID")["MainPID"] == pid  # reloaded, not restarted
    assert journal.entries("LLAMA_GUARD_EVENT=config_reloaded")


def test_daemon_protocol_at_the_socket_start_reload_stop(
        env: tuple[PrivateUserManager, PrivateJournald, Path, str], tmp_path: Path) -> None:
    """The real daemon, no manager: the exact sd_notify sequence READY → RELOADING → READY →
    STOPPING, and WATCHDOG=1 pings, as seen on a bound NOTIFY_SOCKET."""
    _manager, _journal, config, extra = env
    address = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    run_env = dict(os.environ, NOTIFY_SOCKET=address, WATCHDOG_USEC="2000000")
    run_env.pop("WATCHDOG_PID", None)
    if extra:
        run_env["PYTHONPATH"] = extra.split("=", 1)[1]
    proc = subprocess.Popen([str(LLAMA_GUARD), "run", "--config", str(config)], env=run_env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr", "wb"))  # noqa: SIM115
    msgs: list[str] = []

    def until(prefix: str, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            sock.settimeout(max(0.01, end - time.monotonic()))
            try:
                msgs.append(sock.recv(65536).decode())
            except TimeoutError:
                break
            if msgs[-1].startswith(prefix):
                return
        raise AssertionError(f"no {prefix} within {timeout_s} s: {msgs}")

    try:
        until("READY=1", 60)
        proc.send_signal(signal.SIGHUP)
        until("RELOADING=1", 10)
        until("READY=1", 10)
        until("WATCHDOG=1", 3)
        proc.send_signal(signal.SIGTERM)
        until("STOPPING=1", 10)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        sock.close()
    heads = [m.split("\n")[0] for m in msgs if not m.startswith(("WATCHDOG", "STATUS", "EXTEND_TIMEOUT_USEC"))]
    assert heads == ["READY=1", "RELOADING=1", "READY=1", "STOPPING=1"], msgs
    reload_msg = next(m for m in msgs if m.startswith("RELOADING=1"))
    assert re.search(r"^MONOTONIC_USEC=\d+$", reload_msg, re.M), reload_msg


SOCKET_UNIT = ROOT / "deploy" / "systemd" / "llama-guard.socket"


def _livez(port: int) -> str:
    """One client: a new connection, ``GET /livez`` through the front door; "answered", "refused" or
    what else happened."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as conn:
            conn.sendall(b"GET /livez HTTP/1.1\r\nHost: front\r\nConnection: close\r\n\r\n")
            head = conn.recv(64)
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return f"error: {exc!r}"
    return "answered" if head.startswith(b"HTTP/1.1 ") else f"closed: {head!r}"


def test_socket_activation_keeps_clients_connecting_across_a_restart_of_llama_guard(
        env: tuple[PrivateUserManager, PrivateJournald, Path, str]) -> None:
    manager, journal, config, extra = env
    front = free_port()
    config.write_text(config.read_text() + f'\n[front]\nlisten = "127.0.0.1:{front}"\n')
    manager.install_unit("llama-guard.socket", SOCKET_UNIT.read_text().replace(
        "ListenStream=127.0.0.1:8080", f"ListenStream=127.0.0.1:{front}"))
    manager.install_unit("llama-guard.service", unit_text(config, extra_env=extra))
    try:
        assert manager.systemctl("start", "llama-guard.socket", timeout_s=30).returncode == 0
        assert manager.systemctl("start", "llama-guard.service", timeout_s=90).returncode == 0
        first = manager.show("llama-guard.service", "MainPID")["MainPID"]
        outcomes: list[str] = []
        stop = threading.Event()

        def clients() -> None:
            while not stop.is_set():
                outcomes.append(_livez(front))
                stop.wait(0.05)

        loop = threading.Thread(target=clients, daemon=True)
        loop.start()
        try:
            t0 = time.monotonic()
            result = manager.systemctl("restart", "llama-guard.service", timeout_s=120)
            restart_s = time.monotonic() - t0
            assert result.returncode == 0, result.stderr
            answered = len(outcomes)
            deadline = time.monotonic() + 30
            while len(outcomes) < answered + 5 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            loop.join(150)
        assert manager.show("llama-guard.service", "MainPID")["MainPID"] != first
        assert outcomes and set(outcomes) == {"answered"}, {o: outcomes.count(o) for o in set(outcomes)}
        listening = journal.entries("LLAMA_GUARD_EVENT=front_listening")
        assert [e["ACTIVATED"] for e in listening] == ["true", "true"], listening
        print(f"systemctl restart took {restart_s:.1f} s; {len(outcomes)} clients, all answered")

        # Between two daemons the connection waits in the kernel's queue: with llama-guard stopped,
        # a client's connection is taken (and starts llama-guard) instead of being refused.
        assert manager.systemctl("stop", "llama-guard.service", timeout_s=60).returncode == 0
        assert manager.show("llama-guard.service", "ActiveState")["ActiveState"] == "inactive"
        assert _livez(front) == "answered"
        assert len(journal.entries("LLAMA_GUARD_EVENT=front_listening")) == 3
    finally:
        manager.systemctl("stop", "llama-guard.socket", "llama-guard.service", timeout_s=60)
