"""systemd socket activation for the front door: the listening socket passed by ``llama-guard.socket``.

The protocol is sd_listen_fds(3), spoken here directly (as sd_notify is in
:mod:`llama_guard.output.notify`): the service manager starts the daemon with the sockets already
open as file descriptors 3, 4, … (``SD_LISTEN_FDS_START``), ``$LISTEN_FDS`` their count,
``$LISTEN_PID`` the pid they are meant for (a process that inherited the variables is not), and
``$LISTEN_FDNAMES`` their names, colon-separated (each socket's ``FileDescriptorName=``). They
arrive without close-on-exec: :func:`take` sets it at once, so that llama-server never inherits
the clients' socket, and removes the variables, as ``sd_listen_fds(1)`` does.

systemd keeps its own copy of the socket open while the service restarts, so connections made
meanwhile wait in the kernel's accept queue (``Backlog=``) for the next daemon instead of being
refused. Without a passed socket the front door binds its address itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
from collections.abc import MutableMapping

from llama_guard.config.listen import host_port

SD_LISTEN_FDS_START = 3
FRONT_NAME = "front"  # FileDescriptorName= of the front door's socket in llama-guard.socket
VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def take(environ: MutableMapping[str, str] | None = None) -> list[tuple[str, socket.socket]]:
    """The sockets the service manager passed to this process, as ``(name, socket)`` in fd order
    (a name is "" when ``$LISTEN_FDNAMES`` gives none); each fd is made close-on-exec and the
    variables are removed from ``environ`` (default: ``os.environ``). Empty when nothing was passed
    to this pid. Call once, before any child is started. Never raises."""
    env = os.environ if environ is None else environ
    values = {name: env.pop(name, "") for name in VARIABLES}
    try:
        if int(values["LISTEN_PID"]) != os.getpid():
            return []
        count = int(values["LISTEN_FDS"])
    except ValueError:
        return []
    names = values["LISTEN_FDNAMES"].split(":") if values["LISTEN_FDNAMES"] else []
    passed = []
    for index in range(max(0, count)):
        fd = SD_LISTEN_FDS_START + index
        try:
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        passed.append((names[index] if index < len(names) else "", sock))
    return passed


def front_socket(passed: list[tuple[str, socket.socket]], listen: str,
                 addresses: list[tuple[str, int]]) -> socket.socket | str | None:
    """The passed socket that serves the front door: the one named :data:`FRONT_NAME`, else the
    only one passed. None when none was passed; a reason (str) when it cannot serve one of ``addresses``
    (``[front].listen`` = ``listen``; empty: the front door is off): not a listening TCP socket, or
    bound to another port, or to another IP address than those configured. The front door binds the
    other addresses itself (:func:`serves` tells which one the socket serves)."""
    if not passed:
        return None
    named = [sock for name, sock in passed if name == FRONT_NAME]
    if named:
        sock = named[0]
    elif len(passed) == 1:
        sock = passed[0][1]
    else:
        return (f"systemd passed {len(passed)} sockets ({', '.join(n or '?' for n, _ in passed)}) and none is named "
                f"{FRONT_NAME!r}: set FileDescriptorName={FRONT_NAME} on the front door's socket")
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        bound = sock.getsockname()
    except OSError as exc:
        return f"the socket systemd passed cannot be used: {exc.strerror or exc}"
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM or not listening:
        return "the socket systemd passed is not a listening TCP socket (ListenStream= in llama-guard.socket)"
    where = host_port(str(bound[0]), int(bound[1]))
    if not addresses:
        return (f"systemd passed a socket on {where} but [front].listen is off: set it to {where!r}, or disable "
                "llama-guard.socket")
    if not any(serves(sock, address) for address in addresses):
        return (f"systemd passed a socket on {where} but [front].listen = {listen!r}: make ListenStream= in "
                "llama-guard.socket and [front].listen name the same address")
    return sock


def serves(sock: socket.socket, address: tuple[str, int]) -> bool:
    """Whether the listening ``sock`` is bound to ``address`` (a configured host name: any address)."""
    try:
        bound = sock.getsockname()
    except OSError:
        return False
    return int(bound[1]) == address[1] and _same_host(address[0], str(bound[0]))


def _same_host(configured: str, bound: str) -> bool:
    """Whether the configured host is the bound address (a host name is not resolved: any)."""
    try:
        want = ipaddress.ip_address(configured)
    except ValueError:
        return True
    with contextlib.suppress(ValueError):
        have = ipaddress.ip_address(bound)
        mapped = getattr(have, "ipv4_mapped", None)
        return want in (have, mapped)
    return False
