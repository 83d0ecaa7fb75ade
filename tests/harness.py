"""Test helpers: run ``llama-guard run`` as a real subprocess and read its JSON events; drive the
pure policy (``decide``) through a start and readiness and read the events it emits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from llama_guard.model.actions import Emit, NotifyReady, Spawn
from llama_guard.model.inputs import Boot, HealthOk, Line, Spawned
from llama_guard.model.policy import decide
from llama_guard.model.server_log import classify_line
from llama_guard.model.types import Params, State, initial_state
from llama_guard.vocab.phases import Phase

ROOT = Path(__file__).resolve().parent.parent
FAKE_SERVER = Path(__file__).resolve().parent / "fake_llama_server.py"
# The CLI with tests/fake_pynvml_mod.py injected as the pynvml module (a DaemonRun ``command``).
FAKE_NVML_RUN = [sys.executable, str(Path(__file__).resolve().parent / "run_with_fake_nvml.py")]


#: Ports handed out by :func:`free_port`, one file per port, shared by every test process of this user on this
#: host (xdist workers, other checkouts' runs): a port is not handed out again for :data:`PORT_HOLD_S` seconds.
PORT_DIR = Path(tempfile.gettempdir()) / f"llama-guard-test-ports-{os.getuid()}"
PORT_HOLD_S = 600.0


def free_port() -> int:
    """A loopback TCP port free now and not handed out to any test process on this host in the last
    :data:`PORT_HOLD_S` seconds (the kernel's choice, then an exclusive claim file in :data:`PORT_DIR`), so
    parallel workers never configure the same port between this call and their daemon's bind."""
    PORT_DIR.mkdir(mode=0o700, exist_ok=True)
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        claim = PORT_DIR / str(port)
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return port
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - claim.stat().st_mtime > PORT_HOLD_S:
                    claim.touch()  # an old claim: this port is ours again
                    return port
    raise RuntimeError(f"no unclaimed loopback port in 1000 tries ({PORT_DIR})")


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def config_text(sections: dict[str, dict[str, object]]) -> str:
    out = []
    for name, keys in sections.items():
        out.append(f"[{name}]")
        out += [f"{k} = {toml_value(v)}" for k, v in keys.items()]
        out.append("")
    return "\n".join(out)


#: llama-server's ``--threads`` in the tests' configuration. Beside the parallel lane's other workers
#: (pytest-xdist sets PYTEST_XDIST_WORKER), one: a second thread spins at ggml's barrier against them (measured
#: on this 2-core host: two e2e modules in 162 s with two threads, 39 s with one). Alone (the serial lane,
#: a single test), both cores.
SERVER_THREADS = 1 if "PYTEST_XDIST_WORKER" in os.environ else min(2, len(os.sched_getaffinity(0)))


def base_sections(tmp: Path, binary: str, model: str, port: int) -> dict[str, dict[str, object]]:
    """A fast-probing CPU configuration for tests."""
    return {
        "server": {"binary": binary, "model": model, "port": port, "n_gpu_layers": 0, "ctx_size": 1024,
                   "threads": SERVER_THREADS, "env": {}},
        "health": {"interval_s": 0.5, "timeout_s": 1.0, "canary_timeout_s": 2.0, "hang_strikes": 2,
                   "load_timeout_s": 60.0},
        "gpu": {"enabled": "off"},
        "recovery": {"backoff_initial_s": 0.1, "stop_grace_s": 3.0, "max_restarts": 3,
                     "restart_window_s": 60.0, "repeat_confirm_s": 0.5},
        "schedule": {"restart_cron": ""},
        "log": {"level": "debug", "format": "json"},
        "runtime": {"dir": str(tmp / "run")},
    }


def merge(a: dict[str, dict[str, object]], b: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    out = {k: dict(v) for k, v in a.items()}
    for k, v in b.items():
        out.setdefault(k, {}).update(v)
    return out


class DaemonRun:
    """One ``python -m llama_guard run`` process with its stderr (JSON events) in a file."""

    def __init__(self, tmp: Path, sections: dict[str, dict[str, object]], env: dict[str, str] | None = None,
                 *, command: list[str] | None = None, prefix: list[str] | None = None):
        self.prefix = list(prefix or [])  # e.g. setpriv with the unit's credentials
        self.tmp = tmp
        self.config = tmp / "llama-guard.toml"
        self.config.write_text(config_text(sections))
        self.log_path = tmp / "daemon.jsonl"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")}
        self.env.update(env or {})
        self.env["PYTHONUNBUFFERED"] = "1"
        self.proc: subprocess.Popen[bytes] | None = None
        self.command = command or [sys.executable, "-m", "llama_guard"]  # e.g. FAKE_NVML_RUN

    def start(self) -> DaemonRun:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen([*self.prefix, *self.command, "run", "--config", str(self.config)],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env,
                                     cwd=str(ROOT))
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def events(self) -> list[dict[str, Any]]:
        out = []
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        for line in text.splitlines():
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict) and "event" in item:
                out.append(item)
        return out

    def names(self) -> list[str]:
        return [e["event"] for e in self.events() if e["event"] != "server_line"]

    def count(self, name: str, *, where: Callable[[dict[str, Any]], bool] = lambda e: True) -> int:
        """How many events called ``name`` matching ``where`` were logged so far (a mark for
        ``wait_event(..., skip=count)``: the next one after now)."""
        return sum(1 for e in self.events() if e["event"] == name and where(e))

    def wait_event(self, name: str, timeout: float = 30.0, *, skip: int = 0,
                   where: Callable[[dict[str, Any]], bool] = lambda e: True) -> dict[str, Any]:
        """The (skip+1)-th event called ``name`` matching ``where``; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events() if e["event"] == name and where(e)]
            if len(found) > skip:
                return found[skip]
            if self.proc is not None and self.proc.poll() is not None:
                found = [e for e in self.events() if e["event"] == name and where(e)]
                if len(found) > skip:
                    return found[skip]
                raise AssertionError(f"daemon exited ({self.proc.returncode}) before {name}: {self.names()}")
            time.sleep(0.05)
        raise AssertionError(f"no {name} within {timeout} s; events: {self.names()}")

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        """Stop the daemon if it still runs (SIGTERM, then SIGKILL) and kill any server it left.

        Prints the daemon's events (without the server's lines), so that a failing test shows
        what llama-guard saw and did; pytest shows captured output only on failure.
        """
        if self.proc is None:
            return
        for event in self.events():
            if event["event"] not in ("server_line", "server_probe"):
                print(event.get("timestamp", "")[11:23], event["event"], event.get("message", ""))
        terminate(self.proc, 20.0)


def nvml_calls(path: Path, name: str) -> int:
    """How many times a daemon run with tests/fake_pynvml_mod.py called NVML's ``name`` so far (failing calls
    too), from its ``$FAKE_NVML_CALLS`` file ``path``."""
    try:
        return int(json.loads(path.read_text()).get(name, 0))
    except (OSError, ValueError):
        return 0


def wait_nvml_calls(run: DaemonRun, path: Path, name: str, more: int, timeout: float = 30.0) -> None:
    """Until ``run`` called NVML's ``name`` ``more`` times beyond now (``path``: its ``$FAKE_NVML_CALLS``):
    the daemon looked again — a positive marker that it went on with its work, where a sleep passes on a
    stalled daemon too."""
    target = nvml_calls(path, name) + more
    deadline = time.monotonic() + timeout
    while nvml_calls(path, name) < target:
        assert time.monotonic() < deadline, f"{name} not called {more} more times within {timeout} s"
        assert run.proc is not None and run.proc.poll() is None, f"daemon exited: {run.names()}"
        time.sleep(0.05)


def terminate(proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """SIGTERM ``proc`` if it still runs, SIGKILL after ``timeout_s`` seconds; reaped either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


