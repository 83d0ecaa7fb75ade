"""API keys with the real llama-server: ``[server].api_key_file`` is passed as ``--api-key-file``
and llama-guard's own probes (liveness, canary, drain via /slots, /metrics sampling) send it as a
Bearer token; the key never appears in events, journald, status.json or ``llama-guard status``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from harness import ROOT, SERVER_THREADS, DaemonRun, base_sections, free_port, merge
from llama_guard.config import Config
from llama_guard.config.sections import HealthConfig
from llama_guard.core.probes import CanaryOutcome, ServerProbe, make_client
from llama_guard.model.watcher import Context
from llama_guard.restarts.readings import fetch_metrics
from llama_guard.restarts.watcher import ScheduleSource

if TYPE_CHECKING:
    from systemd_fixtures import PrivateJournald, PrivateUserManager

pytestmark = [pytest.mark.real, pytest.mark.timeout(240)]


@pytest.fixture
def key_file(tmp_path: Path) -> tuple[Path, str]:
    key = "lg-" + secrets.token_hex(20)
    path = tmp_path / "api-key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path, key


@pytest.fixture
def keyed_server(key_file: tuple[Path, str], llama_server_bin: Path, real_model: Path) -> Iterator[str]:
    """A real llama-server started with --api-key-file; yields its base URL once /health is 200."""
    port = free_port()
    proc = subprocess.Popen([str(llama_server_bin), "--model", str(real_model), "--host", "127.0.0.1",
                             "--port", str(port), "--ctx-size", "1024", "--threads", str(SERVER_THREADS), "--metrics",
                             "--api-key-file", str(key_file[0])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("llama-server did not become ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def test_probes_authenticate_and_fail_without_the_key(keyed_server: str, key_file: tuple[Path, str]) -> None:
    key = key_file[1]

    async def main() -> None:
        probe = ServerProbe(keyed_server, timeout_s=3.0, canary_timeout_s=30.0, get_key=lambda: key)
        bare = ServerProbe(keyed_server, timeout_s=3.0, canary_timeout_s=30.0)
        try:
            live = await probe.liveness()
            assert live.health_ok and live.canary_ok is True, live
            assert await probe.slots() is not None  # /slots needs the key: the drain's view
            await asyncio.wait_for(probe.wait_idle(poll_s=0.1), 10)
            # The same server without the key: what every probe saw before (the test can fail).
            assert await bare.slots() is None
            outcome, status, _message = await bare.canary_completion()
            assert outcome is CanaryOutcome.HTTP_ERROR and status == 401
        finally:
            await probe.aclose()
            await bare.aclose()

    asyncio.run(main())


def test_metrics_sampling_sends_the_key(keyed_server: str, key_file: tuple[Path, str]) -> None:
    """The planned-restart watcher's /metrics client is built by the same make_client."""
    key = key_file[1]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        config = Config()
        ctx = Context(get_config=lambda: config, emit=lambda *a, **k: None,
                      post=lambda e: None, post_threadsafe=lambda e: None, clock=time.monotonic, loop=loop,
                      get_api_key=lambda: key)
        source = ScheduleSource()
        assert await source.start(ctx) is None
        try:
            assert source._client is not None
            text = await fetch_metrics(source._client, keyed_server, 3.0)
            assert text is not None and "llamacpp:" in text
        finally:
            await source.close()
        async with make_client() as bare:
            assert await fetch_metrics(bare, keyed_server, 3.0) is None  # 401 without it

    asyncio.run(main())


