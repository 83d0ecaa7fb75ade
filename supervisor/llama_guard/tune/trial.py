"""One trial of the tuner: a llama-server started with one flag set on a free loopback port (the daemon's
child set-up, through :func:`llama_guard.tune.bench.spawned_server`), its real VRAM read through NVML
where there is a GPU, a number of completions measured as ``bench`` measures them (the server's own
``timings``), and the worst prefill the flag set admits (a prompt that fills one slot's context).

Blocking; every request has a deadline. A server that exits, is not ready, or fails a request makes
the trial fail with the cause (:class:`TrialFailed`), never the search."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from llama_guard.config import Config
from llama_guard.config.api_key import read_api_key
from llama_guard.core.client import BlockingClient, RequestFailed
from llama_guard.insight.budget import CELL_PAD
from llama_guard.tune.bench import DEFAULT_PROMPT, BenchError, RunTimings, completion, free_port, spawned_server
from llama_guard.tune.space import Knobs
from llama_guard.vocab.units import MIB

# Tokens left free in a slot by the worst-prefill prompt: room for the one token it generates.
PREFILL_HEADROOM = 8
# The token the worst-prefill prompt repeats: any id below the vocabulary's size computes the same way.
PREFILL_TOKEN = 100


class TrialFailed(RuntimeError):
    """The trial server exited, was not ready in time, or a request failed (the message says which)."""


@dataclass(frozen=True)
class TrialRun:
    """What one started server gave: completions (``timings``), its VRAM by NVML (MiB; None without a GPU)."""

    runs: tuple[RunTimings, ...]
    vram_mib: float | None


def trial_config(config: Config, knobs: Knobs, port: int) -> Config:
    """``config`` with ``knobs`` as its ``[server]`` flags, served on 127.0.0.1:``port``."""
    server = config.server.model_copy(update={**knobs.as_server_update(), "host": "127.0.0.1", "port": port})
    return config.model_copy(update={"server": server})


def slot_context(knobs: Knobs, n_ctx_train: int) -> int:
    """Tokens one slot holds: ``ctx_size / parallel`` (0 = the model's training context), as llama-server
    pads it (a multiple of 256)."""
    ctx = knobs.ctx_size or n_ctx_train or 4096
    per = max(1, ctx // knobs.parallel)
    return -(-per // CELL_PAD) * CELL_PAD


@contextlib.contextmanager
def started(config: Config, knobs: Knobs, log_dir: Path) -> Iterator[tuple[str, int]]:
    """Start a server with ``knobs``; yield ``(base_url, pid)``; stop it on the way out (also on
    KeyboardInterrupt and SIGTERM turned into one). Raises :class:`TrialFailed`."""
    cfg = trial_config(config, knobs, free_port())
    fd, log_name = tempfile.mkstemp(prefix="trial-", suffix=".log", dir=log_dir)
    with open(fd, "wb"):
        pass
    try:
        with spawned_server(cfg, Path(log_name)) as proc:
            yield cfg.server.base_url, proc.pid
    except BenchError as exc:
        raise TrialFailed(f"{exc}; the last lines of its log: {_tail(Path(log_name))}") from None


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:]) or "(empty log)"


def measure(url: str, config: Config, *, runs: int, tokens: int, timeout_s: float) -> tuple[RunTimings, ...]:
    """One warm-up completion (not kept), then ``runs`` completions of ``tokens`` tokens, each within
    ``timeout_s``. Raises :class:`TrialFailed`."""
    try:
        with BlockingClient(url, read_api_key(config.server)) as client:
            completion(client, tokens, DEFAULT_PROMPT, timeout_s)
            return tuple(completion(client, tokens, DEFAULT_PROMPT, timeout_s) for _ in range(runs))
    except BenchError as exc:
        raise TrialFailed(str(exc)) from None


def worst_prefill(url: str, config: Config, knobs: Knobs, n_ctx_train: int, timeout_s: float) -> int:
    """Send one prompt that fills a slot's context (``/completion`` with token ids, one token to
    generate, no prompt cache): the prefill in ``batch_size`` steps that runs a GPU out of memory when a
    flag set leaves too little room. Returns the prompt's tokens. Raises :class:`TrialFailed`."""
    n = slot_context(knobs, n_ctx_train) - PREFILL_HEADROOM
    body: dict[str, Any] = {"prompt": [PREFILL_TOKEN] * n, "n_predict": 1, "cache_prompt": False, "temperature": 0}
    try:
        with BlockingClient(url, read_api_key(config.server)) as client:
            resp = client.post("/completion", json=body, timeout_s=timeout_s)
    except RequestFailed as exc:
        raise TrialFailed(f"the full-context prefill ({n} tokens) failed: {exc}") from None
    if resp.status != 200:
        raise TrialFailed(f"the full-context prefill ({n} tokens) failed: HTTP {resp.status}: "
                          f"{' '.join(resp.text.split())[:200]}")
    return n


def vram_mib(config: Config, pid: int, nvml_module: Any = None) -> float | None:
    """VRAM (MiB) NVML reports for server ``pid`` and its descendants; None without a GPU or a reading."""
    from llama_guard.config.gpu import GpuWatchMode
    from llama_guard.gpu import DeviceSelector, NvmlError, open_gpu
    from llama_guard.gpu.nvml import WatchOff

    gpu = config.gpu
    if gpu.enabled is GpuWatchMode.OFF:
        return None
    opened = open_gpu(DeviceSelector(gpu.index, gpu.uuid, gpu.pci_bus_id), enabled=gpu.enabled, module=nvml_module)
    if isinstance(opened, WatchOff):
        return None
    try:
        pids = {pid}
        with contextlib.suppress(psutil.Error):
            pids |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
        procs = opened.processes()
        used = [p.used_bytes for p in procs if p.pid in pids and p.used_bytes is not None]
        return sum(used) / MIB if used else None
    except NvmlError:
        return None
    finally:
        opened.close()
