"""sd_listen_fds(3) as llama-guard speaks it (front/activation.py), against real sockets passed the
way systemd passes them: at fd 3 on, ``LISTEN_PID`` the receiver's own pid (set by a shell that then
execs it), ``LISTEN_FDS`` and ``LISTEN_FDNAMES``."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import ROOT, DaemonRun, RunPool
from llama_guard.front.activation import front_socket

CHILD = """
import fcntl, json, os, sys
from llama_guard.front.activation import front_socket, take
from llama_guard.config.listen import parse_listens
listen = sys.argv[1]
passed = take()
chosen = front_socket(passed, listen, parse_listens(listen) if listen else [])
print(json.dumps({
    "names": [name for name, _ in passed],
    "cloexec": [bool(fcntl.fcntl(s.fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC) for _, s in passed],
    "left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
    "chosen": chosen if isinstance(chosen, str) or chosen is None else chosen.getsockname()[1],
}))
"""


@pytest.fixture
def listeners() -> Iterator[list[socket.socket]]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    yield socks
    for sock in socks:
        sock.close()


def passed_to_child(socks: list[socket.socket], names: str, listen: str, *, pid: str = "$$") -> dict[str, object]:
    """Run CHILD with ``socks`` at fds 3, 4, … and the variables systemd sets; its JSON answer."""
    def preexec() -> None:
        high = [os.dup2(sock.fileno(), 100 + index) for index, sock in enumerate(socks)]
        for index, fd in enumerate(high):
            os.dup2(fd, 3 + index)  # dup2 leaves the new fd inheritable
    script = (f"export LISTEN_PID={pid} LISTEN_FDS={len(socks)} LISTEN_FDNAMES={names}; "
              f"exec {sys.executable} -c \"$0\" \"$1\"")
    done = subprocess.run(["sh", "-c", script, CHILD, listen], capture_output=True, text=True, timeout=60,
                          preexec_fn=preexec, pass_fds=range(3, 3 + len(socks)), check=False)
    assert done.returncode == 0, done.stderr
    answer: dict[str, object] = json.loads(done.stdout)
    return answer


def test_the_named_socket_is_taken_close_on_exec_and_the_variables_removed(listeners: list[socket.socket]) -> None:
    port = listeners[1].getsockname()[1]
    answer = passed_to_child(listeners, "other:front", f"127.0.0.1:{port}")
    assert answer == {"names": ["other", "front"], "cloexec": [True, True], "left": [], "chosen": port}


def test_a_socket_on_another_port_or_with_the_front_door_off_is_refused(listeners: list[socket.socket]) -> None:
    bound = listeners[0].getsockname()[1]
    other = listeners[1].getsockname()[1]
    wrong = passed_to_child(listeners[:1], "front", f"127.0.0.1:{other}")["chosen"]
    assert isinstance(wrong, str) and f"127.0.0.1:{bound}" in wrong and f"127.0.0.1:{other}" in wrong
    off = passed_to_child(listeners[:1], "front", "")["chosen"]
    assert isinstance(off, str) and "[front].listen is off" in off
    unnamed = passed_to_child(listeners, "a:b", f"127.0.0.1:{bound}")["chosen"]
    assert isinstance(unnamed, str) and "none is named 'front'" in unnamed


def test_sockets_meant_for_another_pid_are_not_taken(listeners: list[socket.socket]) -> None:
    answer = passed_to_child(listeners, "front", "", pid="1")
    assert answer == {"names": [], "cloexec": [], "left": [], "chosen": None}


def test_a_passed_socket_that_is_not_listening_is_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        reason = front_socket([("front", sock)], "x", [("127.0.0.1", sock.getsockname()[1])])
    assert isinstance(reason, str) and "not a listening TCP socket" in reason


# --- the daemon on a passed socket, stopping (as across `systemctl restart llama-guard`) -------------------

def _holds(pid: int, inode: int) -> bool:
    """Whether process ``pid`` has a descriptor of the socket ``inode``."""
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd) == f"socket:[{inode}]":
                return True
    return False


def _start_activated(run: DaemonRun, sock: socket.socket) -> None:
    """Start ``run`` as systemd starts a socket-activated service: ``sock`` at fd 3, ``LISTEN_PID`` its pid."""
    def preexec() -> None:
        os.dup2(os.dup(sock.fileno()), 3)  # dup2 leaves the new fd inheritable

    script = 'export LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=front; exec "$0" "$@"'
    log = run.log_path.open("ab")
    run.proc = subprocess.Popen(["sh", "-c", script, *run.command, "run", "--config", str(run.config)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=run.env, cwd=str(ROOT),
                                preexec_fn=preexec, pass_fds=(3,))
    log.close()


@pytest.mark.timeout(120)
def test_a_stopping_daemon_leaves_new_connections_queued_for_the_next(
        tmp_path: Path, fake_server: Path, real_model: Path) -> None:
    # The service manager's copy of the socket is this test's: what the stopping daemon does not accept, the
    # test accepts, as the next daemon would. Before: the daemon kept accepting while it drained and answered
    # each new request 503 (65 of 486 across a `systemctl restart` in the report).
    shared = socket.create_server(("127.0.0.1", 0), backlog=64)
    port, inode = shared.getsockname()[1], os.fstat(shared.fileno()).st_ino
    gate = tmp_path / "stream-gate"
    pool = RunPool()
    run = pool.new(tmp_path, str(fake_server), str(real_model), {
        "server": {"env": {"FAKE_LLAMA_STREAM_GATE": str(gate)}},
        "front": {"listen": f"127.0.0.1:{port}", "stop_drain_s": 60.0}, "health": {"canary": False}})
    try:
        _start_activated(run, shared)
        assert run.wait_event("front_listening", 30)["activated"] is True
        run.wait_event("server_ready", 30)
        assert _holds(run.pid, inode)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as client, \
                client.stream("POST", "/completion", json={"prompt": "hi", "n_predict": 3, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # in flight: its second event waits for the gate
            idle = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # a keep-alive client, idle
            idle.request("GET", "/livez")
            answer = idle.getresponse()
            assert answer.status == 200 and answer.read() and not answer.will_close
            run.signal(signal.SIGTERM)
            run.wait_event("daemon_stopping", 30)
            deadline = time.monotonic() + 30  # a bound for the failure only: the marker is the descriptor gone
            while _holds(run.pid, inode) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _holds(run.pid, inode), "the stopping daemon still accepts on the shared socket"
            # A request on a connection accepted before the stop: 503, and the connection closed, so that the
            # client's retry connects anew — into the queue.
            idle.request("POST", "/completion", body=b"{}", headers={"Content-Type": "application/json"})
            refused = idle.getresponse()
            assert refused.status == 503 and refused.read() and refused.will_close
            idle.close()
            # A new client: its connection waits in the kernel's queue, for the next daemon (here: the test).
            with socket.create_connection(("127.0.0.1", port), timeout=30) as new:
                new.sendall(b"POST /completion HTTP/1.1\r\nHost: front\r\nContent-Length: 2\r\n\r\n{}")
                shared.settimeout(30)
                taken, _ = shared.accept()
                with taken:
                    assert taken.recv(64).startswith(b"POST /completion HTTP/1.1")
            gate.touch()  # the request in flight finishes within the drain
            rest = list(lines)
        assert any('"stop": true' in line for line in rest), rest
        assert run.wait_exit(60) == 0
    finally:
        shared.close()
        leftovers = pool.finish()
    assert leftovers == [], f"server pids {leftovers} outlived their daemon"
