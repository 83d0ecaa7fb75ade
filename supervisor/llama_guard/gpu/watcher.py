"""The daemon's GPU watcher: NVML samples, Xid events, the kernel log, and the GPU reset.

Everything NVML-related goes through :class:`llama_guard.gpu.Nvml` (the one chokepoint). Blocking
NVML calls run in threads; results come back to the loop as events and policy inputs
(:class:`policy.GpuFault`, the answers of :meth:`ready_check`, :meth:`before_spawn`, :meth:`reset`).

``nvml_module`` (the constructor's) is the pynvml module to use: None is the real ``pynvml``;
tests pass a scriptable fake (tests/fake_pynvml_mod.py, through tests/run_with_fake_nvml.py).

One module: the sampler, the Xid intake (NVML events matched with kernel-log records) and
the reset share one NVML handle and the one record of which pid is ours; the pure rules they feed
live in :mod:`.rules`, :mod:`.xid` and :mod:`.reset`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from typing import Any

import psutil

from llama_guard.config import Config, ForeignProcesses, GpuWatchMode
from llama_guard.core.inputs import GpuFault, ResetDone, ResetFacts, VramFacts
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.core.privileges import reset_precondition
from llama_guard.core.types import GpuFaultKind, RecoveryAction, XidAction
from llama_guard.core.watcher import Context, Source
from llama_guard.gpu import DeviceSelector, GpuIdentity, GpuWatch, Nvml, NvmlError, WatchSettings, open_gpu
from llama_guard.gpu.kmsg import AdapterInitFailed, KmsgOff, KmsgParser, UnparsedXid, XidRecord, open_kmsg
from llama_guard.gpu.nvml import DEFAULT_CALL_TIMEOUT_S, NotSupported, NvmlHung, describe, nvml_step
from llama_guard.gpu.readings import GpuSample, sample_to_dict
from llama_guard.gpu.reset import ResetExecutor, holders_of
from llama_guard.gpu.rules import (
    SampleVerdict,
    foreign_processes,
    sample_once,
    server_on_gpu,
)
from llama_guard.gpu.xid import XidMatcher, XidReport, recovery_action_of, run_xid_waiter, xid_info
from llama_guard.insight.budget import Settings
from llama_guard.insight.need_cache import NeedCache, need_key
from llama_guard.units import MIB
from llama_guard.vocab.phases import Phase

POLL_S = 0.25  # how often the bounded wait for the server on the GPU looks again
XID_MATCH_S = 2.0  # how long an application Xid from NVML waits for its kernel-log line (the pid)
HUNG_AS_LOST_S = 30.0  # an NVML call stuck this long counts as a lost GPU
KMSG_MAX_FAILURES = 5  # kernel-log reader failures (each restarted with backoff) before giving up
NEED_LEARN_S = 30.0  # the VRAM need estimate (its child process gives up after 20 s)
NEED_KEY_S = 5.0  # the stat of the model file behind the estimate's cache key


class GpuSource(Source):
    """Watches the configured GPU; can reset it (``[recovery].reset_command``)."""

    name = "gpu"

    def __init__(self, *, nvml_module: Any = None, need_cache: NeedCache | None = None,
                 nvml_call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, hung_as_lost_s: float = HUNG_AS_LOST_S) -> None:
        """Every NVML call has a deadline of ``nvml_call_timeout_s`` seconds; one stuck
        ``hung_as_lost_s`` seconds counts as a lost GPU. ``need_cache``: the VRAM budget's estimates
        (wiring), for a start before any good one and without ``[gpu].expected_vram_mib``."""
        self._nvml_module = nvml_module
        self._needs = need_cache
        self._call_timeout_s = nvml_call_timeout_s
        self._hung_as_lost_s = hung_as_lost_s
        self.degraded = ""
        """Why the GPU watch is degraded now (an NVML call hangs), else empty."""
        self.kmsg_backoff_s = 1.0
        """The first restart delay of a failed kernel-log reader (s); doubled per failure, at most 30 s."""
        self.thread_error: str = ""
        """Set when a watch thread failed for good: the sampler task raises it (supervised)."""
        self.nvml: Nvml | None = None
        self._util_since_us = 0  # NVML timestamp of the newest per-process utilisation sample seen
        self._util_unsupported = False
        self.identity: GpuIdentity | None = None
        self.watch: GpuWatch | None = None
        self.executor: ResetExecutor | None = None
        self.xids = XidMatcher(window_s=XID_MATCH_S, kmsg_on=False)
        self._nvml_recovery: RecoveryAction | None = None  # the field as read with NVML's latest Xid 154
        # The estimate of the configuration's need, learned in a thread when the watch starts and after
        # a reload (the GGUF read costs seconds of CPU): never on a start's path unless another process
        # holds VRAM; then the admission's polls share it.
        self._learning: asyncio.Future[int | None] | None = None
        self._learning_for: tuple[str, Settings] | None = None  # (model, settings) of that read
        self._needs_opened = False
        self._gpu_lane = Lane(LaneKind.GPU)  # the steps of NVML calls (each call has its own deadline)
        self._need_lane = Lane(LaneKind.VRAM_NEED)  # daemon threads: never delay the exit
        self._stat_lane = Lane(LaneKind.VRAM_NEED_KEY)
        self._measured_mib: int | None = None  # the server's VRAM at its last good start (MiB)
        self._measured_pid: int | None = None
        self.off_reason = ""
        self._can_reset = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server_pid: int | None = None
        self._baseline_used: int | None = None
        self._lost_reported = False
        # While a reset runs our NVML session must stay released: :meth:`Nvml.suspend` keeps the
        # sampler out, and the Xid waiter drops its event set (``_xid_halt``; ``_xid_idle`` once it has).
        self._xid_halt = threading.Event()
        self._xid_idle = threading.Event()
        self._xid_idle.set()

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
        self._start_threads(ctx)
        self._learn_need(ctx.config)
        return None

    def _learn_need(self, config: Config) -> asyncio.Future[int | None] | None:
        """Estimate ``config``'s VRAM need in a thread (a no-op when it is known, nothing is offloaded or
        ``[gpu].expected_vram_mib`` states it); returns the estimate's future (None: nothing to learn)."""
        needs = self._needs
        if needs is None or self.executor is None or config.server.n_gpu_layers == 0 or config.gpu.expected_vram_mib:
            return None
        model, settings, directory = str(config.server.model), Settings.from_server(config.server), config.runtime.dir
        first = not self._needs_opened
        self._needs_opened = True

        def learn() -> int | None:
            if first:
                needs.open(directory)
            return needs.learn(model, settings)

        previous = self._learning
        self._learning_for = (model, settings)

        async def run() -> int | None:
            if previous is not None:  # one read at a time: this one after it
                await asyncio.gather(previous, return_exceptions=True)
            return await self._need_lane.run(learn, NEED_LEARN_S, f"the VRAM need of {model}")

        self._learning = asyncio.ensure_future(run())
        self._learning.add_done_callback(lambda f: f.cancelled() or f.exception())  # raised to its awaiter
        return self._learning

    def _start_threads(self, ctx: Context) -> None:
        assert self.nvml is not None
        assert self.identity is not None
        nvml, index = self.nvml, self.identity.index

        def on_xid(xid: int) -> None:
            # NVML's Xid 154 carries no text: what the driver asks for is read from its field here,
            # in this thread (each NVML call has its deadline), not on the loop.
            recovery = None
            if xid_info(xid).action is XidAction.FOLLOW_RECOVERY_ACTION:
                with contextlib.suppress(NvmlError):
                    recovery = nvml.recovery_action()
            ctx.loop.call_soon_threadsafe(self._on_nvml_xid, ctx, xid, recovery)

        def on_error(exc: NvmlError) -> None:
            return None  # the sampler reports a lost GPU; the waiter re-registers by itself

        def xid_thread() -> None:
            while not self._stop.is_set():
                self._xid_idle.clear()
                try:
                    reason = run_xid_waiter(nvml, self._xid_halt, on_xid, on_error=on_error)
                except Exception as exc:  # a thread that dies says so instead of going silent
                    reason = f"the Xid waiter failed: {exc!r}"
                finally:
                    self._xid_idle.set()  # its event set is freed
                if reason is not None:
                    ctx.loop.call_soon_threadsafe(
                        functools.partial(ctx.emit, "gpu_watch_off", reason=reason, gpu_index=index))
                    return
                while self._xid_halt.is_set() and not self._stop.is_set():  # a reset runs
                    self._stop.wait(0.1)

        reader = open_kmsg(ctx.config.gpu.kmsg_path)
        self.xids = XidMatcher(window_s=XID_MATCH_S, kmsg_on=not isinstance(reader, KmsgOff))
        if isinstance(reader, KmsgOff):
            ctx.emit("gpu_kmsg_off", reason=reader.message)
        else:
            parser = KmsgParser(self.identity.pci_bus_id)

            def kmsg_loop() -> None:
                while not self._stop.is_set():
                    for line in reader.poll(1.0):
                        for rec in parser.feed(line):
                            ctx.loop.call_soon_threadsafe(self._on_kmsg_record, ctx, rec)

            def kmsg_thread() -> None:
                """The kernel-log reader, supervised: an exception is reported (watcher_failed) and
                the reader restarted with backoff; after KMSG_MAX_FAILURES the sampler task raises."""
                failures = 0
                while not self._stop.is_set():
                    try:
                        kmsg_loop()
                        return
                    except Exception as exc:
                        failures += 1
                        final = failures >= KMSG_MAX_FAILURES
                        delay = min(self.kmsg_backoff_s * 2.0 ** (failures - 1), 30.0)
                        action = "giving up on the kernel log" if final else f"restarting it in {delay:.1f} s"
                        ctx.loop.call_soon_threadsafe(functools.partial(
                            ctx.emit, "watcher_failed", watcher="gpu.kmsg", error=f"{type(exc).__name__}: {exc}",
                            failures=failures, window_s=0.0, action=action))
                        if final:
                            self.thread_error = f"the kernel-log reader failed {failures} times: {exc!r}"
                            return
                        self._stop.wait(delay)

            self._threads.append(threading.Thread(target=kmsg_thread, name="kmsg", daemon=True))
        self._threads.append(threading.Thread(target=xid_thread, name="xid-waiter", daemon=True))
        for thread in self._threads:
            thread.start()

    async def close(self) -> None:
        self._stop.set()
        self._xid_halt.set()
        for thread in self._threads:
            await nvml_step(self._gpu_lane, functools.partial(thread.join, 2.0), f"ending thread {thread.name}")
        if self.nvml is not None:
            await nvml_step(self._gpu_lane, self.nvml.close, "closing NVML")

    # ------------------------------------------------------------ observations

    def _on_nvml_xid(self, ctx: Context, xid: int, recovery: RecoveryAction | None = None) -> None:
        if recovery is not None:
            self._nvml_recovery = recovery
        self._post_xids(ctx, self.xids.nvml(xid, ctx.clock()))
        due = self.xids.next_due()
        if due is not None:  # an application Xid waits (bounded) for its kernel line
            ctx.loop.call_later(max(0.0, due - ctx.clock()) + 0.01, self._flush_xids, ctx)

    def _on_kmsg_record(self, ctx: Context, record: XidRecord | AdapterInitFailed | UnparsedXid) -> None:
        if isinstance(record, UnparsedXid):
            ctx.emit("gpu_xid_unparsed", gpu_index=self._gpu_index(), line=record.text)
            return
        if isinstance(record, AdapterInitFailed):
            ctx.post(GpuFault(GpuFaultKind.GPU_LOST, f"the driver cannot initialise GPU {record.pci} (RmInitAdapter "
                              "failed)", XidAction.REBOOT, gpu_index=self._gpu_index(), line=record.text))
            return
        self._post_xids(ctx, self.xids.kmsg(record, ctx.clock()))

    def _flush_xids(self, ctx: Context) -> None:
        self._post_xids(ctx, self.xids.due(ctx.clock()))

    def _gpu_index(self) -> int | None:
        return self.identity.index if self.identity is not None else None

    def _post_xids(self, ctx: Context, reports: list[XidReport]) -> None:
        """Hand each Xid to the policy with its table row; the policy judges whose it is."""
        for rep in reports:
            info = xid_info(rep.xid)
            # Xid 154: the kernel line says which recovery action, else NVML's field as read with the
            # event; neither (None): the policy resets, and the field is read again before the next start.
            recovery = None
            if info.action is XidAction.FOLLOW_RECOVERY_ACTION:
                recovery = recovery_action_of(rep.text)
                recovery = self._nvml_recovery if recovery is None else recovery
            ctx.post(GpuFault(GpuFaultKind.XID, f"Xid {rep.xid}: {info.meaning}", info.action, rep.xid,
                              info.scope, rep.pid, rep.name, rep.origin, self._gpu_index(), rep.text,
                              recovery=recovery, watchdog=info.watchdog,
                              kv_readable=info.kv_readable))

    async def run(self, ctx: Context) -> None:
        if self.nvml is None or self.watch is None:
            return
        while True:
            if self.thread_error:
                raise RuntimeError(self.thread_error)
            tick = functools.partial(self._tick, self.nvml, self.watch, ctx.clock())
            result = await nvml_step(self._gpu_lane, tick, "a GPU sample")
            self._observe_hang(ctx, result.error if result is not None else None)
            if result is not None:
                await self._on_tick(ctx, result)
            await asyncio.sleep(ctx.config.gpu.sample_interval_s)

    def _observe_hang(self, ctx: Context, error: BaseException | None) -> None:
        """A hung NVML call: ``gpu_nvml_timeout`` once, the watch degraded, a lost GPU if it stays."""
        index = self.identity.index if self.identity is not None else ctx.config.gpu.index
        if not isinstance(error, NvmlHung):
            if self.degraded and error is None:
                self.degraded = ""
                ctx.emit("gpu_recovered", gpu_index=index, reason="NVML calls return again")
            return
        assert self.nvml is not None
        stuck = self.nvml.stuck_call
        call, stuck_s = stuck if stuck is not None else (error.call, error.timeout_s)
        if not self.degraded:
            self.degraded = f"NVML call {call} hangs"
            ctx.emit("gpu_nvml_timeout", gpu_index=index, call=call, timeout_s=error.timeout_s,
                     effect=f"no GPU readings; counted as a lost GPU after {self._hung_as_lost_s:.0f} s")
        if stuck_s >= self._hung_as_lost_s and not self._lost_reported:
            self._lost_reported = True
            reason = f"NVML call {call} has not returned for {stuck_s:.0f} s"
            ctx.emit("gpu_lost", gpu_index=index, reason=reason, error="NvmlHung", nvml_code=-2, reminder=False)
            ctx.post(GpuFault(GpuFaultKind.GPU_LOST, reason, gpu_index=self._gpu_index()))

    async def _on_tick(self, ctx: Context, result: SampleVerdict) -> None:
        for name, fields in result.events:
            ctx.emit(name, **fields)
        if result.lost and result.error is not None and not self._lost_reported:
            self._lost_reported = True
            ctx.post(GpuFault(GpuFaultKind.GPU_LOST, describe(result.error), gpu_index=self._gpu_index()))
        elif result.sample is not None:
            self._lost_reported = False
            self._measure(ctx, result.sample)
            if result.persistence_off and ctx.config.gpu.enable_persistence:
                await self._enable_persistence(ctx, {"gpu_index": result.sample.identity.index})

    def _measure(self, ctx: Context, sample: GpuSample) -> None:
        """The server's VRAM at its first sample once READY: what the next start will need."""
        pid = self._server_pid
        if pid is None or self._measured_pid == pid or ctx.state.pid != pid or ctx.state.phase is not Phase.READY:
            return
        used = next((p.used_bytes for p in sample.processes or () if p.pid == pid), None)
        if used:
            self._measured_mib, self._measured_pid = used // MIB, pid

    async def _estimated_need(self, ctx: Context, holders: bool) -> int | None:
        """The need estimate (MiB) of the configuration, when known. Unknown and another process holds
        VRAM (``holders``): waits for the estimate (started now unless under way); a caller that times
        out leaves it running for the next poll. Raises what the estimate raised, once per read."""
        if self._needs is None:
            return None
        config = ctx.config
        settings = Settings.from_server(config.server)
        try:
            key = await self._stat_lane.run(lambda: need_key(str(config.server.model), settings), NEED_KEY_S,
                                            "stat of the model file")
        except (CallTimeout, LaneBusy):  # a hung filesystem: the need is unknown for now
            return None
        found, mib = self._needs.known(key)
        if found or key is None or not holders:
            return mib
        learning = self._learning
        if learning is not None and learning.done() and self._learning_for == (str(config.server.model), settings) \
                and (learning.cancelled() or learning.exception() is not None):
            return None  # this configuration's read failed (raised to its first awaiter): unknown
        if learning is None or learning.done():
            learning = self._learn_need(config)
        if learning is None:
            return None
        await asyncio.shield(learning)
        return self._needs.known(key)[1]

    async def vram_facts(self, ctx: Context) -> VramFacts | None:
        """The GPU's free VRAM (MiB), what the server needs (MiB: measured at the last good start,
        else ``[gpu].expected_vram_mib``, else the GGUF estimate when known — awaited only when another
        process holds VRAM, the one case where the need decides anything) and the other processes
        holding VRAM, from one NVML sample. None without a watched GPU. Unbounded here: the daemon
        bounds each call."""
        if self.executor is None:
            return None
        need = self._measured_mib if self._measured_mib is not None else (ctx.config.gpu.expected_vram_mib or None)
        sample = await self.executor.sample()
        index = self._gpu_index()
        if sample is None or sample.memory_used_bytes is None or sample.memory_total_bytes is None:
            why = "NVML gave no sample" if sample is None else "NVML gave no memory reading"
            return VramFacts(index, None, need, error=why)
        own = {os.getpid()} | ({self._server_pid} if self._server_pid is not None else set())
        free = (sample.memory_total_bytes - sample.memory_used_bytes) // MIB
        holders = holders_of(sample, own)
        if need is None:
            need = await self._estimated_need(ctx, bool(holders))
        return VramFacts(index, free, need, holders, recovery=await self._recovery_action())

    async def _recovery_action(self) -> RecoveryAction | None:
        """NVML's recovery-action field, read before each start (an Xid may have gone by unseen);
        None where this driver or GPU does not report it, or NVML fails (the sample says why)."""
        if self.nvml is None:
            return None
        try:
            return await nvml_step(self._gpu_lane, self.nvml.recovery_action, "the recovery action")
        except NvmlError:
            return None

    def _tick(self, nvml: Nvml, watch: GpuWatch, now: float) -> SampleVerdict | None:
        """One sampler tick, or None while a reset holds our NVML session released."""
        if nvml.suspended:
            return None
        return sample_once(nvml, watch, now)

    async def _enable_persistence(self, ctx: Context, fields: dict[str, Any]) -> None:
        """Turn persistence mode on ([gpu].enable_persistence, root only); reports the outcome."""
        index = fields.get("gpu_index")
        if reset_precondition():  # the same credentials: root with CAP_SYS_ADMIN
            ctx.emit("gpu_persistence_off", gpu_index=index,
                     action="not changed: [gpu].enable_persistence needs llama-guard to run as root "
                            "with CAP_SYS_ADMIN")
            return
        nvml = self.nvml
        assert nvml is not None
        try:
            await nvml_step(self._gpu_lane, lambda: nvml.set_persistence(True), "enabling persistence mode")
        except NvmlError as exc:
            ctx.emit("gpu_persistence_off", gpu_index=index, action=f"could not enable it: {exc}")
            return
        ctx.emit("gpu_persistence_off", gpu_index=index,
                 action="enabled by llama-guard ([gpu].enable_persistence); prefer nvidia-persistenced")

    def on_reload(self, ctx: Context, old: Config, new: Config) -> None:
        self._learn_need(new)  # a new model or settings: learn its need before its first start

    def on_spawn(self, ctx: Context, pid: int) -> None:
        self._server_pid = pid
        if self.watch is not None:
            self.watch.set_server_pid(pid, ctx.clock())

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
                ctx.emit("gpu_vram_not_released", gpu_index=cfg.index, waited_s=waited, server_pid=previous_pid)
        sample = await self.executor.sample()
        if sample is None:
            return "the GPU does not answer NVML; not starting the server onto it"
        if previous_pid is None:
            self._baseline_used = sample.memory_used_bytes
        own = {os.getpid()} | ({self._server_pid} if self._server_pid else set())
        foreign = foreign_processes(sample, own)
        if foreign and cfg.foreign_processes is ForeignProcesses.REFUSE:
            culprits = ", ".join(f"pid {p.pid} ({(p.used_bytes or 0) >> 20} MiB)" for p in foreign)
            return f"other processes hold VRAM on GPU {cfg.index}: {culprits} ([gpu].foreign_processes = refuse)"
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
                return (f"llama-server pid {pid} answers /health but never appeared on GPU {cfg.gpu.index} "
                        f"within {cfg.gpu.server_on_gpu_timeout_s:.0f} s: it runs on the CPU")
            await asyncio.sleep(POLL_S)

    # ------------------------------------------------------------ the reset (facts only; the policy decides)

    async def inspect_reset(self, ctx: Context, previous_pid: int | None) -> ResetFacts:
        assert self.executor is not None
        return await self.executor.inspect(ctx.config, self._index(ctx), previous_pid, self._baseline_used)

    async def reset(self, ctx: Context, gpu_index: int | None) -> ResetDone:
        assert self.executor is not None
        done = await self.executor.run(ctx.config, gpu_index)
        if done.ok:
            self._lost_reported = False
        return done

    def _index(self, ctx: Context) -> int:
        return self.identity.index if self.identity is not None else ctx.config.gpu.index

    async def _halt_xid(self) -> None:
        """Stop the Xid waiter (it drops its NVML event set) before our session is released."""
        def halt() -> None:
            self._xid_halt.set()
            self._xid_idle.wait(5.0)  # the waiter blocks at most ~1 s in NVML

        await nvml_step(self._gpu_lane, halt, "halting the Xid waiter")

    def _resume_xid(self) -> None:
        if not self._stop.is_set():
            self._xid_halt.clear()

    def gpu_busy(self, pid: int) -> bool | None:
        """Whether server ``pid`` or a descendant (a wrapper's real llama-server) used the GPU since
        the previous call, from NVML's per-process utilisation samples (:meth:`Nvml.process_busy`).
        None when the watch is off or this GPU keeps no such samples (then never asked again in
        this session) or NVML fails. Called from the progress sampler's worker thread."""
        if self.nvml is None or self._util_unsupported:
            return None
        try:
            pids = frozenset({pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))})
            busy, self._util_since_us = self.nvml.process_busy(pids, self._util_since_us)
        except NotSupported:
            self._util_unsupported = True
            return None
        except (NvmlError, psutil.Error):
            return None
        return busy

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
