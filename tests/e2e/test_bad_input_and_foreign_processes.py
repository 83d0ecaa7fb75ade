"""Bad input changes nothing, and foreign processes are never taken for ours: undecodable or invalid
config (at start and on reload), a reload that could not start, a server change during a spawn, a
process that is not ours on the server's pid or port, a FIFO as the server log.

Each test's docstring (``Regression: …``) describes the operator-visible defect it pins; every
test failed on the code before its fix and passes since.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from harness import DaemonRun, base_sections, free_port, merge
from llama_guard.config import ConfigError, load_config
from llama_guard.model.actions import Terminate
from llama_guard.model.inputs import Boot, ParamsChanged, Spawned
from llama_guard.model.policy import decide
from llama_guard.model.types import Params, initial_state
from llama_guard.vocab.phases import Phase

GOOD = """
[server]
binary = "/bin/true"
model = "/tmp/model.gguf"
port = 18999
[gpu]
enabled = "off"
[schedule]
restart_cron = ""
"""


pytestmark = pytest.mark.usefixtures("clean_env")


def _write(tmp_path: Path, text: str | bytes, name: str = "lg.toml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# ---------------------------------------------------------------- config: tracebacks / exit 1

def test_non_utf8_config_is_a_config_error(tmp_path: Path) -> None:
    """Regression: a config file with invalid UTF-8 (binary garbage, a Latin-1 editor save) raises
    UnicodeDecodeError out of load_config: `llama-guard run` prints a traceback and exits 1 (not
    78, so systemd restarts it forever), and a SIGHUP reload of such a file is silently ignored."""
    path = _write(tmp_path, b"[server]\nhost = \"caf\xe9\"\n")
    with pytest.raises(ConfigError):
        load_config(path)


def test_non_utf8_config_cli_exit_78(tmp_path: Path) -> None:
    """Regression: same, through the CLI: exit status must be 78 with one line and no traceback."""
    path = _write(tmp_path, b"\xff\xfe\x00garbage")
    proc = subprocess.run([sys.executable, "-m", "llama_guard", "check", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 78, proc.stderr[-300:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("var", "value"), [
    ("LLAMA_GUARD_SERVER__EXTRA_ARGS", "--api-key-file"),   # not JSON
    ("LLAMA_GUARD_RECOVERY__RESET_ON", "oom"),              # not JSON
    ("LLAMA_GUARD_SERVER__ENV", "{bad"),                    # broken JSON
])
def test_non_json_env_override_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        var: str, value: str) -> None:
    """Regression: an env override of a list/dict key that is not JSON raises pydantic-settings'
    SettingsError (a traceback, exit 1) instead of one config-error line and exit 78."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError):
        load_config(_write(tmp_path, GOOD))


# ---------------------------------------------------------------- config: accepted, then exit 70

@pytest.mark.parametrize("entry", ['"A=B" = "c"', '"X" = "a\\u0000b"'])
def test_bad_server_env_is_rejected_by_the_config(tmp_path: Path, entry: str) -> None:
    """Regression: [server.env] keys with '=' or values with NUL validate, then spawn raises
    ValueError and the daemon exits 70 ("internal error") — systemd restarts it in a loop instead
    of stopping on a configuration error (78)."""
    text = GOOD + "[server.env]\n" + entry + "\n"
    with pytest.raises(ConfigError):
        load_config(_write(tmp_path, text))


@pytest.mark.parametrize("host", ["localhost:99", "[::1"])
def test_bad_host_is_rejected_by_the_config(tmp_path: Path, host: str) -> None:
    """Regression: [server].host = "localhost:99" validates; at the first spawn httpx raises
    InvalidURL building the probe and the daemon exits 70 (internal error) instead of 78."""
    with pytest.raises(ConfigError):
        load_config(_write(tmp_path, GOOD.replace('port = 18999', f'port = 18999\nhost = "{host}"')))


# ---------------------------------------------------------------- reload

class _Notes:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def ready(self, status: str | None = None) -> None:
        self.calls.append("ready")

    def status(self, text: str) -> None: ...

    def reloading(self, status: str | None = None) -> None:
        self.calls.append("reloading")

    def stopping(self, status: str | None = None) -> None: ...
    def watchdog(self) -> None: ...
    def extend_timeout(self, usec: int) -> None: ...


def _daemon(tmp_path: Path, path: Path) -> Any:
    from llama_guard.core.daemon import Daemon
    from llama_guard.output.eventlog import Emitter

    config = load_config(path)
    notes = _Notes()
    return Daemon(config, path, Emitter(min_level="critical", fmt="json"), notifier=notes), notes


