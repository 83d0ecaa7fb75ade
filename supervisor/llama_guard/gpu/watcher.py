"""The daemon's GPU watcher: NVML samples, Xid events, the kernel log, and the GPU reset.

Everything NVML-related goes through :class:`llama_guard.gpu.Nvml` (the one chokepoint). Blocking
NVML calls run in threads; results come back to the loop as events and policy inputs
(:class:`policy.GpuFault`, the answers of :meth:`ready_check`, :meth:`before_spawn`, :meth:`reset`).

Test hook: ``$LLAMA_GUARD_TEST_NVML_MODULE`` names a module to use instead of ``pynvml`` (a
scriptable fake); it is meant for tests and dry runs only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import os
import threading
import time
from typing import Any

import psutil

from llama_guard.config import Config
from llama_guard.core.types import GpuFault, Input, ResetDone
from llama_guard.core.watcher import Context, Source
from llama_guard.gpu import DeviceSelector, GpuIdentity, GpuWatch, Nvml, NvmlError, WatchSettings, open_gpu
from llama_guard.gpu.kmsg import KmsgOff, KmsgParser, open_kmsg
from llama_guard.gpu.nvml import DEFAULT_CALL_TIMEOUT_S, NvmlHung
from llama_guard.gpu.readings import GpuSample, sample_to_dict
from llama_guard.gpu.rules import SampleVerdict, foreign_processes, sample_once, server_on_gpu, vram_released
from llama_guard.gpu.xid import run_xid_waiter, xid_event_fields, xid_info

TEST_MODULE_ENV = "LLAMA_GUARD_TEST_NVML_MODULE"
POLL_S = 0.25  # how often the bounded waits (VRAM release, server on GPU) look again
HUNG_AS_LOST_S = 30.0  # an NVML call stuck this long counts as a lost GPU
KMSG_MAX_FAILURES = 5  # kernel-log reader failures (each restarted with backoff) before giving up


def _module() -> Any:
    name = os.environ.get(TEST_MODULE_ENV, "")
    return importlib.import_module(name) if name else None


class GpuSource(Source):
    """Watches the configured GPU; can reset it (``[recovery].reset_command``)."""

    name = "gpu"

    def __init__(self, *, module: Any = None, nvml_call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                 hung_as_lost_s: float = HUNG_AS_LOST_S) -> None:
        """``module``: the pynvml module (default: ``pynvml``, or the test hook's). Every NVML call
        has a deadline of ``nvml_call_timeout_s`` seconds; one stuck ``hung_as_lost_s`` seconds
        counts as a lost GPU."""
        self._nvml_module = module
        self._call_timeout_s = nvml_call_timeout_s
        self._hung_as_lost_s = hung_as_lost_s
        self.degraded = ""
        """Why the GPU watch is degraded now (an NVML call hangs), else empty."""
        self.kmsg_backoff_s = 1.0
        """The first restart delay of a failed kernel-log reader (s); doubled per failure, at most 30 s."""
        self.thread_error: str = ""
        """Set when a watch thread failed for good: the sampler task raises it (supervised)."""
        self.nvml: Nvml | None = None
        self.identity: GpuIdentity | None = None
        self.watch: GpuWatch | None = None
        self.off_reason = ""
        self.can_reset = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server_pid: int | None = None
        self._baseline_used: int | None = None
        self._lost_reported = False
        # While a reset runs our NVML session must stay released: the sampler skips its ticks
        # (``_paused``, checked under ``_session_lock``) and the Xid waiter drops its event set
        # (``_xid_halt``; ``_xid_idle`` once it has).
        self._session_lock = threading.Lock()
        self._paused = False
        self._xid_halt = threading.Event()
        self._xid_idle = threading.Event()
        self._xid_idle.set()

    # ------------------------------------------------------------ start / stop

    async def start(self, ctx: Context) -> str | None:
        cfg = ctx.config.gpu
        selector = DeviceSelector(cfg.index, cfg.uuid, cfg.pci_bus_id)
        module = self._nvml_module if self._nvml_module is not None else _module()
        opened = await asyncio.to_thread(open_gpu, selector, enabled=cfg.enabled, module=module,
                                         call_timeout_s=self._call_timeout_s)
        if not isinstance(opened, Nvml):
            self.off_reason = opened.reason
            ctx.emit("gpu_watch_off", reason=opened.reason)
            if cfg.enabled == "on":
                return f"[gpu].enabled = \"on\" but the GPU cannot be watched: {opened.reason}"
            return None
        self.nvml = opened
        self.identity = await asyncio.to_thread(opened.open)
        self.watch = GpuWatch(WatchSettings.from_config(cfg))
        self.can_reset = True
        self._start_threads(ctx)
        return None

    def _start_threads(self, ctx: Context) -> None:
        assert self.nvml is not None
        assert self.identity is not None
        nvml, index = self.nvml, self.identity.index

        def on_xid(xid: int) -> None:
            ctx.loop.call_soon_threadsafe(self._on_xid, ctx, xid, "nvml", None, None, None)

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
                if reason != "stopped":
                    ctx.loop.call_soon_threadsafe(
                        functools.partial(ctx.emit, "gpu_watch_off", reason=reason, gpu_index=index))
                    return
                while self._xid_halt.is_set() and not self._stop.is_set():  # a reset runs
                    self._stop.wait(0.1)

        reader = open_kmsg(ctx.config.gpu.kmsg_path)
        if isinstance(reader, KmsgOff):
            ctx.emit("gpu_kmsg_off", reason=reader.message)
        else:
            parser = KmsgParser(self.identity.pci_bus_id)

            def kmsg_loop() -> None:
                while not self._stop.is_set():
                    for line in reader.poll(1.0):
                        for rec in parser.feed(line):
                            xid = rec.xid if rec.xid is not None else 79
                            ctx.loop.call_soon_threadsafe(self._on_xid, ctx, xid, "kmsg",
                                                          rec.is_ours(self._server_pid), rec.pid, rec.name)

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
            await asyncio.to_thread(thread.join, 2.0)
        if self.nvml is not None:
            await asyncio.to_thread(self.nvml.close)

    # ------------------------------------------------------------ observations

    def _on_xid(self, ctx: Context, xid: int, source: str, ours: bool | None, pid: int | None,
                name: str | None) -> None:
        index = self.identity.index if self.identity is not None else None
        fields = xid_event_fields(xid, index, source=source, ours=ours, pid=pid, name=name)
        ctx.emit("gpu_xid", **fields)
        info = xid_info(xid, ours)
        ctx.post(GpuFault("xid", f"Xid {xid}: {info.meaning}", info.action.value, xid))

    async def run(self, ctx: Context) -> None:
        if self.nvml is None or self.watch is None:
            return
        while True:
            if self.thread_error:
                raise RuntimeError(self.thread_error)
            result = await asyncio.to_thread(self._tick, self.nvml, self.watch, ctx.clock())
            self._observe_hang(ctx, result.error if result is not None else None)
            for name, fields in (result.events if result is not None else []):
                ctx.emit(name, **fields)
                if name == "gpu_lost" and not self._lost_reported:
                    self._lost_reported = True
                    ctx.post(GpuFault("gpu_lost", str(fields.get("reason", "GPU lost"))))
                elif name == "gpu_recovered":
                    self._lost_reported = False
                elif name == "gpu_persistence_off" and ctx.config.gpu.enable_persistence:
                    await self._enable_persistence(ctx, fields)
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
            ctx.post(GpuFault("gpu_lost", reason))

    def _tick(self, nvml: Nvml, watch: GpuWatch, now: float) -> SampleVerdict | None:
        """One sampler tick, or None while a reset holds our NVML session released."""
        with self._session_lock:
            if self._paused:
                return None
            return sample_once(nvml, watch, now)

    async def _release_session(self) -> None:
        """Pause the sampler and the Xid waiter and shut our NVML session down (before a reset)."""
        assert self.nvml is not None
        nvml = self.nvml

        def release() -> None:
            with self._session_lock:
                self._paused = True
                self._xid_halt.set()
            self._xid_idle.wait(5.0)  # the waiter blocks at most ~1 s in NVML
            with self._session_lock:
                nvml.close()

        await asyncio.to_thread(release)

    async def _reset_without_persistence(self, argv: list[str], timeout_s: float) -> tuple[str, str]:
        """Persistence off, the reset command once more, persistence back on (always restored)."""
        assert self.nvml is not None
        nvml = self.nvml

        def set_mode(enabled: bool) -> None:
            with self._session_lock:
                nvml.set_persistence(enabled)
                nvml.close()  # release the session again: it counts as a user too

        try:
            await asyncio.to_thread(set_mode, False)
        except NvmlError as exc:
            return "failed", f"the reset needs persistence mode off, which could not be done: {exc}"
        try:
            outcome, detail = await _run_bounded(argv, timeout_s)
        finally:
            try:
                await asyncio.to_thread(set_mode, True)
            except NvmlError as exc:
                detail = f"{detail}; persistence mode could NOT be restored: {exc}"
        return outcome, detail + " (with persistence mode off for the reset)"

    def _resume(self) -> None:
        with self._session_lock:
            self._paused = False
            if not self._stop.is_set():
                self._xid_halt.clear()

    async def _enable_persistence(self, ctx: Context, fields: dict[str, Any]) -> None:
        """Turn persistence mode on ([gpu].enable_persistence, root only); reports the outcome."""
        index = fields.get("gpu_index")
        if os.geteuid() != 0:
            ctx.emit("gpu_persistence_off", gpu_index=index,
                     action="not changed: [gpu].enable_persistence needs llama-guard to run as root")
            return
        assert self.nvml is not None
        try:
            await asyncio.to_thread(self.nvml.set_persistence, True)
        except NvmlError as exc:
            ctx.emit("gpu_persistence_off", gpu_index=index, action=f"could not enable it: {exc}")
            return
        ctx.emit("gpu_persistence_off", gpu_index=index,
                 action="enabled by llama-guard ([gpu].enable_persistence); prefer nvidia-persistenced")

    def on_spawn(self, ctx: Context, pid: int) -> None:
        self._server_pid = pid
        if self.watch is not None:
            self.watch.set_server_pid(pid, ctx.clock())

    def on_exit(self, ctx: Context, pid: int, returncode: int | None) -> None:
        if self.watch is not None and pid == self._server_pid:
            self.watch.set_server_pid(None, ctx.clock())

    async def _sample(self) -> GpuSample | None:
        if self.nvml is None:
            return None
        try:
            return await asyncio.to_thread(self.nvml.sample)
        except NvmlError:
            return None

    # ------------------------------------------------------------ what the server needs

    async def _wait_released(self, previous_pid: int, timeout_s: float) -> tuple[bool, float]:
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            sample = await self._sample()
            if sample is not None and vram_released(sample, previous_pid,
                                                    baseline_used_bytes=self._baseline_used) is not False:
                return True, time.monotonic() - start
            if sample is None and _pid_gone(previous_pid):
                # NVML does not answer (a lost GPU): the process having exited is all we can know.
                return True, time.monotonic() - start
            if time.monotonic() >= deadline:
                return False, time.monotonic() - start
            await asyncio.sleep(POLL_S)

    async def before_spawn(self, ctx: Context, previous_pid: int | None) -> str | None:
        if self.nvml is None:
            return None
        cfg = ctx.config.gpu
        if previous_pid is not None:
            released, waited = await self._wait_released(previous_pid, cfg.vram_release_timeout_s)
            if not released:
                ctx.emit("gpu_vram_not_released", gpu_index=cfg.index, waited_s=waited, server_pid=previous_pid)
        sample = await self._sample()
        if sample is None:
            return "the GPU does not answer NVML; not starting the server onto it"
        if previous_pid is None:
            self._baseline_used = sample.memory_used_bytes
        own = {os.getpid()} | ({self._server_pid} if self._server_pid else set())
        foreign = foreign_processes(sample, own)
        if foreign and cfg.foreign_processes == "refuse":
            culprits = ", ".join(f"pid {p.pid} ({(p.used_bytes or 0) >> 20} MiB)" for p in foreign)
            return f"other processes hold VRAM on GPU {cfg.index}: {culprits} ([gpu].foreign_processes = refuse)"
        return None

    async def ready_check(self, ctx: Context, pid: int) -> str | None:
        cfg: Config = ctx.config
        if self.nvml is None or cfg.server.n_gpu_layers == 0 or not cfg.gpu.require_server_on_gpu:
            return None
        deadline = time.monotonic() + cfg.gpu.server_on_gpu_timeout_s
        while True:
            sample = await self._sample()
            if sample is not None:
                on = server_on_gpu(sample, pid)
                if on is None or on:
                    return None  # on the GPU, or NVML cannot list processes (nothing to check)
            if time.monotonic() >= deadline:
                return (f"llama-server pid {pid} answers /health but never appeared on GPU {cfg.gpu.index} "
                        f"within {cfg.gpu.server_on_gpu_timeout_s:.0f} s: it runs on the CPU")
            await asyncio.sleep(POLL_S)

    # ------------------------------------------------------------ the reset

    async def reset(self, ctx: Context, previous_pid: int | None, reason: str) -> Input:
        """Reset the GPU; the answer is a :class:`ResetDone`. Never raises."""
        assert self.nvml is not None
        cfg = ctx.config
        index = self.identity.index if self.identity is not None else cfg.gpu.index
        base: dict[str, object] = {"gpu_index": index}
        if previous_pid is not None:
            released, waited = await self._wait_released(previous_pid, cfg.gpu.vram_release_timeout_s)
            if not released:
                return ResetDone("skipped", f"llama-server pid {previous_pid} still holds the GPU after "
                                            f"{waited:.0f} s", base)
        if os.geteuid() != 0:
            return ResetDone("skipped", "llama-guard is not root: nvidia-smi --gpu-reset needs root", base)
        # Another process may be releasing the GPU right now (e.g. the one that made us run out of
        # memory): give it [recovery].foreign_wait_s before deciding the reset cannot be done.
        deadline = time.monotonic() + cfg.recovery.foreign_wait_s
        while True:
            sample = await self._sample()
            foreign = foreign_processes(sample, {os.getpid()}) if sample is not None else []
            if not foreign or time.monotonic() >= deadline:
                break
            await asyncio.sleep(POLL_S)
        if sample is not None and foreign:
            culprit = foreign[0]
            return ResetDone("skipped", f"pid {culprit.pid} ({_comm(culprit.pid)}) holds GPU {index}; "
                                        "restarting the server without a reset",
                             {**base, "foreign_pid": culprit.pid, "foreign_name": _comm(culprit.pid)})
        argv = [word.replace("{index}", str(index)) for word in cfg.recovery.reset_command]
        base["command"] = " ".join(argv)
        persistence_on = sample is not None and sample.persistence_mode is True
        await self._release_session()  # our own NVML session counts as a user of the GPU
        try:
            outcome, detail = await _run_bounded(argv, cfg.recovery.reset_timeout_s)
            if (outcome != "ok" and "in use" in detail.lower() and persistence_on
                    and cfg.recovery.reset_toggles_persistence):
                # Persistence mode counts as a user on some drivers: off, one more try, then back on.
                outcome, detail = await self._reset_without_persistence(argv, cfg.recovery.reset_timeout_s)
                base["persistence"] = "turned off for the reset, then restored"
        finally:
            self._resume()
        if outcome != "ok":
            return ResetDone("failed", detail, base)
        sample = await self._sample()
        if sample is None:
            return ResetDone("failed", f"the GPU does not answer NVML after the reset ({detail})", base)
        busy = foreign_processes(sample, {os.getpid()})
        if busy:
            return ResetDone("failed", f"after the reset pid {busy[0].pid} already holds the GPU", base)
        self._lost_reported = False
        return ResetDone("succeeded", f"{detail}; GPU answers and is idle", base)

    def status_fragment(self) -> str:
        """``GPU 0 61°C 212 W`` from the latest sample, for sd_notify STATUS= (empty when off)."""
        last = self.watch.last_sample if self.watch is not None else None
        if last is None:
            return ""
        parts = [f"GPU {last.identity.index}" if getattr(last, "identity", None) else "GPU"]
        if last.temperature_c is not None:
            parts.append(f"{last.temperature_c}°C")
        if last.power_mw is not None:
            parts.append(f"{last.power_mw / 1000:.0f} W")
        return " ".join(parts)

    def snapshot(self) -> dict[str, Any] | None:
        if self.watch is None:
            return {"watch": "off", "reason": self.off_reason} if self.off_reason else None
        last = getattr(self.watch, "last_sample", None)
        return {"identity": None if self.identity is None else self.identity.__dict__,
                "watch": f"degraded: {self.degraded}" if self.degraded else "on",
                "sample": None if last is None else sample_to_dict(last)}


def _pid_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts as gone: it holds no GPU context)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


async def _run_bounded(argv: list[str], timeout_s: float) -> tuple[str, str]:
    """Run ``argv`` (no shell) within ``timeout_s``; ("ok" | "failed", one-line detail)."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        return "failed", f"cannot run {argv[0]}: {exc.strerror or exc}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), 5.0)
        return "failed", f"{argv[0]} did not finish within {timeout_s:.0f} s"
    text = " / ".join(line.strip() for line in out.decode(errors="replace").splitlines() if line.strip())
    if len(text) > 300:  # nvidia-smi says what happened first, then generic advice
        text = text[:300] + " ..."
    if proc.returncode != 0:
        return "failed", f"{argv[0]} exited {proc.returncode}: {text}"
    return "ok", text or f"{argv[0]} exited 0"
