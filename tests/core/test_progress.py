"""The progress sampler on real processes: CPU time of a process tree, lines, the GPU hook."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from llama_guard.core.progress import ProgressSampler, tree_cpu_seconds

SPIN = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: pass\n"


def _spinner(shell: int) -> psutil.Process:
    """The shell's spinning child, once it runs (its interpreter started)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = psutil.Process(shell).children()
        if children and children[0].cpu_times().user > 0:
            return children[0]
        time.sleep(0.02)
    raise AssertionError("the spinning child did not start within 60 s")


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def test_a_spinning_child_in_the_tree_counts_and_a_stopped_one_does_not() -> None:
    # A shell whose child spins: the CPU time is the tree's, not only the direct pid's.
    proc = subprocess.Popen(["/bin/sh", "-c", f"{sys.executable} -c '{SPIN}'; true"], start_new_session=True)
    try:
        spinner = _spinner(proc.pid)
        lines = [0]
        sampler = ProgressSampler(proc.pid, lambda: lines[0])
        # The marker: the kernel's own count for the child moved 0.3 CPU s (however long a busy host takes).
        start = _cpu(spinner)
        deadline = time.monotonic() + 60
        while _cpu(spinner) - start < 0.3 and time.monotonic() < deadline:
            time.sleep(0.02)
        moved = sampler.sample()
        assert moved.cpu_s is not None and moved.cpu_s >= 0.3, moved
        assert moved.signals(0.05) == ("cpu",)
        os.killpg(proc.pid, signal.SIGSTOP)
        while spinner.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        sampler.sample()
        time.sleep(1.0)  # a second without CPU: a count of wall time instead of CPU time would show it
        lines[0] += 3
        stopped = sampler.sample()
        assert stopped.cpu_s is not None and stopped.cpu_s < 0.05 and stopped.lines == 3
        assert stopped.signals(0.05) == ("lines",)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_slow_cpu_use_accumulates_when_asked() -> None:
    readings = iter([0.0, 0.02, 0.04, 0.06, 0.08])
    sampler = ProgressSampler(1, lambda: 0, cpu_seconds=lambda _pid: next(readings))
    assert sampler.sample(accumulate_below_s=0.05).signals(0.05) == ()
    assert sampler.sample(accumulate_below_s=0.05).signals(0.05) == ()
    assert sampler.sample(accumulate_below_s=0.05).signals(0.05) == ("cpu",)  # 0.06 since the start
    later = sampler.sample().cpu_s
    assert later is not None and abs(later - 0.02) < 1e-9  # the baseline moved to 0.06


def test_gone_pid_and_a_failing_gpu_hook_are_unknown() -> None:
    proc = subprocess.Popen(["/bin/true"])
    proc.wait()
    assert tree_cpu_seconds(proc.pid) is None

    def broken(_pid: int) -> bool | None:
        raise RuntimeError("NVML hung up")

    sampler = ProgressSampler(proc.pid, lambda: 0, gpu_busy=broken)
    moved = sampler.sample()
    assert moved.cpu_s is None and moved.gpu_busy is None and moved.signals(0.05) == ()
    assert ProgressSampler(proc.pid, lambda: 0, gpu_busy=lambda _p: True).sample().signals(0.05) == ("gpu",)
