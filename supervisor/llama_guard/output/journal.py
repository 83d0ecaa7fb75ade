"""Health events into the systemd journal, through the native journal protocol.

:class:`JournalSink` is an :class:`~llama_guard.output.eventlog.EventSink`: it turns each event dict
into journal fields (``MESSAGE``, ``PRIORITY``, ``SYSLOG_IDENTIFIER=llama-guard``,
``LLAMA_GUARD_EVENT``, ``MESSAGE_ID`` and the event's data as upper-case fields) and sends them
with ``logging_journald.JournaldTransport`` to journald's datagram socket. The server's own
lines (event ``server_line``) go at priority 7 with ``LLAMA_SERVER_LINE=1``.

Sending never blocks the caller and never raises: :meth:`JournalSink.write` only encodes and
enqueues (a bounded queue); one writer thread does the sends, each bounded by a timeout. When
the socket is gone or a send fails, that event is written to stderr instead (one line, with a
``<N>`` syslog-priority prefix when stderr is itself a journal stream) and the next event tries
the socket again, so a restarted journald is picked up without a restart of llama-guard.

:func:`journald_enabled` decides whether journald output is on.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import re
import shlex
import sys
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from logging_journald import JournaldTransport

DEFAULT_SOCKET_PATH = Path("/run/systemd/journal/socket")
"""Where the system journald listens for native-protocol datagrams."""

SYSLOG_IDENTIFIER = "llama-guard"
SERVER_LINE_EVENT = "server_line"
SERVER_LINE_FIELD = "LLAMA_SERVER_LINE"
SERVER_LINE_PRIORITY = 7

# Keys of the event dict that become standard fields, not data fields.
_RESERVED = frozenset({"event", "message", "priority", "message_id", "level", "timestamp"})
_FIELD_BAD_CHARS = re.compile(r"[^A-Z0-9_]")
_MAX_FIELD_NAME = 64

FieldValue = str | bytes
Fields = list[tuple[str, FieldValue]]


def stderr_is_journal(environ: Mapping[str, str] | None = None, stderr_fd: int = 2) -> bool:
    """Whether ``stderr_fd`` is the journal stream systemd connected (``$JOURNAL_STREAM``).

    ``$JOURNAL_STREAM`` is ``"<st_dev>:<st_ino>"`` of the stream; it only counts when it matches
    the descriptor itself (a child that inherited the variable but not the descriptor does not
    match). Never raises: a malformed variable or a closed descriptor answer ``False``.
    """
    env = os.environ if environ is None else environ
    value = env.get("JOURNAL_STREAM", "")
    if not value:
        return False
    try:
        dev_text, ino_text = value.split(":", 1)
        st = os.fstat(stderr_fd)
        return (st.st_dev, st.st_ino) == (int(dev_text), int(ino_text))
    except (ValueError, OSError):
        return False


def journald_enabled(
    log_format: str, *, environ: Mapping[str, str] | None = None, stderr_fd: int = 2
) -> bool:
    """Whether events should go to journald, from ``[log].format`` and the environment.

    On when ``log_format == "journald"``, or when it is ``"auto"`` and stderr is connected to the
    journal (:func:`stderr_is_journal`, i.e. the daemon runs under systemd). An explicit
    ``"console"`` or ``"json"`` keeps plain stderr even under systemd.
    """
    if log_format == "journald":
        return True
    if log_format == "auto":
        return stderr_is_journal(environ, stderr_fd)
    return False


def field_name(key: str) -> str | None:
    """The journal field name for event key ``key`` (upper case, ``[A-Z0-9_]``, at most 64 chars).

    Returns ``None`` for a key that cannot become a valid client field (empty after cleaning).
    Leading underscores and digits are stripped: fields starting with ``_`` are journald's
    trusted fields and would be dropped.
    """
    name = _FIELD_BAD_CHARS.sub("_", key.upper()).lstrip("_0123456789")
    return name[:_MAX_FIELD_NAME] or None


def field_value(value: Any) -> FieldValue | None:
    """Encode one event value as journal text; ``None`` means "leave the field out".

    Numbers and strings as written (``str()``), booleans as ``true``/``false``, lists and tuples
    of scalars as a shell-quoted line (an argv reads back as a command line), mappings and
    anything else as JSON (``str()`` for what JSON cannot hold). Bytes pass through.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | bytes):
        return value
    if isinstance(value, int | float | Path):
        return str(value)
    if isinstance(value, list | tuple) and all(isinstance(v, str | int | float | Path) for v in value):
        return shlex.join(str(v) for v in value)
    try:
        return json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def journal_fields(record: Mapping[str, Any], identifier: str = SYSLOG_IDENTIFIER) -> Fields:
    """The journal fields of one event dict (as :class:`~llama_guard.output.eventlog.Emitter` passes it).

    ``MESSAGE``, ``PRIORITY``, ``SYSLOG_IDENTIFIER``, ``LLAMA_GUARD_EVENT``, ``MESSAGE_ID``, then
    each data key upper-cased. A ``server_line`` event gets ``PRIORITY=7`` and
    ``LLAMA_SERVER_LINE=1`` (its ``line`` is the ``MESSAGE`` and is not repeated). Pure; never
    raises for any value types in ``record``.
    """
    name = str(record.get("event", "unknown"))
    is_line = name == SERVER_LINE_EVENT
    priority = SERVER_LINE_PRIORITY if is_line else record.get("priority", 6)
    message = record.get("message")
    if message is None:
        message = name
    fields: Fields = [
        ("MESSAGE", message if isinstance(message, str | bytes) else str(message)),
        ("PRIORITY", str(priority)),
        ("SYSLOG_IDENTIFIER", identifier),
        ("LLAMA_GUARD_EVENT", name),
    ]
    if record.get("message_id"):
        fields.append(("MESSAGE_ID", str(record["message_id"])))
    if is_line:
        fields.append((SERVER_LINE_FIELD, "1"))
    taken = {k for k, _ in fields}
    for key, value in record.items():
        if key in _RESERVED or (is_line and key == "line"):
            continue
        fname = field_name(str(key))
        encoded = field_value(value)
        if fname is None or encoded is None or fname in taken:
            continue
        taken.add(fname)
        fields.append((fname, encoded))
    return fields


