"""The one check that a path can be llama-server's model: a regular, readable GGUF file. Used by
``llama-guard check`` (:mod:`llama_guard.preflight`), before each spawn (:mod:`.spawner`) and by every
reload (:mod:`.reload`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from llama_guard.host.paths import os_reason

#: The first four bytes of every GGUF file (the format's magic, ggml's gguf.h ``GGUF_MAGIC``).
MODEL_CHECK_TIMEOUT_S = 10.0  # checking the model file (stat, open); also loading a reloaded config (s)
GGUF_MAGIC = b"GGUF"


def model_problem(path: Path) -> str:
    """Why ``path`` cannot be llama-server's model ("" when it can): it must be a regular file
    (``os.stat`` + ``S_ISREG`` before any ``open``, so a FIFO, a directory or a device is refused at
    once instead of blocking), readable, and start with the 4-byte GGUF magic ``b"GGUF"``.

    The one GGUF check, used by ``llama-guard check`` and by every reload. It still touches the
    filesystem (a hung network mount can block ``stat``): callers run it with a deadline.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: {os_reason(exc)}"
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        return f"{path} is {kind}, not a regular file"
    try:
        # O_NONBLOCK: should the file be swapped for a FIFO after the stat, open() does not wait.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"{path}: {os_reason(exc)}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"{path} is not a regular file"
        magic = os.read(fd, 4)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    finally:
        os.close(fd)
    if magic != GGUF_MAGIC:
        return f"{path}: not a GGUF file (magic {magic!r})"
    return ""
