"""The GPU reset executor: it gathers the facts a reset depends on and runs the reset command.

It decides nothing: :meth:`ResetExecutor.inspect` reports who holds the GPU and whether the
command can run under our credentials (:class:`~llama_guard.model.inputs.ResetFacts`), and
:meth:`ResetExecutor.run` reports what the command did and whether the GPU verified afterwards
(:class:`~llama_guard.model.inputs.ResetDone`). The policy (:mod:`llama_guard.model.policy`) decides
to skip, run, refuse or escalate, and keeps the reset budget.

Source of the mechanics: NVIDIA's nvidia-smi documentation (docs/gpu.md) —
``nvidia-smi --gpu-reset -i <index>`` needs root and no process on the GPU; our own NVML session
and persistence mode can count as users, so the session is released (:meth:`Nvml.suspend`) while
the command runs and, on "In use", persistence mode is turned off for one more try and always
restored ([recovery].reset_toggles_persistence).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable

import psutil

from llama_guard.config import Config
from llama_guard.core.offload import Lane, LaneKind
from llama_guard.core.privileges import Credentials, read_credentials, reset_precondition
from llama_guard.gpu.nvml import Nvml, nvml_step
from llama_guard.gpu.nvml_errors import NvmlError
from llama_guard.gpu.readings import GpuSample
from llama_guard.gpu.rules import foreign_processes, process_name, vram_released
from llama_guard.model.inputs import GpuHolder, ResetDone, ResetFacts
from llama_guard.vocab.units import MIB

POLL_S = 0.25  # how often the bounded waits (VRAM release, other processes leaving) look again
OUTPUT_MAX = 300  # characters of the command's output kept (nvidia-smi says what happened first)


def pid_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts as gone: it holds no GPU context)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def holders_of(sample: GpuSample, own: set[int]) -> tuple[GpuHolder, ...]:
    """The processes of ``sample`` other than ``own`` pids, with their MiB and names."""
    return tuple(GpuHolder(p.pid, None if p.used_bytes is None else p.used_bytes // MIB,
                           process_name(p.pid) or "?")
                 for p in foreign_processes(sample, own))


async def run_bounded(argv: list[str], timeout_s: float) -> tuple[int | None, str, str]:
    """Run ``argv`` (no shell) within ``timeout_s`` seconds.

    Returns ``(exit status, output, detail)``: the status is None when it could not be started or
    was killed at the timeout; ``output`` is what it printed, joined on one line and cut at
    :data:`OUTPUT_MAX` characters; ``detail`` one line for the event.
    """
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        return None, "", f"cannot run {argv[0]}: {exc.strerror or exc}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), 5.0)
        return None, "", f"{argv[0]} did not finish within {timeout_s:.0f} s"
    text = " / ".join(line.strip() for line in out.decode(errors="replace").splitlines() if line.strip())
    if len(text) > OUTPUT_MAX:
        text = text[:OUTPUT_MAX] + " ..."
    if proc.returncode != 0:
        return proc.returncode, text, f"{argv[0]} exited {proc.returncode}: {text}"
    return 0, text, text or f"{argv[0]} exited 0"


class ResetExecutor:
    """Inspects and resets one watched GPU through ``nvml``.

    ``halt_xid`` (awaited before the command) stops the Xid waiter so that our NVML session can
    be released; ``resume_xid`` starts it again. ``credentials`` (default: this process's, from
``/proc/self/status``) is injectable for tests; whether they allow a reset is
:func:`llama_guard.core.privileges.reset_precondition` (root with CAP_SYS_ADMIN).
    """

    def __init__(self, nvml: Nvml, *, halt_xid: Callable[[], Awaitable[None]],
                 resume_xid: Callable[[], None], credentials: Callable[[], Credentials] = read_credentials,
                 poll_s: float = POLL_S) -> None:
        self.nvml = nvml
        self._halt_xid = halt_xid
        self._resume_xid = resume_xid
        self._credentials = credentials
        self._poll_s = poll_s
        self._lane = Lane(LaneKind.GPU)

    async def sample(self) -> GpuSample | None:
        """One NVML sample, or None when NVML does not answer."""
        try:
            return await nvml_step(self._lane, self.nvml.sample, "a GPU sample")
        except NvmlError:
            return None

    async def wait_released(self, previous_pid: int, timeout_s: float,
                            baseline_used_bytes: int | None) -> tuple[bool, float]:
        """Wait up to ``timeout_s`` for ``previous_pid`` to leave the GPU; (released, seconds waited)."""
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            sample = await self.sample()
            if sample is not None and vram_released(sample, previous_pid,
                                                    baseline_used_bytes=baseline_used_bytes) is not False:
                return True, time.monotonic() - start
            if sample is None and pid_gone(previous_pid):
                # NVML does not answer (a lost GPU): the process having exited is all we can know.
                return True, time.monotonic() - start
            if time.monotonic() >= deadline:
                return False, time.monotonic() - start
            await asyncio.sleep(self._poll_s)

    async def inspect(self, config: Config, gpu_index: int | None, previous_pid: int | None,
                      baseline_used_bytes: int | None) -> ResetFacts:
        """The facts before a reset: the previous server gone (``[gpu].vram_release_timeout_s``),
        other processes still there after ``[recovery].foreign_wait_s``, and our credentials."""
        released, waited = True, 0.0
        if previous_pid is not None:
            released, waited = await self.wait_released(previous_pid, config.gpu.vram_release_timeout_s,
                                                        baseline_used_bytes)
        try:
            cannot_run = reset_precondition(self._credentials())
        except (OSError, KeyError, ValueError) as exc:
            cannot_run = f"llama-guard's credentials cannot be read (/proc/self/status: {exc})"
        can_run = not cannot_run
        # Another process may be releasing the GPU right now (e.g. the one that made us run out of
        # memory): give it [recovery].foreign_wait_s before reporting it.
        deadline = time.monotonic() + config.recovery.foreign_wait_s
        holders: tuple[GpuHolder, ...] = ()
        while True:
            sample = await self.sample()
            holders = holders_of(sample, {os.getpid()}) if sample is not None else ()
            if not holders or time.monotonic() >= deadline:
                break
            await asyncio.sleep(self._poll_s)
        return ResetFacts(gpu_index, released, waited, holders, can_run, cannot_run)

    async def run(self, config: Config, gpu_index: int | None) -> ResetDone:
        """Run ``[recovery].reset_command`` for ``gpu_index`` with our NVML session released, then
        verify: NVML answers and no process holds the GPU. Never raises."""
        index = "" if gpu_index is None else str(gpu_index)
        argv = [word.replace("{index}", index) for word in config.recovery.reset_command]
        command = " ".join(argv)
        before = await self.sample()
        persistence_on = before is not None and before.persistence_mode is True
        fields: dict[str, object] = {}
        await self._halt_xid()
        await nvml_step(self._lane, self.nvml.suspend, "releasing our NVML session")  # it counts as a user
        try:
            status, output, detail = await run_bounded(argv, config.recovery.reset_timeout_s)
            if (status not in (0, None) and "in use" in output.lower() and persistence_on
                    and config.recovery.reset_toggles_persistence):
                status, output, detail = await self._without_persistence(argv, config.recovery.reset_timeout_s)
                fields["persistence"] = "turned off for the reset, then restored"
        finally:
            self.nvml.resume()
            self._resume_xid()
        if status != 0:
            return ResetDone(gpu_index, command, status, output, False, detail, fields)
        after = await self.sample()
        if after is None:
            return ResetDone(gpu_index, command, status, output, False,
                             f"the GPU does not answer NVML after the reset ({detail})", fields)
        busy = holders_of(after, {os.getpid()})
        if busy:
            return ResetDone(gpu_index, command, status, output, False,
                             f"after the reset pid {busy[0].pid} ({busy[0].name}) already holds the GPU", fields)
        return ResetDone(gpu_index, command, status, output, True, f"{detail}; GPU answers and is idle", fields)

    async def _without_persistence(self, argv: list[str], timeout_s: float) -> tuple[int | None, str, str]:
        """Persistence off, the reset command once more, persistence back on (always restored)."""
        nvml = self.nvml

        def set_mode(enabled: bool) -> None:
            nvml.resume()
            try:
                nvml.set_persistence(enabled)
            finally:
                nvml.suspend()  # release the session again: it counts as a user too

        try:
            await nvml_step(self._lane, lambda: set_mode(False), "persistence mode off")
        except NvmlError as exc:
            return None, "", f"the reset needs persistence mode off, which could not be done: {exc}"
        try:
            status, output, detail = await run_bounded(argv, timeout_s)
        finally:
            try:
                await nvml_step(self._lane, lambda: set_mode(True), "persistence mode on")
            except NvmlError as exc:
                detail = f"{detail}; persistence mode could NOT be restored: {exc}"
        return status, output, detail + " (with persistence mode off for the reset)"
