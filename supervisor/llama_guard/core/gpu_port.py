"""The daemon's port to the GPU: what it asks of the GPU watcher, when there is one (the VRAM check
before a start, the checks before each spawn and before the server is called ready, the reset
steps, the server's GPU use as a progress signal, the GPU's part of the status line). The daemon is handed
this port (or none) explicitly; it never searches its watchers for one that answers."""

from __future__ import annotations

from typing import Protocol

from llama_guard.model.inputs import ResetDone, ResetFacts, VramFacts
from llama_guard.model.watcher import Context


class GpuPort(Protocol):
    """The GPU watcher as the daemon uses it (:class:`llama_guard.gpu.watcher.GpuSource`)."""

    @property
    def can_reset(self) -> bool:
        """Whether it can reset the GPU and verify it afterwards (the policy is told)."""

    async def vram_facts(self, ctx: Context) -> VramFacts | None:
        """The GPU's free VRAM, what the server needs and who else holds VRAM, for the check before
        each start (bounded: one reading); None when it watches no GPU."""

    async def before_spawn(self, ctx: Context, previous_pid: int | None) -> str | None:
        """Before each spawn (bounded by ``[gpu].vram_release_timeout_s``): wait for
        ``previous_pid``'s VRAM to be released, then one reading; a reason to refuse this start
        (the GPU does not answer, other processes hold VRAM under ``[gpu].foreign_processes =
        "refuse"``), else None."""

    async def ready_check(self, ctx: Context, pid: int) -> str | None:
        """After ``/health`` 200 of server ``pid`` (bounded by ``[gpu].server_on_gpu_timeout_s``):
        None when it may be called ready, else why not (it never appeared on the GPU)."""

    async def inspect_reset(self, ctx: Context, previous_pid: int | None) -> ResetFacts:
        """What stands in the way of a GPU reset now (only called when :attr:`can_reset`): wait,
        bounded, for ``previous_pid`` and other processes to leave the GPU; report, decide nothing."""

    async def reset(self, ctx: Context, gpu_index: int | None) -> ResetDone:
        """Run the reset command on GPU ``gpu_index`` and verify it (only called when
        :attr:`can_reset`, after :meth:`inspect_reset`); reports what happened."""

    def gpu_busy(self, pid: int) -> bool | None:
        """Whether server ``pid`` uses the GPU now (a liveness progress signal, read outside the
        server's HTTP loop); None when it cannot tell. Called from a worker thread."""

    def status_fragment(self) -> str:
        """The GPU's part of the status line (sd_notify ``STATUS=``): ``GPU 0 61°C 212 W``; empty
        while there is no reading."""
