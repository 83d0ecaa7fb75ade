"""The service-manager side of the daemon: the hooks it calls (sd_notify, see
:class:`llama_guard.output.notify.SdNotifier`), a do-nothing stand-in, and the start-timeout
extension that keeps systemd's ``TimeoutStartSec`` ahead of a model that is still loading.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# While the model loads, each sign of progress pushes systemd's start timeout this far out (µs).
EXTEND_TIMEOUT_USEC = 120_000_000
EXTEND_EVERY_S = 10.0  # at most one EXTEND_TIMEOUT_USEC= message per this many seconds


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
