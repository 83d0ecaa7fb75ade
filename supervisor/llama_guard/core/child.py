"""The llama-server child process: spawn, signal, read its output, reap.

The child runs in its own session and process group (signals go to the whole group), gets
``PR_SET_PDEATHSIG=SIGKILL`` so it dies with the daemon even after a SIGKILL of the daemon,
and inherits the daemon's environment plus ``[server].env`` minus the service manager's
notification variables. stdout and stderr are one pipe, read line by line as written.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import signal
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

_PR_SET_PDEATHSIG = 1
_LINE_LIMIT = 1 << 20  # bytes; longer lines are split, never an error
_NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_prctl = _libc.prctl


def child_environ(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus ``extra``, without ``NOTIFY_SOCKET`` / ``WATCHDOG_USEC`` / ``WATCHDOG_PID``."""
    env = {k: v for k, v in base.items() if k not in _NOTIFY_VARS}
    env.update(extra)
    return env


def _make_preexec(parent_pid: int, extra: Callable[[], None] | None) -> Callable[[], None]:
    """A preexec_fn that only calls pre-resolved C functions (safe between fork and exec)."""

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the daemon died before prctl took effect
            os._exit(1)
        if extra is not None:
            extra()

    return preexec


@dataclass
class ServerProcess:
    """A running llama-server: ``pid`` is also its process-group id."""

    proc: asyncio.subprocess.Process
    argv: list[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

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
        """The child's stdout+stderr, one decoded line at a time (without the newline), until EOF."""
        stream = self.proc.stdout
        assert stream is not None
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over the limit: take what is buffered as one piece
                raw = await stream.read(_LINE_LIMIT)
            if not raw:
                return
            yield raw.decode("utf-8", errors="replace").rstrip("\r\n")

    async def wait(self) -> int:
        """Wait for the child to exit and return its status (negative: killed by that signal).

        Afterwards, any process left in its group gets SIGKILL, so nothing outlives the server.
        """
        code = await self.proc.wait()
        self.signal_group(signal.SIGKILL)
        return code


async def spawn(argv: list[str], env: Mapping[str, str], *,
                preexec_extra: Callable[[], None] | None = None,
                cwd: str | None = None) -> ServerProcess:
    """Start llama-server. Raises OSError (FileNotFoundError, PermissionError …) if exec fails."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_make_preexec(os.getpid(), preexec_extra),
        limit=_LINE_LIMIT,
    )
    return ServerProcess(proc=proc, argv=list(argv))


async def kill_and_reap(server: ServerProcess, timeout_s: float = 5.0) -> None:
    """SIGKILL the group and wait (bounded) for the exit; for the daemon's last-resort cleanup."""
    server.signal_group(signal.SIGKILL)
    with contextlib.suppress(asyncio.TimeoutError, ProcessLookupError):
        await asyncio.wait_for(server.proc.wait(), timeout_s)
