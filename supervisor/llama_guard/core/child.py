"""The llama-server child process: spawn, signal, read its output, reap.

The child runs in its own session and process group (signals go to the whole group), gets
``PR_SET_PDEATHSIG=SIGKILL`` so it dies with the daemon even after a SIGKILL of the daemon,
and inherits the daemon's environment plus ``[server].env`` minus the service manager's
notification and socket-activation variables. stdout and stderr are one pipe, read line by line
as written. The exit is learnt from the kernel (a pidfd, :meth:`ServerProcess.exited`), never
from the pipe's end: a grandchild that left the process group can hold the pipe open for good
(:func:`pipe_holders` finds such processes).

No Python runs in the child between fork and exec (the daemon has threads; CPython documents
``preexec_fn`` as unsafe there): subprocess's own C code makes the new session, and the child's
first programs are a :class:`ChildSetup`'s wrapper (``setpriv``: the privilege drop and the
parent-death signal) and :data:`GATE`, a ``/bin/sh`` that waits on a pipe. While it waits, the
parent sets the child's rlimits with prlimit(2) — they hold across exec — then opens the gate and
llama-server is exec'd in the same process (one pid throughout). A parent that dies before it
opened the gate leaves the pipe at EOF: the child exits without running llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO

from llama_guard.host.build import clean_text

_LINE_LIMIT = 1 << 20  # bytes; longer lines are split, never an error
# Variables addressed to llama-guard's own main process only (sd_notify(3), sd_listen_fds(3)).
MANAGER_VARIABLES = frozenset({
    "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES",
})

# Reads one line from its stdin (the gate pipe), then becomes the program after it with stdin from
# /dev/null; EOF (the parent died or gave up) ends the child with GATE_CLOSED before llama-server runs.
GATE = 'IFS= read -r _ || exit 125; exec "$@" </dev/null'
GATE_CLOSED = 125


def child_environ(base: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` plus ``extra`` (``[server].env``), without :data:`MANAGER_VARIABLES`
    (``NOTIFY_SOCKET``, ``WATCHDOG_*``, ``LISTEN_*``): the server can never notify systemd on
    llama-guard's behalf nor take its activated sockets. ``extra`` cannot put them back either."""
    env = {k: v for k, v in base.items() if k not in MANAGER_VARIABLES}
    env.update({k: v for k, v in (extra or {}).items() if k not in MANAGER_VARIABLES})
    return env