def find_key(key: str, **texts: str) -> list[str]:
    """The names of the texts in which ``key`` (or its first half) appears."""
    return [name for name, text in texts.items() if key in text or key[: len(key) // 2] in text]


def test_daemon_with_key_stays_ready_drains_and_never_shows_it(
        tmp_path: Path, key_file: tuple[Path, str], llama_server_bin: Path, real_model: Path) -> None:
    """Shipped [health] intervals (5 s rounds, 3 strikes): several rounds pass; a drained restart
    (SIGUSR1) completes; the key is nowhere in what llama-guard writes or shows."""
    path, key = key_file
    port = free_port()
    shipped = HealthConfig()
    sections = merge(base_sections(tmp_path, str(llama_server_bin), str(real_model), port), {
        "server": {"api_key_file": str(path), "host": "127.0.0.1"},
        "health": {"interval_s": shipped.interval_s, "timeout_s": shipped.timeout_s,
                   "canary_timeout_s": shipped.canary_timeout_s, "hang_strikes": shipped.hang_strikes,
                   "canary": True},
    })
    run = DaemonRun(tmp_path, sections).start()
    try:
        first = int(run.wait_event("server_ready", 60)["server_pid"])
        rounds = shipped.hang_strikes + 1
        run.wait_event("server_probe", shipped.interval_s * (rounds + 2) + 30, skip=rounds - 1)
        probes = [e for e in run.events() if e["event"] == "server_probe"]
        assert len(probes) >= rounds
        assert all(p["health_ok"] and p["canary_ok"] is True for p in probes), probes
        assert "server_hang" not in run.names()
        restart = subprocess.run([sys.executable, "-m", "llama_guard", "restart", "--runtime-dir",
                                  str(tmp_path / "run")], capture_output=True, text=True, cwd=str(ROOT),
                                 timeout=30, check=False)
        assert restart.returncode == 0, restart.stderr
        second = int(run.wait_event("server_ready", 60, skip=1)["server_pid"])
        assert second != first
        assert "drain_timeout" not in run.names()
        status_json = (tmp_path / "run" / "status.json").read_text()
        shown = subprocess.run([sys.executable, "-m", "llama_guard", "status", "--runtime-dir",
                                str(tmp_path / "run")], capture_output=True, text=True, cwd=str(ROOT),
                               timeout=30, check=False)
        shown_json = subprocess.run([sys.executable, "-m", "llama_guard", "status", "--json", "--runtime-dir",
                                     str(tmp_path / "run")], capture_output=True, text=True, cwd=str(ROOT),
                                    timeout=30, check=False)
        assert shown.returncode == 0 and "ready" in shown.stdout, shown
        bench = subprocess.run([sys.executable, "-m", "llama_guard", "bench", "--runs", "1", "--tokens", "8",
                                "--config", str(run.config)], capture_output=True, text=True, cwd=str(ROOT),
                               timeout=120, check=False)
        assert bench.returncode == 0 and "tokens/s median" in bench.stdout, bench.stderr
        cmdline = Path(f"/proc/{run.pid}/cmdline").read_bytes().decode(errors="replace")
        server_cmdline = Path(f"/proc/{second}/cmdline").read_bytes().decode(errors="replace")
        assert str(path) in server_cmdline  # the file's path is passed, not the key
        run.signal(signal.SIGTERM)
        assert run.wait_exit(30) == 0
        events = run.log_path.read_text()
        assert "server_starting" in events and "--api-key-file" in events
        assert find_key(key, events=events, status_json=status_json, status=shown.stdout + shown.stderr,
                        status_json_verb=shown_json.stdout, daemon_argv=cmdline, server_argv=server_cmdline) == []
    finally:
        run.stop()


def test_secret_in_extra_args_is_refused_without_echoing_it(tmp_path: Path) -> None:
    secret = "lg-" + secrets.token_hex(20)
    for extra in (["--api-key", secret], [f"--api-key={secret}"], ["--hf-token", secret]):
        run = DaemonRun(tmp_path, merge(base_sections(tmp_path, "/bin/true", str(tmp_path / "m.gguf"), free_port()),
                                        {"server": {"extra_args": extra}}))
        run.start()
        assert run.wait_exit(30) == 78
        text = run.log_path.read_text()
        assert "api_key_file" in text and secret not in text, text
        run.log_path.unlink()


def test_warning_beyond_loopback_without_a_key(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    sections = merge(base_sections(tmp_path, str(llama_server_bin), str(real_model), free_port()),
                     {"server": {"host": "0.0.0.0"}})
    run = DaemonRun(tmp_path, sections).start()
    try:
        warning = run.wait_event("server_unauthenticated", 30)
        assert warning["host"] == "0.0.0.0" and warning["level"] == "warning"
        run.wait_event("server_ready", 60)
        check = subprocess.run([sys.executable, "-m", "llama_guard", "check", "--config", str(run.config)],
                               capture_output=True, text=True, cwd=str(ROOT), timeout=60, check=False)
        line = next(x for x in check.stdout.splitlines() if " api key " in x)
        assert line.startswith("WARN") and "api_key_file" in line, line
    finally:
        run.stop()


# --- journald: the real unit under a private systemd --user manager ----------------------------

def test_key_not_in_the_journal(private_user_manager_with_journal: tuple[PrivateUserManager, PrivateJournald],
                                tmp_path: Path, key_file: tuple[Path, str], llama_server_bin: Path,
                                real_model: Path) -> None:
    from test_systemd_e2e import unit_text, write_config

    manager, journal = private_user_manager_with_journal
    path, key = key_file
    runtime = tmp_path / "runtime"
    config = write_config(tmp_path / "llama-guard.toml", llama_server_bin, free_port(), runtime, model=real_model)
    config.write_text(config.read_text().replace("[health]", f'api_key_file = "{path}"\n\n[health]')
                      .replace("canary = false", "canary = true"))
    manager.install_unit("llama-guard.service", unit_text(config))
    try:
        assert manager.systemctl("start", "llama-guard.service", timeout_s=90).returncode == 0
        journal.synchronize()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(journal.entries("LLAMA_GUARD_EVENT=server_probe")) < 2:
            time.sleep(0.5)
        probes = journal.entries("LLAMA_GUARD_EVENT=server_probe")
        assert len(probes) >= 2 and all(p["CANARY_OK"] == "true" for p in probes), probes
        os.kill(int(manager.show("llama-guard.service", "MainPID")["MainPID"]), signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(journal.entries("LLAMA_GUARD_EVENT=server_ready")) < 2:
            time.sleep(0.5)
        assert len(journal.entries("LLAMA_GUARD_EVENT=server_ready")) == 2
    finally:
        manager.systemctl("stop", "llama-guard.service", timeout_s=60)
    entries = journal.entries()
    assert any(e.get("LLAMA_GUARD_EVENT") == "server_starting" for e in entries)
    text = json.dumps(entries)
    assert find_key(key, journal=text) == []


def test_new_key_on_reload_restarts_the_server_and_probes_follow(
        tmp_path: Path, key_file: tuple[Path, str], llama_server_bin: Path, real_model: Path) -> None:
    """The key file gets a new key and llama-guard is reloaded: llama-server (which read the file at
    its start) is restarted after draining, and the probes use the new key from then on."""
    path, old = key_file
    sections = merge(base_sections(tmp_path, str(llama_server_bin), str(real_model), free_port()), {
        "server": {"api_key_file": str(path)},
        "health": {"interval_s": 1.0, "timeout_s": 3.0, "canary_timeout_s": 10.0, "hang_strikes": 3},
    })
    run = DaemonRun(tmp_path, sections).start()
    try:
        first = int(run.wait_event("server_ready", 60)["server_pid"])
        new = "lg-" + secrets.token_hex(20)
        path.write_text(f"# rotated\n{new}\n")
        run.signal(signal.SIGHUP)
        run.wait_event("config_reloaded", 30)
        second = int(run.wait_event("server_ready", 60, skip=1)["server_pid"])
        assert second != first
        after = run.wait_event("server_probe", 30, where=lambda e: e["server_pid"] == second)
        assert after["canary_ok"] is True, after
        assert "server_hang" not in run.names() and "drain_timeout" not in run.names()
        text = run.log_path.read_text()
        assert find_key(old, events=text) == [] and find_key(new, events=text) == []
    finally:
        run.stop()
