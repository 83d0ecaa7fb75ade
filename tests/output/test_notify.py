"""The sd_notify protocol at the socket level: a bound AF_UNIX datagram socket plays systemd."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_guard.core.child import child_environ
from llama_guard.output.notify import SdNotifier, monotonic_usec


class FakeManager:
    """The receiving end of NOTIFY_SOCKET, with SO_PASSCRED to see the sender's pid."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.pids: list[int] = []

    def recv(self, timeout_s: float = 2.0) -> str | None:
        self.sock.settimeout(timeout_s)
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(65536, socket.CMSG_SPACE(12))
        except TimeoutError:
            return None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                self.pids.append(struct.unpack("3i", payload[:12])[0])
        return data.decode("utf-8")  # strict: systemd drops STATUS that is not UTF-8

    def recv_all(self, quiet_s: float = 0.1) -> list[str]:
        out = []
        while (msg := self.recv(quiet_s)) is not None:
            out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[FakeManager]:
    m = FakeManager(str(tmp_path / "notify"))
    yield m
    m.close()


@pytest.fixture
def abstract_manager() -> Iterator[FakeManager]:
    m = FakeManager(f"@llama-guard-test/{uuid.uuid4().hex}")
    yield m
    m.close()


def test_exact_messages_in_order(manager: FakeManager) -> None:
    n = SdNotifier({"NOTIFY_SOCKET": manager.address, "WATCHDOG_USEC": "4000000"})
    assert n.enabled
    before = monotonic_usec()
    n.status("loading model: 42%")
    n.extend_timeout(90_000_000)
    n.ready("ready: pid 4242, 38.6 tok/s last bench, GPU 0 61°C 212 W → ok")
    n.watchdog()
    n.reloading()
    n.ready()
    n.stopping("stopping: SIGTERM")
    after = monotonic_usec()

    msgs = manager.recv_all()
    assert msgs[:3] == [
        "STATUS=loading model: 42%",
        "EXTEND_TIMEOUT_USEC=90000000",
        "READY=1\nSTATUS=ready: pid 4242, 38.6 tok/s last bench, GPU 0 61°C 212 W → ok",
    ]
    assert msgs[3] == "WATCHDOG=1"
    reload_lines = msgs[4].split("\n")
    assert reload_lines[0] == "RELOADING=1"
    key, value = reload_lines[1].split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after
    assert msgs[5:] == ["READY=1", "STOPPING=1\nSTATUS=stopping: SIGTERM"]
    assert set(manager.pids) == {os.getpid()}
    assert (n.sent, n.failures) == (7, 0)


def test_abstract_socket(abstract_manager: FakeManager) -> None:
    n = SdNotifier({"NOTIFY_SOCKET": abstract_manager.address})
    n.ready("up")
    n.stopping()
    assert abstract_manager.recv_all() == ["READY=1\nSTATUS=up", "STOPPING=1"]


def test_status_is_one_line(manager: FakeManager) -> None:
    n = SdNotifier({"NOTIFY_SOCKET": manager.address})
    n.status("first\nsecond\t third  ")
    assert manager.recv() == "STATUS=first second third"


def test_watchdog_usec_from_environment(manager: FakeManager) -> None:
    base = {"NOTIFY_SOCKET": manager.address}
    assert SdNotifier({**base, "WATCHDOG_USEC": "30000000"}).watchdog_usec == 30_000_000
    assert SdNotifier({**base, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
                    ).watchdog_usec == 2_000_000
    for env in ({}, {"WATCHDOG_USEC": "0"}, {"WATCHDOG_USEC": "soon"},
                {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)},
                {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "x"}):
        n = SdNotifier({**base, **env})
        assert n.watchdog_usec is None, env
        n.watchdog()
        assert n.sent == 0
    assert manager.recv_all() == []  # nothing sent when the watchdog is off


def test_pid_argument_is_compared_with_watchdog_pid(manager: FakeManager) -> None:
    env = {"NOTIFY_SOCKET": manager.address, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "77"}
    assert SdNotifier(env, pid=77).watchdog_usec == 1_000_000
    assert SdNotifier(env, pid=78).watchdog_usec is None