def test_reload_of_undecodable_file_reports_and_answers_ready(tmp_path: Path) -> None:
    """Regression: SIGHUP with a non-UTF-8 file: _reload dies with UnicodeDecodeError inside its task;
    no config_error is logged at all and sd_notify got RELOADING=1 but never READY=1, so systemd
    keeps the unit in "reloading"."""
    path = _write(tmp_path, GOOD + f'[runtime]\ndir = "{tmp_path / "run"}"\n')
    daemon, notes = _daemon(tmp_path, path)
    path.write_bytes(b"\xff\xfe garbage \x00")

    async def go() -> None:
        daemon.ctx = object()  # the reload only needs it for watchers, there are none
        await daemon.reloader.reload()

    with contextlib.suppress(UnicodeDecodeError):  # today it escapes _reload
        asyncio.run(go())
    events = [e["event"] for e in daemon.emitter.recent]
    assert "config_error" in events
    assert notes.calls == ["reloading", "ready"]


def test_reload_reports_runtime_and_log_changed_but_applies_neither(tmp_path: Path) -> None:
    """Regression: a reload that changes [runtime].dir (or [log].level) says "changed: log, runtime"
    but the status/pid files stay in the old directory (and the emitter keeps the old level):
    `llama-guard status/restart --config <same file>` then report "not running"."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))  # the reload checks that the model is a GGUF file
    good = GOOD.replace("/tmp/model.gguf", str(model))
    path = _write(tmp_path, good + f'[runtime]\ndir = "{tmp_path / "old"}"\n')
    daemon, _ = _daemon(tmp_path, path)
    path.write_text(good + f'[runtime]\ndir = "{tmp_path / "new"}"\n')

    async def go() -> None:
        daemon.ctx = object()
        await daemon.reloader.reload()

    asyncio.run(go())
    assert daemon.config.runtime.dir == tmp_path / "new"
    assert daemon.runtime.status_file.dir == tmp_path / "new"


def test_reload_that_could_not_start_keeps_the_running_config(tmp_path: Path) -> None:
    """Regression: an empty or truncated file is valid TOML with every key at its default; a
    reload then used to stop the working server and exit 78 ("llama-server not found")."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    good = GOOD.replace("/tmp/model.gguf", str(model))
    path = _write(tmp_path, good + f'[runtime]\ndir = "{tmp_path / "run"}"\n')
    daemon, _ = _daemon(tmp_path, path)
    before = daemon.config
    for text in ("", good.replace(str(model), str(tmp_path / "missing.gguf"))):
        path.write_text(text)

        async def go() -> None:
            daemon.ctx = object()
            await daemon.reloader.reload()

        asyncio.run(go())
        assert daemon.config is before
        assert daemon.queue.empty()  # no restart was asked for
    errors = [e["message"] for e in daemon.emitter.recent if e["event"] == "config_error"]
    assert len(errors) == 2 and "not found" in errors[0] and "missing.gguf" in errors[1]


# ---------------------------------------------------------------- policy

def test_server_change_while_spawn_in_flight_is_not_lost() -> None:
    """Regression: a reload (SIGHUP) whose ParamsChanged(server_changed=True) is queued while the
    spawn is in flight (STARTING, pid None — _spawn awaits the pre-spawn checks and the exec, and the
    reload task can finish in between) is dropped: the server then runs with the OLD argv
    although config_reloaded said "changed: server". (SIGUSR1 there is dropped the same way.)"""
    s, acts = decide(initial_state(Params()), Boot(), 0.0)
    assert s.phase is Phase.STARTING and s.pid is None
    s, acts = decide(s, ParamsChanged(Params(), server_changed=True), 0.01)
    s, acts = decide(s, Spawned(4242), 0.02)
    # the freshly spawned (old-argv) server must be restarted (or the change remembered)
    assert any(isinstance(a, Terminate) for a in acts) or s.phase is Phase.STOPPING


# ---------------------------------------------------------------- restart / pid file

def test_restart_never_signals_an_unrelated_process(tmp_path: Path) -> None:
    """Regression: `llama-guard restart` trusts any pid whose argv merely *contains* "llama-guard":
    with a stale pid file (daemon SIGKILLed, pid reused) it sends SIGUSR1 to e.g.
    `tail -f /var/log/llama-guard/…`, `vim /etc/llama-guard/llama-guard.toml` or a llama-server
    whose --model lives under /var/lib/llama-guard — and SIGUSR1's default action kills them."""
    from llama_guard.app.cli import main

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                               "/var/log/llama-guard/llama-guard.log"])
    try:
        run = tmp_path / "run"
        run.mkdir()
        (run / "llama-guard.pid").write_text(f"{victim.pid}\n")
        main(["restart", "--runtime-dir", str(run)])
        time.sleep(0.3)
        assert victim.poll() is None, f"unrelated process killed by {victim.returncode}"
    finally:
        victim.kill()
        victim.wait()


