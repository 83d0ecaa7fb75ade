"""The GPU watch's sampling loop: one NVML sample of the watched GPU every
``[gpu].sample_interval_s`` seconds, on the GPU lane, fed to :class:`~llama_guard.gpu.GpuWatch`
(:func:`~llama_guard.gpu.rules.sample_once`: the watch rules' events come back to be emitted).

A lost GPU is posted once as :class:`~llama_guard.model.inputs.GpuFault` (``GPU_LOST``) until a
sample succeeds again (or a reset: :attr:`Sampler.lost_reported`). A hung NVML call
(:class:`~llama_guard.gpu.nvml_errors.NvmlHung`) is ``gpu_nvml_timeout`` once and degrades the
watch (:attr:`Sampler.degraded`); one stuck ``hung_as_lost_s`` seconds counts as a lost GPU.
While a reset holds our NVML session released, no sample is taken. A failed Xid intake
(``xid_error``, non-empty) ends the loop with RuntimeError (the watcher is supervised).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

from llama_guard.core.offload import Lane
from llama_guard.gpu import GpuWatch, Nvml
from llama_guard.gpu.nvml import nvml_step
from llama_guard.gpu.nvml_errors import NvmlHung, describe
from llama_guard.gpu.readings import GpuSample
from llama_guard.gpu.rules import SampleVerdict, sample_once
from llama_guard.model.inputs import GpuFault
from llama_guard.model.types import GpuFaultKind
from llama_guard.model.watcher import Context


def _tick(nvml: Nvml, watch: GpuWatch, now: float) -> SampleVerdict | None:
    """One sampler tick, or None while a reset holds our NVML session released."""
    if nvml.suspended:
        return None
    return sample_once(nvml, watch, now)


class Sampler:
    """Samples GPU ``gpu_index`` (its NVML index) through ``nvml`` into ``watch`` on ``lane``; each good
    sample goes to ``on_sample(ctx, sample, persistence_off)``."""

    def __init__(self, nvml: Nvml, watch: GpuWatch, lane: Lane, gpu_index: int, *, hung_as_lost_s: float,
                 xid_error: Callable[[], str],
                 on_sample: Callable[[Context, GpuSample, bool], Awaitable[None]]) -> None:
        self._nvml = nvml
        self._watch = watch
        self._lane = lane
        self._index = gpu_index
        self._hung_as_lost_s = hung_as_lost_s
        self._xid_error = xid_error
        self._on_sample = on_sample
        self.degraded = ""
        """Why the GPU watch is degraded now (an NVML call hangs), else empty."""
        self.lost_reported = False
        """A lost GPU was posted (not again until a sample or a reset succeeds)."""

    async def run(self, ctx: Context) -> None:
        while True:
            error = self._xid_error()
            if error:
                raise RuntimeError(error)
            tick = functools.partial(_tick, self._nvml, self._watch, ctx.clock())
            result = await nvml_step(self._lane, tick, "a GPU sample")
            self._observe_hang(ctx, result.error if result is not None else None)
            if result is not None:
                await self._on_tick(ctx, result)
            await asyncio.sleep(ctx.config.gpu.sample_interval_s)

    def _observe_hang(self, ctx: Context, error: BaseException | None) -> None:
        """A hung NVML call: ``gpu_nvml_timeout`` once, the watch degraded, a lost GPU if it stays."""
        index = self._index
        if not isinstance(error, NvmlHung):
            if self.degraded and error is None:
                self.degraded = ""
                ctx.emit("gpu_recovered", gpu_index=index, reason="NVML calls return again")
            return
        stuck = self._nvml.stuck_call
        call, stuck_s = stuck if stuck is not None else (error.call, error.timeout_s)
        if not self.degraded:
            self.degraded = f"NVML call {call} hangs"
            ctx.emit("gpu_nvml_timeout", gpu_index=index, call=call, timeout_s=error.timeout_s,
                     effect=f"no GPU readings; counted as a lost GPU after {self._hung_as_lost_s:.0f} s")
        if stuck_s >= self._hung_as_lost_s and not self.lost_reported:
            self.lost_reported = True
            reason = f"NVML call {call} has not returned for {stuck_s:.0f} s"
            ctx.emit("gpu_lost", gpu_index=index, reason=reason, error="NvmlHung", nvml_code=-2, reminder=False)
            ctx.post(GpuFault(GpuFaultKind.GPU_LOST, reason, gpu_index=index))

    async def _on_tick(self, ctx: Context, result: SampleVerdict) -> None:
        for name, fields in result.events:
            ctx.emit(name, **fields)
        if result.lost and result.error is not None and not self.lost_reported:
            self.lost_reported = True
            ctx.post(GpuFault(GpuFaultKind.GPU_LOST, describe(result.error), gpu_index=self._index))
        elif result.sample is not None:
            self.lost_reported = False
            await self._on_sample(ctx, result.sample, result.persistence_off)
