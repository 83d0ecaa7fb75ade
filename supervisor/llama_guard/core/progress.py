"""Progress signals of a llama-server that do not depend on its HTTP loop.

A server whose HTTP loop is busy (one big prompt batch holding it) answers nothing for a while
yet works; a SIGSTOPped or wedged server answers nothing and does nothing. What tells them apart
is progress: the CPU time of the server's process tree (psutil, user + system seconds), the
lines it prints, and, when a GPU watcher offers it, its GPU use. :class:`ProgressSampler` reads
these as deltas since its previous sample; it never raises for a process that is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil

# A hook a GPU watcher may offer: does ``pid`` use the GPU now (None: cannot tell)?
GpuBusyHook = Callable[[int], "bool | None"]


def tree_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` and its live descendants (psutil ``cpu_times``);
    None when ``pid`` is gone or cannot be read. Threads are included (they share the process's
    times); children that already exited are not."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


@dataclass(frozen=True)
class ProgressSample:
    """What moved since the previous sample: ``cpu_s`` CPU seconds of the process tree (None:
    unknown, e.g. the first sample or a vanished pid), ``lines`` output lines, ``gpu_busy`` the
    GPU hook's answer (None: no hook, or it cannot tell)."""

    cpu_s: float | None
    lines: int
    gpu_busy: bool | None

    def signals(self, min_cpu_s: float) -> tuple[str, ...]:
        """The names of the signals that moved ("cpu" counts from ``min_cpu_s`` seconds)."""
        out = []
        if self.cpu_s is not None and self.cpu_s >= min_cpu_s:
            out.append("cpu")
        if self.lines > 0:
            out.append("lines")
        if self.gpu_busy:
            out.append("gpu")
        return tuple(out)


class ProgressSampler:
    """Samples one server's progress signals as deltas between calls of :meth:`sample`.

    ``line_count`` returns the number of lines the server has printed so far (the daemon's
    reader counts them); ``gpu_busy`` is the optional GPU hook.
    """

    def __init__(self, pid: int, line_count: Callable[[], int], *,
                 gpu_busy: GpuBusyHook | None = None,
                 cpu_seconds: Callable[[int], float | None] = tree_cpu_seconds) -> None:
        self.pid = pid
        self._line_count = line_count
        self._gpu_busy = gpu_busy
        self._cpu_seconds = cpu_seconds
        self._cpu: float | None = cpu_seconds(pid)
        self._lines = line_count()

    def sample(self, *, accumulate_below_s: float = 0.0) -> ProgressSample:
        """The deltas since the previous call (or since construction). A CPU delta below
        ``accumulate_below_s`` seconds keeps the CPU baseline, so that slow but steady CPU use adds
        up across samples instead of vanishing in each one."""
        cpu = self._cpu_seconds(self.pid)
        delta = None if cpu is None or self._cpu is None else max(0.0, cpu - self._cpu)
        if cpu is not None and (delta is None or delta >= accumulate_below_s):
            self._cpu = cpu
        lines = self._line_count()
        new_lines, self._lines = lines - self._lines, lines
        gpu: bool | None = None
        if self._gpu_busy is not None:
            try:
                gpu = self._gpu_busy(self.pid)
            except Exception:  # an optional hook must never break liveness
                gpu = None
        return ProgressSample(cpu_s=delta, lines=new_lines, gpu_busy=gpu)