# ---------------------------------------------------------------- blocking I/O in the event loop

def test_server_log_fifo_does_not_wedge_the_daemon(tmp_path: Path) -> None:
    """Regression: [log].server_log_file naming a FIFO with no reader (a log shipper that is down)
    blocks open() inside the event loop forever: the server is spawned but never reported,
    SIGTERM is not handled (only SIGKILL ends the daemon)."""
    from llama_guard.core.daemon import Daemon
    from llama_guard.core.server import open_server_log
    from llama_guard.output.eventlog import Emitter

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    path = _write(tmp_path, GOOD + f'[log]\nserver_log_file = "{fifo}"\n')
    daemon = Daemon(load_config(path), path, Emitter(min_level="critical", fmt="json"))
    done = threading.Event()

    def opener() -> None:
        handle = open_server_log(str(fifo), daemon.emitter.emit)
        if handle is not None:
            handle.close()
        done.set()

    threading.Thread(target=opener, daemon=True).start()
    finished = done.wait(2.0)
    if not finished:  # unblock the stuck thread
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        done.wait(2.0)
        os.close(fd)
    assert finished, "opening server_log_file blocked for 2 s (it blocks the whole event loop)"


# ---------------------------------------------------------------- readiness

def test_foreign_process_on_the_port_is_not_called_ready(tmp_path: Path, fake_server: Path,
                                                                real_model: Path) -> None:
    """Regression: another process already answers /health 200 on [server].port. The child fails to
    bind, but the first /health poll reaches the squatter and the daemon reports server_ready
    (sd_notify READY=1) for a child that never listened; the bind failure then counts as a crash
    (exit 75, restarted by systemd) instead of a boot failure (exit 78)."""
    port = free_port()
    squatter = subprocess.Popen([sys.executable, str(fake_server), "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        import httpx
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        sections = merge(base_sections(tmp_path, str(fake_server), str(real_model), port),
                         {"recovery": {"max_restarts": 1}})
        run = DaemonRun(tmp_path, sections).start()
        try:
            run.wait_exit(60)
        finally:
            run.stop()
        assert "server_ready" not in run.names(), run.names()
    finally:
        squatter.send_signal(signal.SIGKILL)
        squatter.wait()


@pytest.mark.parametrize("plant", ["link to a root-only file", "dangling link", "hard link to a root-only file",
                                   "directory"])
def test_server_log_file_planted_by_another_user_is_refused_never_written_through(tmp_path: Path,
                                                                                  plant: str) -> None:
    """Security: [log].server_log_file in a directory llama-server's user can write: a link
    there made llama-guard (root) append the server's lines to any file (or create one where the link
    points). Now a link or a second name is refused (config_error), the file behind it untouched."""
    from llama_guard.core.server import open_server_log

    secret = tmp_path / "root-only"
    secret.write_bytes(b"root's own\n")
    secret.chmod(0o600)
    path = tmp_path / "server.log"
    if plant == "link to a root-only file":
        path.symlink_to(secret)
    elif plant == "dangling link":
        path.symlink_to(tmp_path / "made-by-root")
    elif plant == "hard link to a root-only file":
        os.link(secret, path)
    else:
        path.mkdir()
    errors: list[str] = []
    handle = open_server_log(str(path), lambda name, **f: errors.append(f["reason"]))
    assert handle is None and len(errors) == 1
    assert {"link to a root-only file": "symbolic link", "dangling link": "symbolic link",
            "hard link to a root-only file": "2 hard links", "directory": "directory"}[plant] in errors[0].lower()
    assert secret.read_bytes() == b"root's own\n" and not (tmp_path / "made-by-root").exists()


def test_server_log_file_that_is_a_huge_sparse_file_is_appended_to(tmp_path: Path) -> None:
    from llama_guard.core.server import open_server_log

    path = tmp_path / "server.log"
    with path.open("wb") as handle:
        handle.truncate(1 << 40)
    log = open_server_log(str(path), lambda name, **f: pytest.fail(str(f)))
    assert log is not None
    log.write("a line\n")
    log.close()
    assert path.stat().st_size == (1 << 40) + len("a line\n")
