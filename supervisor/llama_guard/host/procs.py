"""Questions about processes and ports, answered from ``/proc`` through psutil. Every function here
blocks (it reads ``/proc``): the daemon calls them on its ``proc`` lane, with a deadline."""

from __future__ import annotations

import psutil


def owns_port(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on TCP ``port`` (psutil; True when it cannot be told), so
    that another process answering /health on that port is never taken for our server."""
    try:
        conns = psutil.Process(pid).net_connections(kind="inet")
    except psutil.AccessDenied:
        return True
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def port_owner(pid: int, port: int) -> tuple[int, str] | None:
    """``(pid, comm)`` of the process among ``pid`` and its descendants that listens on TCP
    ``port`` (a wrapper script may fork the real llama-server), or None when none of them does.
    Reads ``/proc`` through psutil (blocking: call it off the loop)."""
    if owns_port(pid, port):
        return pid, ""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        if owns_port(child.pid, port):
            try:
                return child.pid, child.name()
            except psutil.Error:
                return child.pid, ""
    return None


SCAN_TRIES = 3  # scans of /proc for one answer: each may meet a process's fd as it closes


def port_listener(port: int) -> int | None:
    """The pid listening on TCP ``port`` (0 when it cannot be told whose), else None. Blocking."""
    for _ in range(SCAN_TRIES):
        try:
            conns = psutil.net_connections(kind="inet")
            break
        except psutil.Error:
            return None
        except OSError:  # another process's fd closed mid-scan (/proc answers EBADF): scanned again
            continue
    else:
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            return c.pid or 0
    return None


def port_holder(port: int) -> tuple[int | None, str]:
    """``(pid, name)`` of the process listening on TCP ``port``: ``(None, "")`` when nobody does,
    ``(None, "?")`` when someone does whose pid cannot be read (another user's, without root).
    Blocking (a /proc scan)."""
    pid = port_listener(port)
    if pid is None:
        return None, ""
    if pid == 0:
        return None, "?"
    try:
        return pid, psutil.Process(pid).name()
    except psutil.Error:
        return pid, ""
