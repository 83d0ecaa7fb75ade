"""Which llama-guard daemon serves a configuration, from what only the kernel knows — never from a
name or a file another local user could take.

* The runtime directory's lock: an exclusive ``flock(2)`` on ``<[runtime].dir>/llama-guard.lock``.
  The directory must belong to this user and be writable by nobody else (:func:`unsafe_dir`, checked
  before every lock), and the file is opened without following a symbolic link and must belong to
  this user: only the service's own user can open it, so only it can hold the lock. Who holds it
  is read from the kernel's lock table (``/proc/locks``, proc(5): the pid that took the ``FLOCK``
  on the file's device and inode, :func:`lock_holder`), not from the file's text.
* A deleted runtime directory: the daemon keeps its lock on the unlinked file and takes the lock of
  the file it finds (or makes) at that path again at its next status write; meanwhile a second
  daemon of the same configuration is refused by the ports: llama-server's ``[server].port`` (and
  the front door's) is listened on by this user's llama-guard or by its child (:func:`port_daemon`,
  from the kernel's socket table). A port held by anyone else is no reason to refuse: llama-guard
  names that holder and waits for the port (``server_port_taken``, ``front_port_taken``).

A holder that is not llama-guard is named as what it is (:func:`describe`: pid, executable and
command line).
"""

from __future__ import annotations

import itertools
import os
import shlex
import stat
from pathlib import Path

import psutil

from llama_guard.host.procs import port_listener

PROC_LOCKS = Path("/proc/locks")
ANCESTORS = 4  # how far up from a port's listener a llama-guard is looked for (a wrapper script, llama-server)


def unsafe_dir(directory: Path) -> str:
    """Why ``directory`` cannot hold this user's instance lock ("" when it can): it must be a real
    directory (not a symbolic link) owned by this user, without write permission for group or
    others. Raises OSError when it cannot be examined."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{directory} belongs to uid {st.st_uid}, not to llama-guard's user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return (f"{directory} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): another user could "
                "replace llama-guard's lock; chmod go-w it")
    return ""


def lock_holder(path: Path) -> int | None:
    """The pid holding a ``flock`` on the file at ``path`` (from ``/proc/locks``), None when the
    file is absent or nobody holds one, 0 when one is held by a process whose pid this process
    cannot see (another pid namespace)."""
    try:
        st = os.stat(path)
        table = PROC_LOCKS.read_text()
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1609 fe:00:2146384 0 EOF"; a blocked waiter's line has "->".
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device:
            try:
                return max(0, int(fields[4]))
            except ValueError:
                return 0
    return None


def is_llama_guard(pid: int) -> bool:
    """Whether process ``pid`` is a llama-guard daemon (``llama-guard run …`` or ``python -m
    llama_guard run …``: its command line), so that a stale pid file reused by another process is
    never signalled. True when the command line cannot be read (the signal itself would then be
    refused if it is not ours)."""
    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True
    names = [os.path.basename(word) for word in cmdline[:3]]
    script = "llama-guard" in names
    module = any(a == "-m" and b == "llama_guard" for a, b in itertools.pairwise(cmdline))
    return (script or module) and "run" in cmdline


def describe(pid: int) -> str:
    """A process as people should know it: ``pid 4242 (/usr/bin/python3: python3 squat.py)``."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            try:
                exe = proc.exe()
            except psutil.AccessDenied:
                exe = proc.name()
            cmdline = shlex.join(proc.cmdline())
    except psutil.Error:
        return f"pid {pid}"
    text = f"{exe}: {cmdline}" if cmdline and cmdline != exe else exe
    return f"pid {pid} ({text[:200]})" if text else f"pid {pid}"


def port_daemon(port: int) -> int | None:
    """The pid of this user's llama-guard that serves TCP ``port``: the port's listener itself (a
    front door) or one of its :data:`ANCESTORS` (its llama-server), running as this user; None
    when nobody listens there or the listener is something else. Blocking (a /proc scan)."""
    pid = port_listener(port)
    if not pid:
        return None
    try:
        proc: psutil.Process | None = psutil.Process(pid)
        for _ in range(ANCESTORS + 1):
            if proc is None:
                return None
            if proc.uids().effective == os.geteuid() and is_llama_guard(proc.pid):
                return proc.pid
            proc = proc.parent()
    except psutil.Error:
        return None
    return None
