"""The service-manager side of the daemon: the hooks it calls (sd_notify, see
:class:`llama_guard.output.notify.SdNotifier`), a do-nothing stand-in, the start-timeout
extension that keeps systemd's ``TimeoutStartSec`` ahead of a model that is still loading, and the
stop-timeout extension that keeps ``TimeoutStopSec`` from SIGKILLing a GPU reset half way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from llama_guard.model.types import State
from llama_guard.vocab.phases import Phase

# While the model loads, each sign of progress pushes systemd's start timeout this far out (µs).
EXTEND_TIMEOUT_USEC = 120_000_000
EXTEND_EVERY_S = 10.0  # at most one EXTEND_TIMEOUT_USEC= message per this many seconds
# While a stop waits (the server's exit, a GPU reset), systemd is told how long is left this often,
# with this margin for the cleanup after it (the watchers' close, bounded at 10 s each).
STOP_EXTEND_EVERY_S = 5.0
STOP_MARGIN_S = 20.0


class ServiceNotifier(Protocol):
    """The service-manager hooks the daemon calls (sd_notify; see output.notify.SdNotifier)."""

    def ready(self, status: str | None = None) -> None: ...
    def status(self, text: str) -> None: ...
    def reloading(self, status: str | None = None) -> None: ...
    def stopping(self, status: str | None = None) -> None: ...
    def watchdog(self) -> None: ...
    def extend_timeout(self, usec: int) -> None: ...


class NullNotifier:
    """No service manager: every hook does nothing."""

    def ready(self, status: str | None = None) -> None: ...
    def status(self, text: str) -> None: ...
    def reloading(self, status: str | None = None) -> None: ...
    def stopping(self, status: str | None = None) -> None: ...
    def watchdog(self) -> None: ...
    def extend_timeout(self, usec: int) -> None: ...


class StartTimeout:
    """Keeps systemd's start timeout ahead while the server loads or waits for VRAM; rate-limited
    to one message per EXTEND_EVERY_S (monotonic ``clock`` seconds)."""

    def __init__(self, notifier: ServiceNotifier, clock: Callable[[], float]) -> None:
        self._notifier = notifier
        self._clock = clock
        self._last = float("-inf")

    def extend(self) -> None:
        """Push the timeout EXTEND_TIMEOUT_USEC out, unless that was done less than EXTEND_EVERY_S ago."""
        now = self._clock()
        if now - self._last >= EXTEND_EVERY_S:
            self._last = now
            self._notifier.extend_timeout(EXTEND_TIMEOUT_USEC)


class StopTimeout:
    """While a stop waits for something bounded — the server's exit (grace, SIGKILL, its wait) or a
    GPU reset command, which is never interrupted — tells systemd how long is left
    (``EXTEND_TIMEOUT_USEC``: the state's deadline + STOP_MARGIN_S), at most every STOP_EXTEND_EVERY_S."""

    def __init__(self, notifier: ServiceNotifier, clock: Callable[[], float]) -> None:
        self._notifier = notifier
        self._clock = clock
        self._last = float("-inf")

    def extend(self, state: State) -> None:
        """Call on every loop step after ``STOPPING=1``; sends only while STOPPING, RESETTING or
        DRAINING before the exit (then the server's stop follows the drain)."""
        if state.phase not in (Phase.STOPPING, Phase.RESETTING, Phase.DRAINING) or state.deadline is None:
            return
        now = self._clock()
        if now - self._last < STOP_EXTEND_EVERY_S:
            return
        self._last = now
        left = max(0.0, state.deadline - now)
        if state.phase is Phase.DRAINING:
            left += state.params.stop_grace_s  # then SIGTERM, and SIGKILL at the grace deadline
        if state.phase in (Phase.STOPPING, Phase.DRAINING) and not state.killed:
            left += state.params.kill_wait_s  # SIGKILL at the deadline, then its wait
        self._notifier.extend_timeout(int((left + STOP_MARGIN_S) * 1_000_000))
