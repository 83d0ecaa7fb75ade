"""Whether the server used the GPU lately, from NVML's per-process utilisation samples: a
progress signal of the hang judgement (a server busy on the GPU is not stuck).

Blocking (NVML and ``/proc`` calls): called from the progress sampler's worker thread. Answers
None when it cannot tell; a GPU that keeps no per-process samples (``NotSupported``) is not asked
again in this session.
"""

from __future__ import annotations

import psutil

from llama_guard.gpu import Nvml, NvmlError
from llama_guard.gpu.nvml_errors import NotSupported


class ProcessBusy:
    """Remembers the newest utilisation sample seen, so each call covers the time since the last."""

    def __init__(self) -> None:
        self._since_us = 0  # NVML timestamp (µs) of the newest per-process utilisation sample seen
        self._unsupported = False

    def busy(self, nvml: Nvml | None, pid: int) -> bool | None:
        """Whether server ``pid`` or a descendant (a wrapper's real llama-server) used the GPU since
        the previous call (:meth:`Nvml.process_busy`). None without ``nvml`` (the watch is off), on a
        GPU that keeps no such samples, or when NVML or ``/proc`` fails."""
        if nvml is None or self._unsupported:
            return None
        try:
            pids = frozenset({pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))})
            busy, self._since_us = nvml.process_busy(pids, self._since_us)
        except NotSupported:
            self._unsupported = True
            return None
        except (NvmlError, psutil.Error):
            return None
        return busy