def test_watchdog_called_from_a_busy_loop_is_rate_limited(manager: FakeManager) -> None:
    now = [100.0]
    n = SdNotifier({"NOTIFY_SOCKET": manager.address, "WATCHDOG_USEC": "4000000"}, clock=lambda: now[0])
    for t in (100.0, 100.2, 100.9, 101.0, 101.5, 102.0, 102.1, 104.0):  # pings at most every 1 s
        now[0] = t
        n.watchdog()
    assert manager.recv_all() == ["WATCHDOG=1"] * 4  # at 100.0, 101.0, 102.0, 104.0


def test_without_notify_socket_everything_is_a_quiet_no_op() -> None:
    n = SdNotifier({})
    assert not n.enabled
    n.ready("x")
    n.status("x")
    n.reloading()
    n.stopping()
    n.watchdog()
    n.extend_timeout(1)
    assert not n.notify("READY=1")
    assert n.sent == 0
    assert n.failures == 0
    n.close()


def test_never_raises_when_the_socket_goes_away(tmp_path: Path) -> None:
    m = FakeManager(str(tmp_path / "gone"))
    n = SdNotifier({"NOTIFY_SOCKET": m.address})
    n.ready()
    assert n.sent == 1
    m.close()
    os.unlink(m.address)
    n.status("still here")
    assert n.failures == 1
    # The manager comes back (e.g. daemon-reexec re-creates the socket): the notifier reconnects.
    m2 = FakeManager(m.address)
    try:
        n.status("back")
        assert n.sent == 2
        assert m2.recv() == "STATUS=back"
    finally:
        m2.close()


def test_bad_socket_path_never_raises(tmp_path: Path) -> None:
    for address in (str(tmp_path / "missing"), "@", "relative/path", "x" * 200):
        n = SdNotifier({"NOTIFY_SOCKET": address})
        n.ready()
        assert n.failures == 1


def test_a_full_manager_queue_does_not_block(manager: FakeManager, monkeypatch: pytest.MonkeyPatch) -> None:
    # One bounded wait per failed send, no retry: every send is one attempt on a socket whose timeout is
    # send_timeout_s (counted, not timed).
    from llama_guard.output import notify

    attempts: list[float | None] = []
    real = notify._SdNotifier.notify

    def counted(self: notify._SdNotifier, payload: bytes) -> None:
        assert self.socket is not None
        attempts.append(self.socket.gettimeout())
        real(self, payload)

    monkeypatch.setattr(notify._SdNotifier, "notify", counted)
    n = SdNotifier({"NOTIFY_SOCKET": manager.address}, send_timeout_s=0.05)
    results = [n.notify(f"STATUS=n {i}") for i in range(40)]  # nobody reads: the queue fills up
    assert results[0]
    assert not all(results)
    assert attempts == [0.05] * 40, attempts
    assert n.failures == results.count(False) > 0


def test_child_environ_strips_manager_variables() -> None:
    base = {"PATH": "/usr/bin", "NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000",
            "WATCHDOG_PID": "1", "LISTEN_FDS": "1", "LISTEN_PID": "1", "CUDA_VISIBLE_DEVICES": "0",
            "JOURNAL_STREAM": "8:1"}
    env = child_environ(base, {"LISTEN_FDS": "3", "OMP_NUM_THREADS": "2"})
    assert env == {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0", "JOURNAL_STREAM": "8:1",
                   "OMP_NUM_THREADS": "2"}  # [server].env cannot put a manager variable back
    assert base["NOTIFY_SOCKET"] == "/run/systemd/notify"  # a copy; the input is untouched


def test_default_environment_and_unset(manager: FakeManager) -> None:
    """In a real process: SdNotifier() reads os.environ, and unset_environment hides the variables
    from every later subprocess."""
    code = textwrap.dedent("""
        import os, subprocess, sys
        from llama_guard.output.notify import SdNotifier
        n = SdNotifier(unset_environment=True)
        n.ready("from child")
        print(n.watchdog_usec, "NOTIFY_SOCKET" in os.environ, "WATCHDOG_USEC" in os.environ)
        sub = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('NOTIFY_SOCKET'))"],
                             capture_output=True, text=True)
        print(sub.stdout.strip())
    """)
    env = dict(os.environ, NOTIFY_SOCKET=manager.address, WATCHDOG_USEC="3000000")
    env.pop("WATCHDOG_PID", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=30, check=True)
    assert out.stdout.split() == ["3000000", "False", "False", "None"]
    assert manager.recv() == "READY=1\nSTATUS=from child"