def fallback_line(fields: Fields, *, level_prefix: bool) -> str:
    """One stderr line for an event that could not reach the journal socket.

    ``<PRIORITY>`` first when ``level_prefix`` (journald's stream reader takes it as the
    priority), then ``EVENT: MESSAGE`` and the data fields as ``KEY=value``; newlines are
    escaped so that one event stays one line.
    """
    values = dict(fields)

    def text(v: FieldValue) -> str:
        s = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        return s.replace("\\", "\\\\").replace("\n", "\\n")

    skip = {"MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "LLAMA_GUARD_EVENT", "MESSAGE_ID"}
    extra = " ".join(f"{k}={shlex.quote(text(v))}" for k, v in fields if k not in skip)
    prefix = f"<{text(values.get('PRIORITY', '6'))}>" if level_prefix else ""
    line = f"{prefix}{text(values.get('LLAMA_GUARD_EVENT', '?'))}: {text(values.get('MESSAGE', ''))}"
    return f"{line} {extra}\n" if extra else line + "\n"


_STOP = object()


class JournalSink:
    """An event sink writing to journald's native socket, with a stderr fallback.

    ``socket_path``: journald's datagram socket (default ``/run/systemd/journal/socket``; a test
    points it at a private journald's ``$RUNTIME_DIRECTORY/socket``). ``fallback``: the stream
    for events that cannot be sent (default: ``sys.stderr`` as it is at the time of writing).
    ``level_prefix``: write ``<N>`` priority prefixes on fallback lines (default: when stderr is
    a journal stream). ``queue_size``: events buffered for the writer thread (more are counted
    in :attr:`dropped`). ``send_timeout_s``: the longest one send may wait (seconds) for room
    in journald's queue before the event goes to the fallback.

    :meth:`write` never raises and never blocks; call :meth:`close` at exit (it is also
    registered with :mod:`atexit`) so queued events are not lost.
    """

    def __init__(
        self,
        socket_path: str | Path = DEFAULT_SOCKET_PATH,
        *,
        identifier: str = SYSLOG_IDENTIFIER,
        fallback: TextIO | None = None,
        level_prefix: bool | None = None,
        queue_size: int = 10000,
        send_timeout_s: float = 1.0,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.identifier = identifier
        self._fallback = fallback
        self._level_prefix = stderr_is_journal() if level_prefix is None else level_prefix
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, queue_size))
        self._transport = JournaldTransport(socket_path=self.socket_path, connected=False)
        self._transport.socket.settimeout(send_timeout_s)
        self._closed = False
        self.sent = 0
        """Events the journal socket accepted."""
        self.fallback_count = 0
        """Events written to the fallback stream instead."""
        self.dropped = 0
        """Events lost because the queue was full (or the sink closed)."""
        self._dropped_reported = 0
        self.fallback_active = False
        """Whether the last send failed (the journal socket is unreachable)."""
        self.last_error: str = ""
        """The last send error, as text."""
        self.fallback_max_priority = 7
        """Only events of this syslog priority or more urgent (a lower number) go to the fallback
        stream: set it from ``[log].level`` (:meth:`set_fallback_level`) so that stderr does not
        fill with the server's debug lines while the journal is away."""
        self._thread = threading.Thread(target=self._run, name="journal-sink", daemon=True)
        self._thread.start()
        ref = weakref.ref(self)
        atexit.register(_close_at_exit, ref)

    def write(self, record: dict[str, Any]) -> None:
        """Queue event ``record`` for the journal. Never raises, never blocks."""
        try:
            fields = journal_fields(record, self.identifier)
        except Exception:  # a sink must never take the daemon down
            return
        if self._closed:
            self.dropped += 1
            return
        try:
            self._queue.put_nowait(fields)
        except queue.Full:
            self.dropped += 1

    def set_fallback_level(self, level: str) -> None:
        """``[log].level`` ("debug" … "critical"): the least urgent events written to the fallback."""
        self.fallback_max_priority = {"debug": 7, "info": 6, "notice": 5, "warning": 4, "error": 3,
                                      "critical": 2}.get(level, 7)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait up to ``timeout_s`` seconds until every queued event is sent or written to the
        fallback. Returns whether the queue drained in time."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (waiting at most ``timeout_s`` seconds), stop the writer thread and
        close the socket. Later :meth:`write` calls count as dropped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=timeout_s)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._transport.socket.close()

    # --- writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            assert isinstance(item, list)
            self._report_drops()
            self._send_one(item)

    def _send_one(self, fields: Fields) -> None:
        try:
            self._transport.send(fields)
        except Exception as exc:  # OSError, timeout, or anything odd: fall back
            if not self.fallback_active:
                self._write_fallback(
                    f"llama-guard: journal socket {self.socket_path} unusable ({exc}); "
                    "writing events to stderr\n")
            self.fallback_active = True
            self.last_error = str(exc)
            self.fallback_count += 1
            try:
                priority = int(dict(fields).get("PRIORITY", "6"))
            except (TypeError, ValueError):
                priority = 6
            if priority <= self.fallback_max_priority:
                self._write_fallback(fallback_line(fields, level_prefix=self._level_prefix))
            return
        if self.fallback_active:
            self.fallback_active = False
            self._write_fallback(f"llama-guard: journal socket {self.socket_path} is back\n")
        self.sent += 1

    def _report_drops(self) -> None:
        dropped = self.dropped
        if dropped > self._dropped_reported:
            self._write_fallback(
                f"llama-guard: {dropped - self._dropped_reported} events dropped "
                "(journal queue full)\n")
            self._dropped_reported = dropped

    def _write_fallback(self, text: str) -> None:
        stream = self._fallback if self._fallback is not None else sys.stderr
        try:
            stream.write(text)
            stream.flush()
        except Exception:  # stderr itself gone: nothing left to tell
            pass


def _close_at_exit(ref: weakref.ref[JournalSink]) -> None:
    sink = ref()
    if sink is not None:
        sink.close(timeout_s=1.0)
