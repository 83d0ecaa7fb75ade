"""llama-guard's stderr as a stream that never blocks its writer.

A ``write(2)`` to a pipe whose reader stopped reading (journald stalled, a terminal paused with
Ctrl-S, a ``| less`` nobody scrolls) blocks once the pipe's buffer is full (pipe(7): 64 KiB by
default). Written from the event loop, that would freeze everything: the front door, /livez,
supervision, even SIGTERM, whose handler runs on the same loop. :class:`BoundedStderr` replaces
``sys.stderr`` in the daemon: a write only appends to an in-memory buffer of at most
:data:`MAX_BUFFERED_BYTES`; one writer thread copies the buffer to the file descriptor and is the
only one that ever waits on it. What does not fit is dropped whole lines at a time and counted;
once the descriptor takes output again the writer says how many lines were lost, in one line.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import sys
import threading
import time

MAX_BUFFERED_BYTES = 1 << 20  # output held while stderr is not read (bytes); more is dropped
EXIT_DRAIN_S = 2.0  # at exit: how long what is buffered may take to be written (seconds)


class BoundedStderr(io.TextIOBase):
    """A text stream over file descriptor ``fd`` whose :meth:`write` never blocks.

    Text is encoded as UTF-8 (undecodable characters escaped) and buffered, up to ``max_bytes``
    bytes (a line that was begun may finish past it, up to twice that); what does not fit is
    dropped, line by line, and counted in :attr:`dropped_lines`. A daemon thread writes the buffer
    to ``fd``; after a drop, the first write that goes through is followed by the line
    ``llama-guard: N lines of output dropped (stderr was not read)``. When ``fd`` is closed at the
    other end (EPIPE) or unusable, output is discarded silently: nobody is left to tell.
    """

    encoding = "utf-8"  # what write encodes to (undecodable characters backslash-escaped)

    def __init__(self, fd: int = 2, max_bytes: int = MAX_BUFFERED_BYTES) -> None:
        super().__init__()
        self._fd = fd
        self._max = max_bytes
        self._cond = threading.Condition()
        self._chunks: list[bytes] = []
        self._size = 0          # bytes in _chunks
        self._writing = 0       # bytes taken by the writer thread and not yet written
        self._line_open = False  # the last accepted text did not end its line
        self._dropping = False   # the last dropped text did not end its line: drop up to its end
        self.dropped_lines = 0
        """Lines lost because the buffer was full."""
        self._said = 0          # dropped_lines already reported
        self._broken = False
        self._thread = threading.Thread(target=self._run, name="stderr-writer", daemon=True)
        self._thread.start()

    # --- the stream ------------------------------------------------------------------------

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self._fd)
        except OSError:
            return False

    def write(self, text: str) -> int:
        """Buffer ``text`` (or drop it, counted); returns ``len(text)``. Never blocks, never raises."""
        if not text:
            return 0
        data = text.encode("utf-8", "backslashreplace")
        ends_line = text.endswith("\n")
        with self._cond:
            room = self._size + self._writing < self._max or (
                self._line_open and self._size + self._writing < 2 * self._max)
            if self._broken or self._dropping or not room:
                if not self._broken:
                    self.dropped_lines += text.count("\n") + (0 if ends_line or self._dropping else 1)
                self._dropping = not ends_line
                return len(text)
            self._chunks.append(data)
            self._size += len(data)
            self._line_open = not ends_line
            self._cond.notify()
        return len(text)

    def flush(self) -> None:
        """Nothing to do: the writer thread writes as soon as it can (a flush never waits)."""

    def drain(self, timeout_s: float = EXIT_DRAIN_S) -> bool:
        """Wait up to ``timeout_s`` seconds until everything buffered is written; whether it was.
        For the daemon's exit, after the loop has stopped."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._size or self._writing) and not self._broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # --- the writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._chunks:
                    self._cond.wait()
                data = b"".join(self._chunks)
                self._chunks, self._size, self._writing = [], 0, len(data)
            ok = self._write_all(data)
            with self._cond:
                self._writing = 0
                lost = self.dropped_lines - self._said
                self._said = self.dropped_lines
                self._cond.notify_all()
            if ok and lost:
                self._write_all(f"llama-guard: {lost} lines of output dropped (stderr was not read)\n".encode())

    def _write_all(self, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self._fd, view)
            except InterruptedError:
                continue
            except BlockingIOError:  # a descriptor someone made non-blocking: wait for room
                with contextlib.suppress(OSError):
                    select.select([], [self._fd], [], 1.0)
                continue
            except OSError:  # the reader is gone (EPIPE) or the descriptor is: nobody to tell
                with self._cond:
                    self._broken = True
                    self._chunks, self._size = [], 0
                return False
            view = view[written:]
        return True


def install() -> BoundedStderr:
    """Make ``sys.stderr`` a :class:`BoundedStderr` over file descriptor 2 (what the daemon, its
    event log and its journal fallback write to); returns it, for :meth:`BoundedStderr.drain` at exit."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    stream = BoundedStderr(2)
    sys.stderr = stream
    return stream
