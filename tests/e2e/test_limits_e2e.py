"""End to end: ``[limits]`` with the REAL llama-server under the real daemon.

* the configured nofile / memlock are the server's effective limits, read back from
  ``/proc/<pid>/limits`` by the test itself; ``limits_applied``, ``check`` and ``status`` say so;
* with a low nofile and many keep-alive connections opened by the test, ``limit_low`` fires
  while ``/health`` still answers, before the server stops accepting;
* a daemon that runs as ``nobody`` cannot raise a hard limit: ``limit_not_raised`` names the
  limit, its value and the fix;
* ``--mlock`` with a memlock smaller than the model: the server's own mlock warning and ONE
  ``resource_exhausted`` naming RLIMIT_MEMLOCK; the server keeps running.

The unprivileged runs use ``setpriv --reuid 65534`` when the tests run as root (a root with
``CAP_IPC_LOCK`` is not held to RLIMIT_MEMLOCK at all, and one with ``CAP_SYS_RESOURCE`` may
raise any hard limit); run as another user they need no setpriv.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from harness import ROOT, DaemonRun, base_sections, free_port, merge, stop_all
from needs import unavailable

pytestmark = pytest.mark.real

NOBODY = 65534
MiB = 1 << 20


def proc_limits(pid: int) -> dict[str, tuple[str, str]]:
    """``/proc/<pid>/limits`` as the kernel prints it: row name → (soft, hard), as text."""
    out: dict[str, tuple[str, str]] = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        match = re.match(r"^(Max [a-z ]+?)\s{2,}(\S+)\s+(\S+)", line)
        if match:
            out[match.group(1)] = (match.group(2), match.group(3))
    return out


def cli(*args: str, config: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llama_guard", *args, "--config", str(config)],
                          capture_output=True, text=True, timeout=60, check=False, cwd=str(ROOT),
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")},
                               **(env or {})})


def health(port: int, timeout: float = 2.0) -> int | str:
    """The status code of ``GET /health`` on a new connection, or the error's name."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=timeout, trust_env=False).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def keepalive_connection(port: int, timeout: float = 1.0) -> tuple[socket.socket, bool]:
    """A connection that made one keep-alive request; (socket, whether the server answered it)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n")
        answered = sock.recv(4096).startswith(b"HTTP/1.1")
    except OSError:
        answered = False
    return sock, answered


# --------------------------------------------------------------------------------------------
# Fixtures: a daemon as this user, or as nobody
# --------------------------------------------------------------------------------------------


class PrivDaemonRun(DaemonRun):
    """A :class:`DaemonRun` whose command has a prefix (setpriv) and its own rlimits."""

    def __init__(self, tmp: Path, sections: dict[str, dict[str, object]], *, prefix: list[str],
                 python: list[str], env: dict[str, str], rlimits: dict[int, tuple[int, int]]):
        super().__init__(tmp, sections, env)
        self.prefix, self.python, self.rlimits = prefix, python, rlimits
        self.config.chmod(0o644)

    def start(self) -> PrivDaemonRun:
        rlimits = self.rlimits

        def preexec() -> None:
            for res, pair in rlimits.items():
                resource.setrlimit(res, pair)

        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, *self.python, "-m", "llama_guard", "run", "--config", str(self.config)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env, cwd="/",
                preexec_fn=preexec)
        return self


def _as_nobody() -> list[str]:
    if os.geteuid() != 0:
        return []  # already unprivileged
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        unavailable("setpriv (util-linux) is needed to run the daemon as nobody")
    return [str(setpriv), "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]


def _readable_by(prefix: list[str], *paths: Path) -> bool:
    if not prefix:
        return all(os.access(p, os.R_OK) for p in paths)
    return all(subprocess.run([*prefix, "test", "-r", str(p)], check=False).returncode == 0 for p in paths)


def _python_for(prefix: list[str]) -> tuple[list[str], dict[str, str]]:
    """An interpreter (and PYTHONPATH) with which ``prefix`` can import llama_guard."""
    probe = ["-c", "import llama_guard.core.daemon, psutil, pydantic, httpx"]
    path = os.pathsep.join([str(ROOT / "supervisor"), *(p for p in sys.path if p.endswith("site-packages"))])
    for python, env in (([sys.executable], {}), ([sys.executable], {"PYTHONPATH": path}),
                        (["/usr/bin/python3"], {"PYTHONPATH": path})):
        ok = subprocess.run([*prefix, *python, *probe], cwd="/", env={**os.environ, **env},
                            capture_output=True, check=False).returncode == 0
        if ok:
            return python, env
    unavailable(f"no Python that uid {NOBODY} can run llama_guard with")
    raise AssertionError  # unreachable


@pytest.fixture
def daemon(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> Iterator[Callable[..., DaemonRun]]:
    """``daemon(extra, nobody=False, rlimits={})``: a started-later daemon on a free port."""
    runs: list[DaemonRun] = []
    ports: list[int] = []
    dirs: list[Path] = []

    def make(extra: dict[str, dict[str, object]] | None = None, *, nobody: bool = False,
             rlimits: dict[int, tuple[int, int]] | None = None) -> DaemonRun:
        port = free_port()
        ports.append(port)
        binary, model, tmp = llama_server_bin, real_model, tmp_path
        if not nobody:
            run = DaemonRun(tmp, merge(base_sections(tmp, str(binary), str(model), port), extra or {}))
        else:
            prefix = _as_nobody()
            # A directory nobody can write: config, runtime dir, and copies of what it cannot read.
            tmp = Path(tempfile.mkdtemp(prefix="llama-guard-nobody-"))
            dirs.append(tmp)
            tmp.chmod(0o755)
            (tmp / "run").mkdir()
            if prefix:
                os.chown(tmp / "run", NOBODY, NOBODY)
            if not _readable_by(prefix, binary, model):
                shutil.copytree(binary.parent, tmp / "bin", symlinks=True)
                shutil.copy(model, tmp / model.name)
                binary, model = tmp / "bin" / binary.name, tmp / model.name
            python, env = _python_for(prefix)
            sections = merge(base_sections(tmp, str(binary), str(model), port), extra or {})
            run = PrivDaemonRun(tmp, sections, prefix=prefix, python=python, env=env, rlimits=rlimits or {})
        run.port = port  # type: ignore[attr-defined]
        runs.append(run)
        return run

    yield make
    leftovers = stop_all(runs, ports)
    if leftovers:
        pytest.fail(f"llama-server pids {leftovers} outlived their daemon")
    for directory in dirs:
        shutil.rmtree(directory, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# 1 + 5: the configured limits are the server's; limits_applied, check and status show them
# --------------------------------------------------------------------------------------------


def released(event: dict[str, Any]) -> bool:
    """A server line that ends a request (llama-server's ``slot release ... stop processing``)."""
    return "stop processing" in event["line"]


def test_configured_limits_are_the_servers_effective_limits(daemon: Callable[..., DaemonRun]) -> None:
    own_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    own_memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if own_nofile[1] < 4096 or own_memlock[1] < MiB:
        unavailable(f"needs hard limits nofile >= 4096 and memlock >= 1 MiB (have {own_nofile}, {own_memlock})")
    run = daemon({"limits": {"nofile": 4096, "memlock": "1M", "sample_interval_s": 0.2}}).start()
    pid = run.wait_event("server_ready", 60)["server_pid"]

    # Read back by the test itself, from the kernel.
    server = proc_limits(pid)
    assert server["Max open files"] == ("4096", "4096")
    assert server["Max locked memory"] == (str(MiB), str(MiB))
    # The daemon keeps its own limits: only the child was changed.
    assert proc_limits(run.pid)["Max open files"] == tuple(map(str, own_nofile))

    applied = run.wait_event("limits_applied")
    assert applied["server_pid"] == pid
    assert "RLIMIT_NOFILE 4096/4096" in applied["summary"]
    assert f"RLIMIT_MEMLOCK {MiB}/{MiB}" in applied["summary"]
    assert not [e for e in run.events() if e["event"] == "limit_not_raised"
                and e["limit"] in ("RLIMIT_NOFILE", "RLIMIT_MEMLOCK")]

    # status: configured / applied / effective and the CURRENT use: with 10 more connections
    # held, the status file (refreshed while the phase stays "ready") shows 10 more fds.
    # The daemon's own probe may hold one idle keep-alive connection to the server now (kept
    # UPSTREAM_KEEPALIVE_S, then closed): the base does not count it.
    base_fds = psutil.Process(pid).num_fds() - 1
    held = [keepalive_connection(run.port)[0] for _ in range(10)]  # type: ignore[attr-defined]
    try:
        deadline = time.monotonic() + 4.5  # within the server's keep-alive timeout (5 s)
        snap: dict[str, Any] = {}
        while time.monotonic() < deadline:
            out = cli("status", "--json", config=run.config)
            assert out.returncode == 0, out.stderr
            snap = json.loads(out.stdout)
            if (snap.get("limits", {}).get("usage", {}).get("fds") or 0) >= base_fds + 10:
                break
            time.sleep(0.2)
        text = cli("status", config=run.config)
    finally:
        for sock in held:
            sock.close()
    limits = snap["limits"]
    rows = {r["limit"]: r for r in limits["rows"]}
    assert rows["RLIMIT_NOFILE"]["configured"] == "4096"
    assert rows["RLIMIT_NOFILE"]["planned"] == rows["RLIMIT_NOFILE"]["effective"] == "4096 / 4096"
    assert rows["RLIMIT_MEMLOCK"]["configured"] == "1 MiB (1048576 bytes)"
    assert rows["RLIMIT_MEMLOCK"]["effective"] == "1 MiB (1048576 bytes) / 1 MiB (1048576 bytes)"
    usage = limits["usage"]
    assert usage["pid"] == pid and usage["fds"] >= base_fds + 10, f"no current use in the status file: {limits}"
    assert usage["nofile_limit"] == 4096 and usage["threads"] >= 3

    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    header = next(line for line in lines if "configured" in line and "effective" in line)
    assert "applied" in header and "in use" in header
    nofile_row = next(line for line in lines if line.strip().startswith("RLIMIT_NOFILE"))
    assert nofile_row.count("4096 / 4096") == 2 and "open fds" in nofile_row and "% of 4096" in nofile_row
    assert "RLIMIT_MEMLOCK" in text.stdout and "read back from the server" in text.stdout

    # check: what the server would get, before any start.
    checked = cli("check", config=run.config)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    nofile_check = next(line for line in checked.stdout.splitlines() if "RLIMIT_NOFILE" in line)
    assert nofile_check.startswith("OK") and "configured 4096" in nofile_check
    assert "llama-server gets 4096 / 4096" in nofile_check
    memlock_check = next(line for line in checked.stdout.splitlines() if "RLIMIT_MEMLOCK" in line)
    assert "llama-server gets 1 MiB (1048576 bytes) / 1 MiB (1048576 bytes)" in memlock_check


# --------------------------------------------------------------------------------------------
# 2: limit_low before the server stops accepting
# --------------------------------------------------------------------------------------------


def test_limit_low_fires_before_the_server_stops_accepting(daemon: Callable[..., DaemonRun]) -> None:
    nofile = 96
    run = daemon({"limits": {"nofile": nofile, "sample_interval_s": 0.2, "warn_fraction": 0.8},
                  # The server stops answering for a moment at the limit: not a hang to act on.
                  "health": {"hang_strikes": 50}}).start()
    port: int = run.port  # type: ignore[attr-defined]
    pid = run.wait_event("server_ready", 60)["server_pid"]
    run.wait_event("limits_applied")
    assert proc_limits(pid)["Max open files"] == (str(nofile), str(nofile))
    server = psutil.Process(pid)
    warn_at = int(0.8 * nofile) + 1

    held: list[socket.socket] = []
    low: dict[str, Any] | None = None
    health_at_low: int | str = "not tried"
    held_at_low = 0
    refused_after: int | None = None
    t0 = time.monotonic()
    try:
        while len(held) < 2 * nofile:
            # Connections answered within keep-alive (5 s): the ramp must be quick.
            assert time.monotonic() - t0 < 4.0, f"ramp too slow: {len(held)} connections"
            sock, answered = keepalive_connection(port)
            held.append(sock)
            if not answered:
                refused_after = len(held)
                break
            if low is None and server.num_fds() >= warn_at + 2:
                # In the warning band: the next sample (0.2 s) must report it.
                deadline = time.monotonic() + 1.5
                while low is None and time.monotonic() < deadline:
                    found = [e for e in run.events() if e["event"] == "limit_low"]
                    low = found[0] if found else None
                    time.sleep(0.02)
                assert low is not None, f"no limit_low at {server.num_fds()} fds of {nofile}"
                health_at_low = health(port)
                held_at_low = len(held)
        assert low is not None, f"no limit_low with {len(held)} connections"
        assert refused_after is not None, f"the server took {len(held)} connections under nofile {nofile}"
        exhausted = run.wait_event("resource_exhausted", 3, where=lambda e: e.get("source") == "sample")
        health_at_limit = health(port, timeout=0.5)
    finally:
        for sock in held:
            sock.close()
    assert low["limit"] == "RLIMIT_NOFILE" and low["limit_value"] == nofile
    assert warn_at <= low["used"] < nofile and 0.8 <= low["fraction"] < 1.0
    assert low["server_pid"] == pid and "LimitNOFILE=" in low["fix"]
    # When limit_low fired, the server still accepted and answered...
    assert health_at_low == 200
    # ...and it stopped accepting only later, with more connections held.
    assert refused_after > held_at_low
    assert health_at_limit != 200
    assert exhausted["limit"] == "RLIMIT_NOFILE" and exhausted["used"] >= nofile
    names = run.names()
    assert names.index("limit_low") < names.index("resource_exhausted")
    # Connections closed: use falls back under the re-arm mark, the server answers again.
    ok = run.wait_event("limit_ok", 10)
    assert ok["used"] < 0.7 * nofile
    deadline = time.monotonic() + 5
    while health(port) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health(port) == 200
    assert run.names().count("server_starting") == 1, "a limit is no crash: no restart"


# --------------------------------------------------------------------------------------------
# 3: an unprivileged daemon cannot raise a hard limit
# --------------------------------------------------------------------------------------------


def test_unprivileged_daemon_reports_the_hard_limit_it_cannot_raise(daemon: Callable[..., DaemonRun]) -> None:
    # The daemon runs as nobody with a hard RLIMIT_NOFILE of 2048 and is configured for 4096.
    run = daemon({"limits": {"nofile": 4096}}, nobody=True,
                 rlimits={resource.RLIMIT_NOFILE: (1024, 2048)}).start()
    pid = run.wait_event("server_ready", 60)["server_pid"]
    assert psutil.Process(pid).uids().real == (os.getuid() if os.geteuid() else NOBODY)

    event = run.wait_event("limit_not_raised", where=lambda e: e["limit"] == "RLIMIT_NOFILE")
    reason = event["reason"]
    assert "llama-server needs 4096" in reason and "hard limit of 2048" in reason
    assert "llama-server gets 2048" in reason
    assert f"euid {os.geteuid() or NOBODY}, not root" in reason
    assert "LimitNOFILE=4096" in reason and "`ulimit -Hn 4096`" in reason and "--ulimit nofile=4096:4096" in reason
    # The message names the limit once: the reason is already a full sentence starting with it.
    assert event["message"] == reason and reason.startswith("RLIMIT_NOFILE (open files): ")
    # It says so once, and the server runs with the best it could get.
    assert run.names().count("limit_not_raised") == 1
    assert proc_limits(pid)["Max open files"] == ("2048", "2048")
    assert "RLIMIT_NOFILE 2048/2048" in run.wait_event("limits_applied")["summary"]


# --------------------------------------------------------------------------------------------
# 4: --mlock with a small memlock
# --------------------------------------------------------------------------------------------


def test_mlock_with_a_small_memlock_is_one_resource_exhausted_and_no_restart(
        daemon: Callable[..., DaemonRun], real_model: Path) -> None:
    assert real_model.stat().st_size > 8 * MiB
    # As nobody: without CAP_IPC_LOCK, RLIMIT_MEMLOCK binds.
    run = daemon({"server": {"mlock": True}, "limits": {"memlock": "1M"}}, nobody=True).start()
    started = run.wait_event("server_starting", 60)
    # This build spells --mlock "--load-mode mmap+mlock" (and rejects --mlock); older ones --mlock.
    assert "--mlock" in started["argv"] or "--load-mode mmap+mlock" in started["argv"]
    pid = run.wait_event("server_ready", 60)["server_pid"]
    assert proc_limits(pid)["Max locked memory"] == (str(MiB), str(MiB))

    event = run.wait_event("resource_exhausted", 10)
    assert event["limit"] == "RLIMIT_MEMLOCK" and event["server_pid"] == pid
    assert "failed to mlock" in event["line"] or "RLIMIT_MEMLOCK" in event["line"]
    lines = [e["line"] for e in run.events() if e["event"] == "server_line"]
    assert any("failed to mlock" in line for line in lines), "no mlock warning from the server"
    assert any("Try increasing RLIMIT_MEMLOCK" in line for line in lines)

    # The server keeps running and serving: a configuration problem, no crash.
    done = run.count("server_line", where=released)
    resp = httpx.post(f"http://127.0.0.1:{run.port}/v1/chat/completions", timeout=60,  # type: ignore[attr-defined]
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert resp.status_code == 200
    # The daemon read the server's output past that request's end (its slot released), so any later
    # duplicate of the load-time warning would be logged by now.
    run.wait_event("server_line", 30, skip=done, where=released)
    names = run.names()
    assert names.count("resource_exhausted") == 1, names
    assert names.count("server_starting") == 1 and "server_exited" not in names
    assert psutil.pid_exists(pid)
