"""The policy's GPU requests carried out through the GPU port: the VRAM check before a start
(:class:`~llama_guard.model.actions.CheckVram`) and the reset steps (:class:`InspectGpu`,
:class:`RunReset`). Each always answers an input (facts, possibly empty or with an ``error``);
the daemon runs them as tasks and queues the answer.
"""

from __future__ import annotations

import asyncio

from llama_guard.core.gpu_port import GpuPort
from llama_guard.model.actions import InspectGpu, RunReset
from llama_guard.model.inputs import ResetDone, ResetFacts, VramFacts
from llama_guard.model.policy import VRAM_CHECK_TIMEOUT_S
from llama_guard.model.watcher import Context


class GpuRequests:
    """Asks the ``gpu`` port (None: no GPU watched) for VRAM facts and hands it the reset steps."""

    def __init__(self, ctx: Context, gpu: GpuPort | None) -> None:
        self._ctx = ctx
        self._gpu = gpu
        self._check_failing = False  # the last VRAM check failed (reported once per run of failures)

    async def check_vram(self) -> VramFacts:
        """The GPU's VRAM facts (empty: unknown, or no GPU watched).

        Bounded: a port that fails or does not answer within :data:`VRAM_CHECK_TIMEOUT_S` seconds
        answers facts with an ``error``; the first of a run of failed checks is reported
        (``gpu_vram_check_failed``), not each poll's."""
        facts: VramFacts | None = None
        if self._gpu is not None:
            try:  # bounded: the estimate reads the model file (a FIFO, a hung mount never answer)
                facts = await asyncio.wait_for(self._gpu.vram_facts(self._ctx), VRAM_CHECK_TIMEOUT_S)
            except Exception as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    reason = f"gpu gave no VRAM facts within {VRAM_CHECK_TIMEOUT_S:.0f} s"
                else:
                    reason = f"gpu.vram_facts failed: {exc!r}"
                facts = VramFacts(None, None, None, error=reason)
        if facts is not None and facts.error:
            if not self._check_failing:
                index = facts.gpu_index if facts.gpu_index is not None else self._ctx.get_config().gpu.index
                self._ctx.emit("gpu_vram_check_failed", gpu_index=index, reason=facts.error)
            self._check_failing = True
        else:
            self._check_failing = False
        return facts or VramFacts(None, None, None)

    async def reset_step(self, action: InspectGpu | RunReset) -> ResetFacts | ResetDone:
        """Hand a reset step to the GPU port when it can reset; failures become facts, never raise."""
        gpu = self._gpu if self._gpu is not None and self._gpu.can_reset else None
        if isinstance(action, InspectGpu):
            try:
                if gpu is None:
                    raise RuntimeError("GPU watch is off: a reset cannot be verified")
                return await gpu.inspect_reset(self._ctx, action.previous_pid)
            except Exception as exc:
                return ResetFacts(None, True, 0.0, (), False, f"cannot inspect the GPU: {exc}")
        try:
            if gpu is None:
                raise RuntimeError("GPU watch is off")
            return await gpu.reset(self._ctx, action.gpu_index)
        except Exception as exc:
            return ResetDone(action.gpu_index, "", None, "", False, f"internal error during the reset: {exc!r}")
