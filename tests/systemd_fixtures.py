"""Real systemd pieces for tests: a private systemd-journald and a private ``systemd --user``.

Both run without touching the host's journal or service manager:

* :class:`PrivateJournald` starts ``systemd-journald <namespace>`` with ``RUNTIME_DIRECTORY`` and
  ``LOGS_DIRECTORY`` in a temporary directory. Its native socket is ``run/socket``; entries are
  read back with ``journalctl -D logs -o json`` after a ``Synchronize`` call.
* :class:`PrivateUserManager` starts ``systemd --user`` in its own mount and cgroup namespace
  (a tmpfs on ``/run/systemd`` so it believes the system was booted with systemd, a child of
  the unified cgroup hierarchy as its root), with ``SYSTEMD_UNIT_PATH`` pointing at a directory
  of units under test. ``systemctl --user`` reaches it through ``XDG_RUNTIME_DIR``.

When a binary is missing the fixtures skip with the reason, except under ``CI=true``, where
they fail: CI must run these tests for real.

Use from a test module with ``from tests.systemd_fixtures import private_journald`` (the
pytest fixtures) or the classes directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from needs import unavailable

JOURNALD = Path("/usr/lib/systemd/systemd-journald")
SYSTEMD = Path("/usr/lib/systemd/systemd")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def unified_cgroup() -> Path:
    """The cgroup v2 hierarchy the private manager's cgroup is made in: ``/sys/fs/cgroup/unified`` on a
    host with the hybrid layout, ``/sys/fs/cgroup`` itself on a cgroup-v2-only host (``cgroup2fs``)."""
    hybrid = CGROUP_ROOT / "unified"
    if hybrid.is_dir():
        return hybrid
    try:
        kind = subprocess.run(["stat", "-f", "-c", "%T", str(CGROUP_ROOT)], capture_output=True, text=True,
                              timeout=5, check=False).stdout.strip()
    except OSError:
        kind = ""
    return CGROUP_ROOT if kind == "cgroup2fs" else hybrid


UNIFIED_CGROUP = unified_cgroup()


def require(*paths: Path | str, what: str = "") -> None:
    """Skip (locally) or fail (``CI=true``) unless every path or command in ``paths`` exists."""
    missing = [str(p) for p in paths
               if not (Path(p).exists() if os.sep in str(p) else shutil.which(str(p)))]
    if missing:
        reason = f"{what or 'systemd test'} needs {', '.join(missing)}, not found on this host"
        unavailable(reason)


def _deadline_loop(timeout_s: float, step_s: float = 0.01) -> Iterator[float]:
    end = time.monotonic() + timeout_s
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        yield left
        time.sleep(min(step_s, max(left, 0)))


def _kill_group(proc: subprocess.Popen[Any], timeout_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout_s)


# --------------------------------------------------------------------------------------------
# journald
# --------------------------------------------------------------------------------------------

class PrivateJournald:
    """A ``systemd-journald`` of its own under ``base`` (``base/run``, ``base/logs``).

    :attr:`socket_path` is the native-protocol socket to point a writer at; :attr:`run_dir` can
    be bind-mounted on ``/run/systemd/journal`` for writers with a hard-coded path.
    :attr:`startup_ms` is how long it took from spawn to a successful stream connection.
    """

    def __init__(self, base: Path, namespace: str | None = None) -> None:
        self.base = base
        self.run_dir = base / "run"
        self.logs_dir = base / "logs"
        self.namespace = namespace or f"lgtest{uuid.uuid4().hex[:10]}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._keepalive: socket.socket | None = None
        self.startup_ms = 0.0

    @property
    def socket_path(self) -> Path:
        """The native-protocol datagram socket."""
        return self.run_dir / "socket"

    @property
    def varlink_path(self) -> Path:
        return self.run_dir / "io.systemd.journal"

    def start(self, timeout_s: float = 5.0) -> PrivateJournald:
        """Spawn journald and wait (at most ``timeout_s``) until its varlink socket accepts."""
        require(JOURNALD, "journalctl", what="private journald")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, RUNTIME_DIRECTORY=str(self.run_dir), LOGS_DIRECTORY=str(self.logs_dir))
        for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"):
            env.pop(key, None)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [str(JOURNALD), self.namespace], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=open(self.base / "journald.stderr", "wb"),  # noqa: SIM115
            start_new_session=True)
        for _ in _deadline_loop(timeout_s, 0.002):
            if self.proc.poll() is not None:
                break
            try:
                self._keepalive = self._connect()
            except OSError:
                continue
            self.startup_ms = (time.monotonic() - t0) * 1000
            return self
        err = (self.base / "journald.stderr").read_text(errors="replace")
        self.stop()
        raise RuntimeError(f"private journald did not become ready within {timeout_s} s: {err}")

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(5.0)
            sock.connect(str(self.varlink_path))
        except OSError:
            sock.close()
            raise
        return sock

    def synchronize(self, timeout_s: float = 5.0) -> None:
        """Return once journald has written everything it has received (varlink Synchronize)."""
        with self._connect() as sock:
            sock.settimeout(timeout_s)
            sock.sendall(b'{"method":"io.systemd.Journal.Synchronize","parameters":{}}\0')
            reply = b""
            while not reply.endswith(b"\0"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        if b'"error"' in reply:
            raise RuntimeError(f"journald Synchronize failed: {reply!r}")

    def entries(self, *matches: str, sync: bool = True) -> list[dict[str, Any]]:
        """Entries matching journalctl ``matches`` (e.g. ``"LLAMA_GUARD_EVENT=server_oom"``),
        with byte-array values (journalctl's form for non-printable data) decoded to text."""
        if sync:
            self.synchronize()
        out = subprocess.run(
            ["journalctl", "-D", str(self.logs_dir), "-o", "json", "--all", "--no-pager", *matches],
            capture_output=True, timeout=30, check=False)
        if out.returncode not in (0, 1):
            raise RuntimeError(f"journalctl failed: {out.stderr.decode(errors='replace')}")
        result = []
        for line in out.stdout.decode().splitlines():
            if not line.strip():
                continue
            entry = json.loads(line)
            for key, value in entry.items():
                if isinstance(value, list) and all(isinstance(b, int) for b in value):
                    entry[key] = bytes(value).decode("utf-8", "replace")
            result.append(entry)
        return result

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM journald and wait; SIGKILL its group if it lingers. Idempotent."""
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc)
        self.proc = None


@pytest.fixture
def private_journald(tmp_path: Path) -> Iterator[PrivateJournald]:
    """A running :class:`PrivateJournald` under ``tmp_path/journal``; stopped afterwards."""
    journal = PrivateJournald(tmp_path / "journal")
    journal.start()
    try:
        yield journal
    finally:
        journal.stop()


# --------------------------------------------------------------------------------------------
# systemd --user
# --------------------------------------------------------------------------------------------

_MANAGER_SCRIPT = r"""
set -e
echo $$ > "$LG_CG/cgroup.procs"
exec unshare --mount --cgroup --propagation private bash -c '
  set -e
  mount -t cgroup2 cgroup2 /sys/fs/cgroup
  mount -t tmpfs tmpfs /run/systemd
  mkdir /run/systemd/system /run/systemd/journal
  if [ -n "$LG_JOURNAL_RUN" ]; then mount --bind "$LG_JOURNAL_RUN" /run/systemd/journal; fi
  export XDG_RUNTIME_DIR="$LG_B/xdg" XDG_CONFIG_HOME="$LG_B/config" HOME="$LG_B"
  export SYSTEMD_UNIT_PATH="$LG_B/units:"
  exec /usr/lib/systemd/systemd --user --unit=empty.target'
"""


class PrivateUserManager:
    """A ``systemd --user`` manager of its own, for running real units in tests.

    ``base``: its directory (``units/`` holds the units, ``xdg/`` its runtime directory).
    ``journal``: a :class:`PrivateJournald` whose ``run`` directory is bind-mounted on the
    manager's ``/run/systemd/journal``, so units log into it (stdout and native protocol).
    Units are installed with :meth:`install_unit` and driven with :meth:`systemctl`. Messages from
    the manager carry ``USER_UNIT=`` (not ``UNIT=``).
    """

    def __init__(self, base: Path, journal: PrivateJournald | None = None) -> None:
        self.base = base
        self.units_dir = base / "units"
        self.xdg = base / "xdg"
        self.journal = journal
        self.cgroup = UNIFIED_CGROUP / f"lgtest-{uuid.uuid4().hex[:10]}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_ms = 0.0

    @property
    def env(self) -> dict[str, str]:
        """The environment for ``systemctl --user`` to reach this manager."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("DBUS_SESSION_BUS_ADDRESS", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        env["XDG_RUNTIME_DIR"] = str(self.xdg)
        env["SYSTEMD_PAGER"] = ""
        return env

    def start(self, timeout_s: float = 10.0) -> PrivateUserManager:
        """Start the manager and wait (at most ``timeout_s``) until ``SystemState`` is running."""
        require(SYSTEMD, "systemctl", "unshare", UNIFIED_CGROUP, what="private systemd --user")
        if os.geteuid() != 0:
            unavailable("the private systemd --user recipe needs root (mount and cgroup namespaces)")
        self.units_dir.mkdir(parents=True, exist_ok=True)
        self.xdg.mkdir(parents=True, exist_ok=True)
        self.xdg.chmod(0o700)
        (self.units_dir / "empty.target").write_text("[Unit]\nDescription=empty\n")
        self.cgroup.mkdir()
        env = dict(os.environ, LG_B=str(self.base), LG_CG=str(self.cgroup),
                   LG_JOURNAL_RUN=str(self.journal.run_dir) if self.journal else "")
        for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "DBUS_SESSION_BUS_ADDRESS"):
            env.pop(key, None)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            ["bash", "-c", _MANAGER_SCRIPT], env=env, stdin=subprocess.DEVNULL,
            stdout=open(self.base / "manager.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True)
        state = ""
        for _ in _deadline_loop(timeout_s, 0.02):
            if self.proc.poll() is not None:
                break
            if not (self.xdg / "systemd" / "private").exists():
                continue
            state = self.systemctl("show", "-p", "SystemState", "--value", timeout_s=5).stdout.strip()
            if state == "running":
                self.startup_ms = (time.monotonic() - t0) * 1000
                return self
        log = (self.base / "manager.log").read_text(errors="replace")
        self.stop()
        raise RuntimeError(f"private systemd --user not running within {timeout_s} s "
                           f"(state {state!r}): {log[-2000:]}")

    def systemctl(self, *args: str, timeout_s: float = 60.0, check: bool = False
                  ) -> subprocess.CompletedProcess[str]:
        """Run ``systemctl --user ARGS`` against this manager."""
        return subprocess.run(["systemctl", "--user", "--no-pager", *args], env=self.env, text=True,
                              capture_output=True, timeout=timeout_s, check=check)

    def install_unit(self, name: str, text: str) -> Path:
        """Write unit ``name`` into the unit directory and ``daemon-reload``."""
        path = self.units_dir / name
        path.write_text(text)
        self.systemctl("daemon-reload", check=True, timeout_s=30)
        return path

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show`` properties of ``unit`` as a dict."""
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props), check=True).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(self, unit: str, timeout_s: float, **want: str) -> dict[str, str]:
        """Poll ``show(unit)`` until every property in ``want`` has its value; return the last
        answer (the caller asserts on it)."""
        props: dict[str, str] = {}
        for _ in _deadline_loop(timeout_s, 0.1):
            props = self.show(unit, *want)
            if all(props.get(k) == v for k, v in want.items()):
                break
        return props

    def unit_pids(self, unit: str) -> list[int]:
        """Pids in ``unit``'s cgroup, read from the cgroup tree."""
        cg = self.show(unit, "ControlGroup").get("ControlGroup", "")
        if not cg:
            return []
        return self._pids_under(self.cgroup / cg.lstrip("/"))

    @staticmethod
    def _pids_under(cg: Path) -> list[int]:
        pids: list[int] = []
        if not cg.is_dir():
            return pids
        for procs in cg.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids.extend(int(p) for p in procs.read_text().split())
        return pids

    def stop(self, timeout_s: float = 10.0) -> None:
        """``systemctl --user exit``, then kill whatever is left in the manager's cgroup and remove
        the cgroup directories. Idempotent."""
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    self.systemctl("exit", timeout_s=timeout_s)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    _kill_group(self.proc)
            self.proc = None
        for _ in _deadline_loop(timeout_s, 0.05):
            pids = self._pids_under(self.cgroup)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.cgroup.is_dir():
            dirs = sorted((p for p in self.cgroup.rglob("*") if p.is_dir()),
                          key=lambda p: len(p.parts), reverse=True)
            for d in [*dirs, self.cgroup]:
                with contextlib.suppress(OSError):
                    d.rmdir()


@pytest.fixture
def private_user_manager(tmp_path: Path) -> Iterator[PrivateUserManager]:
    """A running :class:`PrivateUserManager` (no journal) under ``tmp_path/manager``."""
    manager = PrivateUserManager(tmp_path / "manager")
    manager.base.mkdir(parents=True, exist_ok=True)
    manager.start()
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture
def private_user_manager_with_journal(tmp_path: Path) -> Iterator[tuple[PrivateUserManager, PrivateJournald]]:
    """A :class:`PrivateUserManager` whose units log into a :class:`PrivateJournald`."""
    journal = PrivateJournald(tmp_path / "journal")
    journal.start()
    manager = PrivateUserManager(tmp_path / "manager", journal)
    manager.base.mkdir(parents=True, exist_ok=True)
    try:
        manager.start()
        yield manager, journal
    finally:
        manager.stop()
        journal.stop()


def environ_without(base: Mapping[str, str], *keys: str) -> dict[str, str]:
    """A copy of ``base`` without ``keys``."""
    return {k: v for k, v in base.items() if k not in keys}


def unit_capabilities(unit_text: str) -> dict[str, list[str]]:
    """``User``, ``CapabilityBoundingSet`` and ``AmbientCapabilities`` of a unit file's text
    (the words of every occurrence; a missing key is an empty list)."""
    out: dict[str, list[str]] = {"User": [], "CapabilityBoundingSet": [], "AmbientCapabilities": []}
    for raw in unit_text.splitlines():
        key, sep, value = raw.strip().partition("=")
        if sep and key in out:
            out[key] += value.split()
    return out
