"""Decode speeds recorded at upgrade trials on this box, for a build found replaced at a start: that
start has no old server to measure, so the new build is compared with the last good build's figure as
its last trial measured it — with the same flags and the same trial size, or not at all.

One JSON file, ``<builds dir>/trials.json`` (beside the kept copies, :func:`~.kept.builds_dir`):
``{"<sha256>:<key>": {"tokens_per_s": float, "at": unix seconds}}``, where ``key`` is
:func:`flags_key` of the configuration the figure was measured with. Written atomically (a temporary
file renamed over it); an unreadable or malformed file reads as no figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from llama_guard.config import Config
from llama_guard.config.argv import build_argv

FIGURES_FILE = "trials.json"
MAX_FIGURES = 16  # the newest figures kept (a few builds x a few flag sets)


def flags_key(config: Config) -> str:
    """What a figure depends on besides the build: llama-server's argv without its executable, and the
    trial's size (``[upgrade].trial_runs``, ``trial_tokens``); 16 hex digits of its SHA-256."""
    argv = build_argv(config.server, Path("llama-server"))[1:]
    what = json.dumps([argv, config.upgrade.trial_runs, config.upgrade.trial_tokens])
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def _read(root: Path) -> dict[str, dict[str, float]]:
    try:
        data = json.loads((root / FIGURES_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("tokens_per_s"), (int, float))}


def recorded(root: Path, sha256: str, key: str) -> float | None:
    """The decode tokens/s of build ``sha256`` with flags ``key`` at its last trial here; None when
    none was recorded. Blocking (a file read)."""
    entry = _read(root).get(f"{sha256}:{key}")
    return None if entry is None else float(entry["tokens_per_s"])


def record(root: Path, figures: dict[str, float], key: str) -> None:
    """Record ``figures`` (sha256 → decode tokens/s) measured with flags ``key``; the newest
    :data:`MAX_FIGURES` are kept. Blocking; raises ``OSError`` when the file cannot be written."""
    data = _read(root)
    now = time.time()
    for sha256, tps in figures.items():
        data[f"{sha256}:{key}"] = {"tokens_per_s": tps, "at": now}
    newest = dict(sorted(data.items(), key=lambda kv: kv[1].get("at", 0.0), reverse=True)[:MAX_FIGURES])
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{FIGURES_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(newest))
    tmp.replace(root / FIGURES_FILE)
