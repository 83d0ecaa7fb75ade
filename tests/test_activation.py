"""sd_listen_fds(3) as llama-guard speaks it (front/activation.py), against real sockets passed the
way systemd passes them: at fd 3 on, ``LISTEN_PID`` the receiver's own pid (set by a shell that then
execs it), ``LISTEN_FDS`` and ``LISTEN_FDNAMES``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
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
