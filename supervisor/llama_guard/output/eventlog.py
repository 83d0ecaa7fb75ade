"""Emitting health events through structlog.

structlog is the front end: :meth:`Emitter.emit` logs the event under its catalogue name with
its fields, its severity and its rendered message. Output goes to stderr, readable on a
terminal and one JSON object per line otherwise. Extra sinks (journald) hook in as
:class:`EventSink` objects and see every event dict before it is rendered; a sink that raises
is dropped from that event silently (an event must never crash the daemon).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from datetime import datetime
from typing import Any, Protocol, TextIO

import structlog

from llama_guard.vocab.events import CATALOG, EventName, Severity, render_message

_LEVEL_NAMES = {
    Severity.CRITICAL: "critical",
    Severity.ERROR: "error",
    Severity.WARNING: "warning",
    Severity.NOTICE: "info",
    Severity.INFO: "info",
    Severity.DEBUG: "debug",
}
_LEVEL_NUMBERS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
                  "error": logging.ERROR, "critical": logging.CRITICAL}


class EventSink(Protocol):
    """Receives every emitted event as a flat dict.

    Keys: ``event`` (the catalogue name), ``message`` (human text), ``priority`` (int, syslog),
    ``message_id`` (32 hex digits) and the event's own fields (lower-case names).
    """

    def write(self, record: dict[str, Any]) -> None: ...


class Emitter:
    """The one place events leave the daemon.

    ``min_level`` filters what reaches stderr (``"debug"`` … ``"critical"``); sinks get every
    event at or above ``sink_level``. ``recent`` keeps the last 50 non-debug events for
    ``llama-guard status``.
    """

    def __init__(
        self,
        *,
        min_level: str = "info",
        fmt: str = "auto",
        stream: TextIO | None = None,
        sinks: list[EventSink] | None = None,
        sink_level: str = "debug",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sinks: list[EventSink] = list(sinks or [])
        self.recent: deque[dict[str, Any]] = deque(maxlen=50)
        self._clock = clock
        self._min = _LEVEL_NUMBERS[min_level]
        self._sink_min = _LEVEL_NUMBERS[sink_level]
        self._stream = stream if stream is not None else sys.stderr
        self.stderr_enabled = True
        renderer: Any
        if fmt == "console" or (fmt == "auto" and self._stream.isatty()):
            renderer = structlog.dev.ConsoleRenderer(colors=self._stream.isatty())
        else:
            renderer = structlog.processors.JSONRenderer(sort_keys=False)
        self._logger = structlog.wrap_logger(
            structlog.PrintLogger(self._stream),
            processors=[
                self._to_sinks,
                self._drop_below_min,
                self._timestamp,
                renderer,
            ],
            context_class=dict,
        )

    def _to_sinks(self, _logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
        level = _LEVEL_NUMBERS[event_dict["level"]]
        if level >= self._sink_min:
            for sink in list(self.sinks):
                with contextlib.suppress(Exception):  # a sink must never take the daemon down
                    sink.write(dict(event_dict))
        return event_dict

    def _drop_below_min(self, _logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
        """Drop what is below the stderr threshold; beside ``level`` (Python's, which has no notice) put
        ``severity``, the syslog name of the event's priority (``notice`` for server_restart); the
        journal sinks saw the dict before, with its numeric ``priority``."""
        if not self.stderr_enabled or _LEVEL_NUMBERS[event_dict["level"]] < self._min:
            raise structlog.DropEvent
        severity = Severity(event_dict.pop("priority")).name.lower()
        event_dict.pop("message_id", None)
        out: dict[str, Any] = {}
        for key, value in event_dict.items():
            out[key] = value
            if key == "level":
                out["severity"] = severity
        return out

    def _timestamp(self, _logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
        """``timestamp``: ISO 8601 with the host's UTC offset (``2026-12-01T21:30:00.123456+00:00``)."""
        event_dict["timestamp"] = datetime.fromtimestamp(self._clock()).astimezone().isoformat()
        return event_dict

    def set_level(self, level: str) -> None:
        """Change the stderr threshold (``"debug"`` … ``"critical"``), e.g. on a reload."""
        self._min = _LEVEL_NUMBERS[level]
        for sink in self.sinks:  # a journal sink's stderr fallback follows the level too
            setter = getattr(sink, "set_fallback_level", None)
            if setter is not None:
                setter(level)

    def emit(self, name: EventName, /, **fields: Any) -> None:
        """Emit catalogue event ``name`` with ``fields``; raises KeyError for an unknown name."""
        spec = CATALOG[name]
        message = render_message(name, fields)
        level = _LEVEL_NAMES[spec.severity]
        if spec.severity != Severity.DEBUG:
            self.recent.append({"time": self._clock(), "event": name, "message": message})
        self._logger.msg(
            name,
            level=level,
            message=message,
            priority=int(spec.severity),
            message_id=spec.message_id,
            **fields,
        )