PORT_HOLDER = ("import socket, sys, time\n"
               "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
               "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); print('bound', flush=True)\n"
               "time.sleep(float(sys.argv[2]))\n")


def hold_port(port: int, seconds: float) -> subprocess.Popen[str]:
    """A process (its comm: python3...) listening on ``port`` for ``seconds``."""
    proc = subprocess.Popen([sys.executable, "-c", PORT_HOLDER, str(port), str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "bound"
    return proc


def server_pids_of(port: int) -> list[int]:
    """Pids of processes whose argv has ``--port <port>`` (any llama-server of this test)."""
    out = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info.get("cmdline") or []
        for i, word in enumerate(cmd[:-1]):
            if word == "--port" and cmd[i + 1] == str(port):
                out.append(proc.info["pid"])
    return out


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def stop_all(runs: list[DaemonRun], ports: list[int]) -> list[int]:
    """Stop every daemon, then SIGKILL any llama-server still on one of ``ports``; returns those pids
    (a test fixture fails on them: a server must never outlive its daemon)."""
    for run in runs:
        run.stop()
    leftovers = []
    for port in ports:
        for pid in server_pids_of(port):
            os.kill(pid, signal.SIGKILL)
            leftovers.append(pid)
    return leftovers


class RunPool:
    """The daemon runs of one test, each on a free port (``run.port``); :meth:`finish` stops them all
    and returns the pids of any llama-server that outlived its daemon."""

    def __init__(self) -> None:
        self.runs: list[DaemonRun] = []
        self.ports: list[int] = []

    def new(self, where: Path, binary: str, model: str, extra: dict[str, dict[str, object]] | None = None) -> DaemonRun:
        """A daemon (not started) supervising ``binary`` on ``model`` with ``extra`` merged into the config."""
        port = free_port()
        self.ports.append(port)
        run = DaemonRun(where, merge(base_sections(where, binary, model, port), extra or {}))
        run.port = port  # type: ignore[attr-defined]
        self.runs.append(run)
        return run

    def finish(self) -> list[int]:
        """Stop every run; the leftover server pids (killed here) — a test fails on any."""
        return stop_all(self.runs, self.ports)


# --- driving the pure policy (tests of decide) -------------------------------------------------

def names(actions: list[Any]) -> list[str]:
    """The event names of the policy's ``Emit`` actions, in order."""
    return [a.name for a in actions if isinstance(a, Emit)]


def emitted(actions: list[Any], name: str) -> Emit:
    """The one ``Emit`` called ``name`` among ``actions``; fails on none or several."""
    found = [a for a in actions if isinstance(a, Emit) and a.name == name]
    assert len(found) == 1, (name, actions)
    return found[0]


def line(pid: int, text: str) -> Line:
    """A server output line of ``pid`` as the daemon hands it to the policy (classified)."""
    return Line(pid, classify_line(text), text)


def started(params: Params, pid: int = 100, now: float = 0.0, state: State | None = None) -> State:
    """A policy state whose server ``pid`` was just spawned (STARTING) at ``now``."""
    s, acts = decide(state or initial_state(params), Boot(), now)
    if state is None:
        assert acts == [Spawn()], acts
    s, acts = decide(s, Spawned(pid, ("llama-server",)), now)
    assert names(acts) == ["server_starting"] and s.phase is Phase.STARTING
    return s


def ready(params: Params, pid: int = 100, now: float = 1.0) -> State:
    """A policy state whose server ``pid`` answered /health at ``now`` (READY, READY=1 sent)."""
    s, acts = decide(started(params, pid, now - 1.0), HealthOk(pid), now)
    assert s.phase is Phase.READY and NotifyReady() in acts
    return s
