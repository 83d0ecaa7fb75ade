"""The daemon's GPU watcher and GPU port: it wires the GPU watch's parts to the daemon and answers
the checks before a start and before ready.

Everything NVML-related goes through :class:`llama_guard.gpu.Nvml` (the one chokepoint). Blocking
NVML calls run on the GPU lane, each with its deadline; results come back to the loop as events and
policy inputs (:class:`policy.GpuFault`, the answers of :meth:`GpuSource.ready_check`,
:meth:`GpuSource.before_spawn`, :meth:`GpuSource.reset`). Its parts: the sampling loop
(:mod:`.sampler`), persistence mode (:mod:`.persistence`), the Xid events of NVML and the kernel log
(:mod:`.xid_intake`), the reset (:mod:`.reset`'s executor, halting the Xid waiter while it runs),
the server's VRAM need and the VRAM facts (:mod:`.vram_need`), per-process GPU use (:mod:`.busy`);
the pure rules live in :mod:`.rules` and :mod:`.xid`. They share one NVML handle and the one record
of which pid is ours.

``nvml_module`` (the constructor's) is the pynvml module to use: None is the real ``pynvml``;
tests pass a scriptable fake (tests/fake_pynvml_mod.py, through tests/run_with_fake_nvml.py).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any

from llama_guard.config import Config
from llama_guard.config.gpu import ForeignProcesses, GpuWatchMode
from llama_guard.core.offload import Lane, LaneKind
from llama_guard.gpu import DeviceSelector, GpuIdentity, GpuWatch, Nvml, NvmlError, WatchSettings, open_gpu
from llama_guard.gpu.busy import ProcessBusy
from llama_guard.gpu.nvml import nvml_step
from llama_guard.gpu.nvml_session import DEFAULT_CALL_TIMEOUT_S
from llama_guard.gpu.persistence import enable_persistence
from llama_guard.gpu.readings import GpuSample, sample_to_dict
from llama_guard.gpu.reset import ResetExecutor
from llama_guard.gpu.rules import foreign_processes, server_on_gpu
from llama_guard.gpu.sampler import Sampler
from llama_guard.gpu.vram_need import VramNeed
from llama_guard.gpu.xid_intake import XidIntake
from llama_guard.insight.need_cache import NeedCache
from llama_guard.model.inputs import ResetDone, ResetFacts, VramFacts
from llama_guard.model.transition import Transition
from llama_guard.model.types import RecoveryAction
from llama_guard.model.watcher import Context, Watcher
from llama_guard.vocab.phases import Phase

POLL_S = 0.25  # how often the bounded wait for the server on the GPU looks again
HUNG_AS_LOST_S = 30.0  # an NVML call stuck this long counts as a lost GPU


class GpuSource(Watcher):
    """Watches the configured GPU; can reset it (``[recovery].reset_command``); the daemon's GPU port
    (:class:`llama_guard.core.gpu_port.GpuPort`)."""

    name = "gpu"

    def __init__(self, *, nvml_module: Any = None, need_cache: NeedCache | None = None,
                 nvml_call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, hung_as_lost_s: float = HUNG_AS_LOST_S) -> None:
        """Every NVML call has a deadline of ``nvml_call_timeout_s`` seconds; one stuck
        ``hung_as_lost_s`` seconds counts as a lost GPU. ``need_cache``: the VRAM budget's estimates
        (wiring), for a start before any good one and without ``[gpu].expected_vram_mib``."""
        self._nvml_module = nvml_module
        self.need = VramNeed(need_cache)
        """The server's VRAM need (learned, measured, stated) and the VRAM facts."""
        self._call_timeout_s = nvml_call_timeout_s
        self._hung_as_lost_s = hung_as_lost_s
        self.kmsg_backoff_s = 1.0
        """The first restart delay of a failed kernel-log reader (s); doubled per failure, at most 30 s."""
        self.nvml: Nvml | None = None
        self._busy = ProcessBusy()
        self.identity: GpuIdentity | None = None
        self.watch: GpuWatch | None = None
        self.executor: ResetExecutor | None = None
        self._xids: XidIntake | None = None  # its Xid threads, once the GPU is watched
        self.sampler: Sampler | None = None  # its sampling loop, once the GPU is watched
        self._gpu_lane = Lane(LaneKind.GPU)  # the steps of NVML calls (each call has its own deadline)
        self.off_reason = ""
        self._can_reset = False
        self._server_pid: int | None = None
        self._ready_pid: int | None = None  # the server the policy holds READY, as the loop's last record showed it
        self._baseline_used: int | None = None

    @property
    def degraded(self) -> str:
        """Why the GPU watch is degraded now (an NVML call hangs), else empty."""
        return self.sampler.degraded if self.sampler is not None else ""

    @property
    def can_reset(self) -> bool:
        """True once the GPU is watched: a reset can then be verified."""
        return self._can_reset

    # ------------------------------------------------------------ start / stop

    async def start(self, ctx: Context) -> str | None:
        cfg = ctx.config.gpu
        selector = DeviceSelector(cfg.index, cfg.uuid, cfg.pci_bus_id)
        opened = await nvml_step(self._gpu_lane, lambda: open_gpu(
            selector, enabled=cfg.enabled, module=self._nvml_module, call_timeout_s=self._call_timeout_s),
            "opening NVML")
        if not isinstance(opened, Nvml):
            self.off_reason = opened.reason
            ctx.emit("gpu_watch_off", reason=opened.reason)
            if cfg.enabled is GpuWatchMode.ON:
                return f"[gpu].enabled = \"on\" but the GPU cannot be watched: {opened.reason}"
            return None
        self.nvml = opened
        self.identity = await nvml_step(self._gpu_lane, opened.open, "selecting the GPU")
        self.watch = GpuWatch(WatchSettings.from_config(cfg))
        self.executor = ResetExecutor(opened, halt_xid=self._halt_xid, resume_xid=self._resume_xid)
        self._can_reset = True
        self._xids = XidIntake(opened, self.identity, self.kmsg_backoff_s)
        self._xids.start(ctx)
        xids = self._xids
        self.sampler = Sampler(opened, self.watch, self._gpu_lane, self.identity.index,
                               hung_as_lost_s=self._hung_as_lost_s, xid_error=lambda: xids.error,
                               on_sample=self._sampled)
        self.need.learn(ctx.config)
        return None

    async def close(self) -> None:
        threads = [] if self._xids is None else self._xids.threads
        if self._xids is not None:
            self._xids.stop()
        for thread in threads:
            await nvml_step(self._gpu_lane, functools.partial(thread.join, 2.0), f"ending thread {thread.name}")
        if self.nvml is not None:
            await nvml_step(self._gpu_lane, self.nvml.close, "closing NVML")

    # ------------------------------------------------------------ the sampler

    async def run(self, ctx: Context) -> None:
        if self.sampler is not None:
            await self.sampler.run(ctx)

    async def _sampled(self, ctx: Context, sample: GpuSample, persistence_off: bool) -> None:
        """A good sample: the server's VRAM measured, persistence mode turned on if asked."""
        self.need.measure(sample, self._ready_pid)
        if persistence_off and ctx.config.gpu.enable_persistence:
            assert self.nvml is not None
            await enable_persistence(ctx, self.nvml, self._gpu_lane, sample.identity.index)

    async def vram_facts(self, ctx: Context) -> VramFacts | None:
        """The GPU's free VRAM, what the server needs and the other processes holding VRAM, from one
        NVML sample (:meth:`VramNeed.facts`). None without a watched GPU. Unbounded here: the daemon
        bounds each call."""
        if self.executor is None:
            return None
        return await self.need.facts(ctx, self._index(ctx.config), sample=self.executor.sample,
                                     own_pids=self._own_pids, recovery=self._recovery_action)

    def _own_pids(self) -> set[int]:
        """Our pids on the GPU: the daemon's and the server's (when one runs)."""
        return {os.getpid()} | ({self._server_pid} if self._server_pid is not None else set())

    async def _recovery_action(self) -> RecoveryAction | None:
        """NVML's recovery-action field, read before each start (an Xid may have gone by unseen);
        None where this driver or GPU does not report it, or NVML fails (the sample says why)."""
        if self.nvml is None:
            return None
        try:
            return await nvml_step(self._gpu_lane, self.nvml.recovery_action, "the recovery action")
        except NvmlError:
            return None

    def on_reload(self, ctx: Context, old: Config, new: Config) -> None:
        if self.executor is not None:  # a new model or settings: learn its need before its first start
            self.need.learn(new)

    def on_spawn(self, ctx: Context, pid: int) -> None:
        self._server_pid = pid
        if self.watch is not None:
            self.watch.set_server_pid(pid, ctx.clock())

    def on_transition(self, ctx: Context, step: Transition) -> None:
        self._ready_pid = step.after.pid if step.after.phase is Phase.READY else None

    def on_exit(self, ctx: Context, pid: int, returncode: int | None) -> None:
        if self.watch is not None and pid == self._server_pid:
            self.watch.set_server_pid(None, ctx.clock())

    # ------------------------------------------------------------ what the server needs

    async def before_spawn(self, ctx: Context, previous_pid: int | None) -> str | None:
        if self.nvml is None or self.executor is None:
            return None
        cfg = ctx.config.gpu
        if previous_pid is not None:
            released, waited = await self.executor.wait_released(previous_pid, cfg.vram_release_timeout_s,
                                                                 self._baseline_used)
            if not released:
                ctx.emit("gpu_vram_not_released", gpu_index=self._index(ctx.config), waited_s=waited,
                         server_pid=previous_pid)
        sample = await self.executor.sample()
        if sample is None:
            return "the GPU does not answer NVML; not starting the server onto it"
        if previous_pid is None:
            self._baseline_used = sample.memory_used_bytes
        own = {os.getpid()} | ({self._server_pid} if self._server_pid else set())
        foreign = foreign_processes(sample, own)
        if foreign and cfg.foreign_processes is ForeignProcesses.REFUSE:
            culprits = ", ".join(f"pid {p.pid} ({(p.used_bytes or 0) >> 20} MiB)" for p in foreign)
            return (f"other processes hold VRAM on GPU {self._index(ctx.config)}: {culprits} "
                    "([gpu].foreign_processes = refuse)")
        return None

    async def ready_check(self, ctx: Context, pid: int) -> str | None:
        cfg: Config = ctx.config
        if self.executor is None or cfg.server.n_gpu_layers == 0 or not cfg.gpu.require_server_on_gpu:
            return None
        deadline = time.monotonic() + cfg.gpu.server_on_gpu_timeout_s
        while True:
            sample = await self.executor.sample()
            if sample is not None:
                on = server_on_gpu(sample, pid)
                if on is None or on:
                    return None  # on the GPU, or NVML cannot list processes (nothing to check)
            if time.monotonic() >= deadline:
                return (f"llama-server pid {pid} answers /health but never appeared on GPU {self._index(cfg)} "
                        f"within {cfg.gpu.server_on_gpu_timeout_s:.0f} s: it runs on the CPU")
            await asyncio.sleep(POLL_S)

    # ------------------------------------------------------------ the reset (facts only; the policy decides)

    async def inspect_reset(self, ctx: Context, previous_pid: int | None) -> ResetFacts:
        assert self.executor is not None
        return await self.executor.inspect(ctx.config, self._index(ctx.config), previous_pid, self._baseline_used)

    async def reset(self, ctx: Context, gpu_index: int | None) -> ResetDone:
        assert self.executor is not None
        done = await self.executor.run(ctx.config, gpu_index)
        if done.ok and self.sampler is not None:
            self.sampler.lost_reported = False
        return done

    def _index(self, config: Config) -> int:
        """The watched GPU's NVML index: as selected, else (before the selection) ``[gpu].index``."""
        return self.identity.index if self.identity is not None else config.gpu.index

    async def _halt_xid(self) -> None:
        """Stop the Xid waiter (it drops its NVML event set) before our session is released (while a
        reset runs, :meth:`Nvml.suspend` keeps the sampler out)."""
        if self._xids is not None:
            await nvml_step(self._gpu_lane, self._xids.halt, "halting the Xid waiter")

    def _resume_xid(self) -> None:
        if self._xids is not None:
            self._xids.resume()

    def gpu_busy(self, pid: int) -> bool | None:
        """Whether server ``pid`` or a descendant used the GPU since the previous call
        (:class:`~llama_guard.gpu.busy.ProcessBusy`); None when it cannot be told. Blocking: called
        from the progress sampler's worker thread."""
        return self._busy.busy(self.nvml, pid)

    def last_sample(self) -> GpuSample | None:
        """The latest NVML sample of the watched GPU (frozen); None while the watch is off or before
        the first one. The typed accessor other watchers read (decay's VRAM, metrics)."""
        return self.watch.last_sample if self.watch is not None else None

    def status_fragment(self) -> str:
        """``GPU 0 61°C 212 W`` from the latest sample, for sd_notify STATUS= (empty when off)."""
        last = self.last_sample()
        if last is None:
            return ""
        parts = [f"GPU {last.identity.index}"]
        if last.temperature_c is not None:
            parts.append(f"{last.temperature_c}°C")
        if last.power_mw is not None:
            parts.append(f"{last.power_mw / 1000:.0f} W")
        return " ".join(parts)

    def snapshot(self) -> dict[str, Any] | None:
        if self.watch is None:
            return {"watch": "off", "reason": self.off_reason} if self.off_reason else None
        last = self.watch.last_sample
        return {"identity": None if self.identity is None else self.identity.__dict__,
                "watch": f"degraded: {self.degraded}" if self.degraded else "on",
                "sample": None if last is None else sample_to_dict(last)}
