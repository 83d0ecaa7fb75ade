"""The sd_notify protocol towards systemd: readiness, status, reload, stop, watchdog.

:class:`SdNotifier` speaks the protocol itself over an ``AF_UNIX`` datagram socket (a dozen lines;
the ``sdnotify`` package was dropped: it reads the address only from ``os.environ``, has no send
timeout and encodes as Latin-1, so it was bypassed anyway). It reads ``$NOTIFY_SOCKET`` (a path, or
``@name`` for an abstract socket), ``$WATCHDOG_USEC`` and ``$WATCHDOG_PID`` once, at
construction. Every method is a no-op when there is no socket, and none of them raises: a
notification that cannot be sent is counted in :attr:`SdNotifier.failures`, never an error. Each
send waits at most ``send_timeout_s`` for room in the manager's queue.

The environment for llama-server, without the variables that belong to llama-guard's own
service manager, is :func:`llama_guard.core.child.child_environ`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

# Errors after which a fresh connection may help: the socket was re-created or went away.
_RECONNECT_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ENOTCONN, errno.EPIPE, errno.ENOENT})


def monotonic_usec() -> int:
    """``CLOCK_MONOTONIC`` in microseconds, the clock systemd compares ``MONOTONIC_USEC`` with."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _SdNotifier:
    """A datagram socket connected to ``address`` (a path, or ``@name``: abstract), with a send
    timeout; :meth:`notify` raises OSError so :class:`SdNotifier` can count and reconnect."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.socket: socket.socket | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout_s)
            sock.connect("\0" + address[1:] if address.startswith("@") else address)
        except BaseException:
            sock.close()
            raise
        self.socket = sock

    def notify(self, payload: bytes) -> None:
        assert self.socket is not None
        self.socket.sendall(payload)


class SdNotifier:
    """Tells systemd how llama-guard is doing (``Type=notify``, ``WatchdogSec=``).

    ``environ``: where to read ``NOTIFY_SOCKET``/``WATCHDOG_USEC``/``WATCHDOG_PID`` (default
    ``os.environ``). ``pid``: this process's pid, compared with ``WATCHDOG_PID`` (default
    ``os.getpid()``). ``unset_environment``: remove those variables from ``os.environ`` after
    reading them, so no subprocess inherits them. ``send_timeout_s``: the longest one send may
    wait (seconds). ``clock``: monotonic seconds, for the watchdog's rate limit. Methods return
    nothing and never raise; :attr:`sent` and :attr:`failures` count what happened.
    """

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        pid: int | None = None,
        unset_environment: bool = False,
        send_timeout_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        env = os.environ if environ is None else environ
        self._clock = clock
        self._last_ping: float | None = None
        self.address: str | None = env.get("NOTIFY_SOCKET") or None
        self._timeout_s = send_timeout_s
        self._sd: _SdNotifier | None = None
        self.sent = 0
        """Notifications the socket accepted."""
        self.failures = 0
        """Notifications that could not be sent."""
        self.watchdog_usec: int | None = self._watchdog_usec(env, os.getpid() if pid is None else pid)
        """``$WATCHDOG_USEC`` when the watchdog applies to this process, else ``None``."""
        if unset_environment:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(key, None)
        if self.address:
            self._connect()

    @staticmethod
    def _watchdog_usec(env: Mapping[str, str], pid: int) -> int | None:
        try:
            usec = int(env.get("WATCHDOG_USEC", ""))
        except ValueError:
            return None
        if usec <= 0:
            return None
        wd_pid = env.get("WATCHDOG_PID")
        if wd_pid:
            try:
                if int(wd_pid) != pid:
                    return None
            except ValueError:
                return None
        return usec

    @property
    def enabled(self) -> bool:
        """Whether ``$NOTIFY_SOCKET`` was set (a service manager listens)."""
        return self.address is not None

    def _connect(self) -> bool:
        assert self.address is not None
        try:
            self._sd = _SdNotifier(self.address, self._timeout_s)
        except Exception:  # never raise from a notify
            self._sd = None
            return False
        return True

    def notify(self, state: str) -> bool:
        """Send the raw ``state`` (``KEY=value`` lines). Returns whether it was sent.

        A send refused because the socket went away is retried once on a fresh connection (the
        manager may have re-created it, e.g. after ``systemctl daemon-reexec``); a send that timed
        out (the manager's queue is full) is not. Never raises.
        """
        if self.address is None:
            return False
        payload = state.encode("utf-8", "replace")  # systemd reads UTF-8 (°C, → ...)
        for attempt in (1, 2):
            if self._sd is None and not self._connect():
                break
            try:
                assert self._sd is not None
                self._sd.notify(payload)
            except OSError as exc:
                self._close_socket()
                if attempt == 2 or exc.errno not in _RECONNECT_ERRNOS:
                    break  # a full queue (timeout) is not helped by a new connection
                continue
            except Exception:
                self._close_socket()
                break
            self.sent += 1
            return True
        self.failures += 1
        return False

    def _fields(self, first: str, status: str | None, **extra: Any) -> str:
        lines = [first, *(f"{k}={v}" for k, v in extra.items())]
        if status is not None:
            lines.append(f"STATUS={_one_line(status)}")
        return "\n".join(lines)

    def ready(self, status: str | None = None) -> None:
        """``READY=1`` (plus ``STATUS=`` when given): the server answers ``/health`` 200, or a
        reload finished."""
        self.notify(self._fields("READY=1", status))

    def status(self, text: str) -> None:
        """``STATUS=<text>``: a one-line human summary (newlines become spaces)."""
        self.notify(f"STATUS={_one_line(text)}")

    def reloading(self, status: str | None = None) -> None:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (now, CLOCK_MONOTONIC µs); follow with
        :meth:`ready` when the reload is done."""
        self.notify(self._fields("RELOADING=1", status, MONOTONIC_USEC=monotonic_usec()))

    def stopping(self, status: str | None = None) -> None:
        """``STOPPING=1``: shutdown has begun."""
        self.notify(self._fields("STOPPING=1", status))

    def watchdog(self) -> None:
        """``WATCHDOG=1`` when the watchdog applies to this process; nothing otherwise.

        Call it from the main loop as often as it turns (each turn at least every few seconds):
        pings closer together than a quarter of ``$WATCHDOG_USEC`` are skipped, so a loop that
        turns many times a second does not flood the manager, and the gap between two pings
        stays below that quarter plus one loop turn.
        """
        if self.watchdog_usec is None:
            return
        now = self._clock()
        if self._last_ping is not None and now - self._last_ping < self.watchdog_usec / 4e6:
            return
        if self.notify("WATCHDOG=1"):
            self._last_ping = now

    def extend_timeout(self, usec: int) -> None:
        """``EXTEND_TIMEOUT_USEC=<usec>``: the current start/stop timeout ends no earlier than
        ``usec`` microseconds from now. Send it again before it runs out while loading progresses;
        stop sending it when the load is stuck, and systemd fails the start."""
        self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(usec))}")

    def _close_socket(self) -> None:
        if self._sd is not None and self._sd.socket is not None:
            with contextlib.suppress(OSError):
                self._sd.socket.close()
        self._sd = None

    def close(self) -> None:
        """Close the socket. Later notifications reconnect."""
        self._close_socket()
