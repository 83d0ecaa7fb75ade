"""The daemon's stderr never blocks its writer (output/stderr.py), on a real pipe: writes return
while nobody reads, what did not fit is dropped whole lines at a time and counted, and the count
is said once the pipe is read again; a pipe whose reader is gone costs nothing."""

from __future__ import annotations

import fcntl
import os
import re
import select
import threading
import time

from llama_guard.output.stderr import BoundedStderr

F_SETPIPE_SZ = 1031  # fcntl(2): the pipe's capacity (at least one page)
LINES = 2000


def write_lines(stream: BoundedStderr, count: int) -> threading.Thread:
    """Writes ``count`` numbered lines from a thread (a blocking write would leave it alive)."""
    def body() -> None:
        for i in range(count):
            stream.write(f"line {i:05d} " + "x" * 90 + "\n")
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def read_until(fd: int, pattern: str, timeout_s: float = 60.0) -> str:
    """Everything read from ``fd`` until a line matching ``pattern`` arrived (bounded)."""
    deadline, text = time.monotonic() + timeout_s, ""
    while not re.search(pattern, text, re.M):
        left = deadline - time.monotonic()
        assert left > 0, f"no {pattern!r} within {timeout_s} s; read {len(text)} characters"
        if select.select([fd], [], [], left)[0]:
            text += os.read(fd, 65536).decode()
    return text


def test_writes_never_wait_for_a_reader_and_drops_are_counted_then_said() -> None:
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, F_SETPIPE_SZ, 4096)
    stream = BoundedStderr(write_fd, max_bytes=16384)
    try:
        writer = write_lines(stream, LINES)
        writer.join(60)
        assert not writer.is_alive(), "a write blocked on a pipe nobody reads"
        assert stream.dropped_lines > 0
        text = read_until(read_fd, r"^llama-guard: \d+ lines of output dropped")
        stream.write("after\n")
        text += read_until(read_fd, r"^after$")
        lines = text.splitlines()
        note = [line for line in lines if line.startswith("llama-guard:")]
        assert note == [f"llama-guard: {stream.dropped_lines} lines of output dropped (stderr was not read)"]
        kept = [line for line in lines if line.startswith("line ")]
        assert all(re.fullmatch(r"line \d{5} x{90}", line) for line in kept), "a line was cut"
        assert len(kept) + stream.dropped_lines == LINES
        assert [int(line[5:10]) for line in kept] == sorted(int(line[5:10]) for line in kept)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_pipe_without_reader_costs_nothing() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    stream = BoundedStderr(write_fd)
    try:
        writer = write_lines(stream, LINES)
        writer.join(60)
        assert not writer.is_alive()
        assert stream.drain(30)
    finally:
        os.close(write_fd)
