"""The VRAM need of a configuration before its server ever ran: the GGUF estimate, computed once per
(model file, settings) off the spawn path and kept on disk.

The estimate (:func:`llama_guard.preflight.vram_check.need_mib_in_child`) reads the model's GGUF
header in a child process: seconds for a large vocabulary. It must never delay a start: the GPU watcher
asks for it when the daemon starts and after a reload (in a thread), and the VRAM admission uses it only
once known. A start without it is admitted on what is known (free VRAM, other processes on the GPU).

Key: the model's path, size and ``st_mtime_ns`` (a replaced or rewritten file is a new key) and the
budget's :class:`~llama_guard.insight.budget.Settings` (context, KV cache types, layers offloaded ...).
File: ``<[runtime].dir>/vram-need.json``, ``{"version": 1, "needs": {key: MiB or null}}`` (null: the
model cannot be estimated; not asked again for that key), the newest :data:`MAX_ENTRIES` kept, written
atomically (a temporary file renamed over it). A missing, unreadable or malformed file is an empty cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from llama_guard.insight.budget import Settings

NEED_FILE = "vram-need.json"
MAX_ENTRIES = 32
VERSION = 1


def need_key(model: str, settings: Settings) -> str | None:
    """The cache key of ``model`` (a path) under ``settings``; None when the file cannot be stat'ed.
    Blocking (a stat): call it in a thread."""
    try:
        st = os.stat(model)
    except OSError:
        return None
    return json.dumps({"model": os.path.abspath(model), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "settings": dataclasses.asdict(settings)}, sort_keys=True)


class NeedCache:
    """Known needs (MiB) by key, backed by ``<directory>/vram-need.json``. Thread-safe: :meth:`learn`
    runs in a worker thread while the loop calls :meth:`known`."""

    def __init__(self, estimate: Callable[[str, Settings], int | None]) -> None:
        """``estimate(model, settings)``: the need in MiB (None: cannot be estimated); blocking."""
        self._estimate = estimate
        self._lock = threading.Lock()
        self._needs: dict[str, int | None] = {}
        self._path: Path | None = None

    def open(self, directory: Path) -> None:
        """Load ``directory``'s cache file (blocking). Never raises: a bad file is an empty cache."""
        path = directory / NEED_FILE
        needs: dict[str, int | None] = {}
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and data.get("version") == VERSION and isinstance(data.get("needs"), dict):
                needs = {k: v for k, v in data["needs"].items()
                         if isinstance(k, str) and (v is None or (isinstance(v, int) and v > 0))}
        with self._lock:
            self._path = path
            self._needs = {**needs, **self._needs}

    def known(self, key: str | None) -> tuple[bool, int | None]:
        """``(True, MiB or None)`` when ``key`` was estimated, else ``(False, None)``. Non-blocking."""
        with self._lock:
            if key is None or key not in self._needs:
                return False, None
            return True, self._needs[key]

    def learn(self, model: str, settings: Settings) -> int | None:
        """The need of ``model`` under ``settings``: from the cache, else estimated now and stored.
        Blocking (seconds on a first read): call it in a thread. Raises nothing the estimate does not."""
        key = need_key(model, settings)
        found, mib = self.known(key)
        if found or key is None:
            return mib
        mib = self._estimate(model, settings)
        with self._lock:
            self._needs.pop(key, None)
            self._needs[key] = mib  # newest last
            while len(self._needs) > MAX_ENTRIES:
                del self._needs[next(iter(self._needs))]
            snapshot, path = dict(self._needs), self._path
        if path is not None:
            self._save(path, snapshot)
        return mib

    @staticmethod
    def _save(path: Path, needs: dict[str, int | None]) -> None:
        """Write the file atomically; a failure (read-only or full runtime dir) keeps the cache in memory only."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"version": VERSION, "needs": needs}))
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