@dataclass(frozen=True)
class ChildSetup:
    """How a llama-server child is set up before its exec: ``wrapper``, the argv prefix it is exec'd
    through (:func:`llama_guard.core.privileges.drop_argv`; it must end in ``--`` and exec what
    follows), and ``rlimits``, ``(resource, (soft, hard))`` pairs the parent sets with prlimit(2)
    while the child waits at :data:`GATE` (a refused one is skipped: the limits' read-back reports it)."""

    wrapper: tuple[str, ...] = ()
    rlimits: tuple[tuple[int, tuple[int, int]], ...] = ()

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` as the child runs it: the wrapper, then the gate (on stdin), then ``argv``."""
        return [*self.wrapper, "/bin/sh", "-c", GATE, "llama-guard-gate", *argv]

    def release(self, pid: int, gate: int) -> None:
        """Set ``rlimits`` on child ``pid``, then open the gate (write end ``gate``, closed here)."""
        try:
            for res, pair in self.rlimits:
                with contextlib.suppress(OSError, ValueError):
                    resource.prlimit(pid, res, pair)
            os.write(gate, b"\n")
        finally:
            os.close(gate)


@dataclass
class ServerProcess:
    """A running llama-server: ``pid`` is also its process-group id. ``output`` reads the one pipe
    its stdout and stderr share (its read end, made by :func:`spawn`), ``output_inode`` that pipe's
    inode, for :func:`pipe_holders`; ``pidfd`` learns its exit."""

    proc: asyncio.subprocess.Process
    argv: list[str]
    output: asyncio.StreamReader
    output_inode: int
    output_transport: asyncio.ReadTransport = field(repr=False)
    pidfd: int | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def exited(self) -> int | None:
        """Wait until the process has exited and return its status (negative: killed by that
        signal), learnt from a pidfd (``waitid(P_PIDFD, WNOWAIT)``: the zombie stays for asyncio's
        child watcher to reap). Does not wait for the output pipe to close. Falls back to
        :meth:`wait`'s answer where pidfds are missing (Linux < 5.3)."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        if self.pidfd is None:
            return await self.proc.wait()
        await self.gone()
        # Reaped by asyncio's child watcher (which then sets returncode from its thread) or still
        # a zombie (its status read without reaping it): either way the status is known at once.
        for _ in range(200):
            if self.proc.returncode is not None:
                return self.proc.returncode
            try:
                # WNOHANG: the pidfd said it exited; never blocks.
                info = os.waitid(os.P_PIDFD, self.pidfd,  # noqa: ASYNC222
                                 os.WEXITED | os.WNOWAIT | os.WNOHANG)
            except ChildProcessError:
                info = None
            if info is not None:
                return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status
            await asyncio.sleep(0.005)
        return self.proc.returncode

    async def gone(self) -> None:
        """Return once the process has exited, told by the kernel (its pidfd becomes readable; no
        status read, nothing reaped); where pidfds are missing (Linux < 5.3) or the pidfd is closed
        already, once asyncio knows its status (:meth:`asyncio.subprocess.Process.wait`)."""
        if self.proc.returncode is not None:
            return
        if self.pidfd is None:
            await self.proc.wait()
            return
        loop = asyncio.get_running_loop()
        ready = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(self.pidfd, wake)
        try:
            await ready
        finally:
            loop.remove_reader(self.pidfd)

    def close(self) -> None:
        """Release the pidfd and the output pipe's read end (idempotent): a grandchild that still
        holds the write end then gets EPIPE, never a pipe that fills up."""
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None
        self.output_transport.close()

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the child's process group; False when the group is already gone."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False
        return True

    async def lines(self) -> AsyncIterator[str]:
        """The child's stdout+stderr, one decoded line at a time (without the newline), until EOF;
        cleaned as a build's ``--version`` is (:func:`~llama_guard.host.build.clean_text`: the lines go
        into events and ``status``), a carriage return inside a line made a space."""
        stream = self.output
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over the limit: take what is buffered as one piece
                raw = await stream.read(_LINE_LIMIT)
            if not raw:
                return
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            yield text if text.isascii() and text.isprintable() else clean_text(text).replace("\n", " ")


@contextlib.contextmanager
def _gate_pipe() -> Iterator[tuple[int, int]]:
    """The gate pipe of one child start, ``(read end, write end)``: the read end (the child's stdin)
    is closed here once the block that starts the child is done; the write end too when that block
    raises, else it is the caller's to hand to :meth:`ChildSetup.release`."""
    gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
    try:
        yield gate_r, gate_w
    except BaseException:
        os.close(gate_w)
        raise
    finally:
        os.close(gate_r)


def popen(argv: list[str], env: Mapping[str, str], setup: ChildSetup, *,
          stdout: IO[bytes] | int) -> subprocess.Popen[bytes]:
    """:func:`spawn` for a caller without an event loop (``llama-guard bench --spawn``): the same
    session and process group and ``setup``, llama-server's stdin from /dev/null; stdout and stderr go to
    ``stdout``. Raises OSError if the wrapper cannot be exec'd."""
    with _gate_pipe() as (gate_r, gate_w):
        proc = subprocess.Popen(setup.argv(argv), stdin=gate_r, stdout=stdout, stderr=subprocess.STDOUT,
                                env=dict(env), start_new_session=True)
    setup.release(proc.pid, gate_w)
    return proc


async def spawn(argv: list[str], env: Mapping[str, str], setup: ChildSetup, *,
                cwd: str | None = None) -> ServerProcess:
    """Start llama-server through ``setup``. Raises OSError (FileNotFoundError, PermissionError …)
    if the wrapper cannot be exec'd; a failing drop or a missing llama-server is an early exit
    (its reason on the output pipe)."""
    loop = asyncio.get_running_loop()
    # The output pipe is ours, whatever the event loop would make (uvloop's is a socketpair): its
    # inode names the processes that hold it (pipe_holders).
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    inode = os.fstat(out_r).st_ino
    output = asyncio.StreamReader(limit=_LINE_LIMIT)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(output),
                                                    os.fdopen(out_r, "rb", buffering=0))
    except BaseException:
        os.close(out_w)
        raise
    try:
        with _gate_pipe() as (gate_r, gate_w):
            proc = await asyncio.create_subprocess_exec(
                *setup.argv(argv),
                stdin=gate_r,
                stdout=out_w,
                stderr=asyncio.subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
            )
    except BaseException:
        transport.close()
        raise
    finally:
        os.close(out_w)  # the child holds the write end now: EOF comes when its last holder ends
    setup.release(proc.pid, gate_w)
    pidfd: int | None
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (OSError, AttributeError):  # no pidfds here: exit seen through asyncio's watcher
        pidfd = None
    return ServerProcess(proc=proc, argv=list(argv), output=output, output_inode=inode,
                         output_transport=transport, pidfd=pidfd)


def pipe_holders(inode: int, exclude: frozenset[int] = frozenset()) -> list[tuple[int, str]]:
    """``(pid, comm)`` of every process (other than ``exclude``) with a descriptor on the pipe
    ``inode``: after the server exited, whoever still holds its output pipe escaped its process
    group (``setsid``). Reads ``/proc/*/fd`` (blocking: call it off the loop); processes that
    cannot be read are skipped."""
    target = f"pipe:[{inode}]"
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        pid = int(entry.name)
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    break
            except OSError:
                continue
        else:
            continue
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
                comm = handle.read().strip()
        except OSError:
            comm = "?"
        found.append((pid, comm))
    return found


async def kill_and_reap(server: ServerProcess, timeout_s: float = 5.0) -> None:
    """SIGKILL the group and wait (at most ``timeout_s`` seconds) for the exit; for the daemon's
    last-resort cleanup. Woken by the kernel (:meth:`ServerProcess.gone`: its pidfd), never by polling,
    and not by the output pipe's end: a process that escaped the group may hold it. asyncio's child
    watcher reaps it."""
    server.signal_group(signal.SIGKILL)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(server.gone(), timeout_s)
