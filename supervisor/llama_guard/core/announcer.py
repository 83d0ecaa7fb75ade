"""What the daemon tells the outside about itself while it runs: the status line (sd_notify
``STATUS=``), ``status.json`` (:mod:`llama_guard.status.snapshot`), and ``READY=1`` /
``STOPPING=1`` towards systemd — ``STOPPING=1`` once, when a stop of the daemon begins, never
``READY=1`` after it.

Reads the daemon's state, configuration and serving server through getters; writes nothing else.
A GPU port whose status fragment fails leaves the line without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llama_guard.config import Config
from llama_guard.core.gpu_port import GpuPort
from llama_guard.core.server import ServerWatch
from llama_guard.core.service import ServiceNotifier
from llama_guard.model.types import State
from llama_guard.model.watcher import Watcher
from llama_guard.output.eventlog import Emitter
from llama_guard.status.snapshot import Liveness, RuntimeFiles, snapshot, status_line

STATUS_REFRESH_S = 2.0  # the status file is rewritten at least this often (the watchers' current readings)


class Announcer:
    """The status line and file of the daemon, and its readiness and stop towards systemd.

    ``state``, ``config`` and ``server`` (the serving :class:`ServerWatch`, None between servers)
    are read at each call; ``clock``: monotonic seconds."""

    def __init__(self, notifier: ServiceNotifier, runtime: RuntimeFiles, emitter: Emitter,
                 watchers: Sequence[Watcher], gpu: GpuPort | None, clock: Callable[[], float], *,
                 state: Callable[[], State], config: Callable[[], Config],
                 server: Callable[[], ServerWatch | None]) -> None:
        self.notifier = notifier
        self.runtime = runtime
        self._emitter = emitter
        self._watchers = watchers
        self._gpu = gpu
        self._clock = clock
        self._state = state
        self._config = config
        self._server = server
        self.stopping_sent = False
        self._written_at = float("-inf")

    def _liveness(self) -> Liveness | None:
        gen = self._server()
        if gen is None or gen.answering is None:
            return None
        return Liveness(gen.answering, gen.probe.silent_s())

    def _gpu_fragment(self) -> str:
        """The GPU port's part of the status line; empty without one or when it fails."""
        if self._gpu is None:
            return ""
        try:
            return self._gpu.status_fragment()
        except Exception:
            return ""

    def line(self) -> str:
        """The status line now (:func:`~llama_guard.status.snapshot.status_line`)."""
        gen = self._server()
        tps = gen.last_eval_tps if gen is not None else None
        return status_line(self._state(), self._clock(), tps, self._gpu_fragment(), self._liveness())

    def write(self) -> None:
        """Write ``status.json`` now (a failed write is an event of :class:`RuntimeFiles`)."""
        self._written_at = self._clock()
        self.runtime.write(snapshot(self._state(), self.line(), self._config().server.base_url,
                                    list(self._emitter.recent), self._watchers, self._liveness()))

    def after_step(self, phase_changed: bool) -> None:
        """After a decision: a new phase is written and sent (``STATUS=``) at once; otherwise the
        file is rewritten when older than :data:`STATUS_REFRESH_S`."""
        if phase_changed:
            self.write()
            self.notifier.status(self.line())
        elif self._clock() - self._written_at >= STATUS_REFRESH_S:
            self.write()

    def stopping(self) -> None:
        """``STOPPING=1`` once, when a stop of the daemon begins; no ``READY=1`` after it."""
        if not self.stopping_sent:
            self.stopping_sent = True
            self.notifier.stopping(self.line())

    def ready(self) -> None:
        """``READY=1`` (with the status line), unless a stop began."""
        if not self.stopping_sent:
            self.notifier.ready(self.line())
