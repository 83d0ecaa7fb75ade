"""The one NVML chokepoint: every call into the ``pynvml`` module goes through :class:`Nvml`.


What this module adds to the binding wrapper (:mod:`llama_guard.gpu.nvml_session`: lazy init,
deadlines, device selection) and the typed errors (:mod:`llama_guard.gpu.nvml_errors`):

* the sample (:meth:`Nvml.sample`) and the narrow readings (processes, per-process use, the memory
  interface, the recovery action), the one writing call (persistence mode) and the Xid event set;
* per-reading "not supported" (and "no permission") answers cached, logged once, asked again
  after ``unsupported_retry_s`` or after a re-init, so a reading that comes back is seen again;
* :func:`open_gpu`, the daemon's entry point, and :func:`nvml_step`, a step of NVML calls off the loop.

:meth:`XidEventSet.wait` blocks without holding the session's lock.

``[gpu].index`` is NVML's index (PCI bus order, as ``nvidia-smi`` prints it). CUDA numbers GPUs
"fastest first" unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so the index in ``CUDA_VISIBLE_DEVICES``
may name another GPU: start the server with ``CUDA_VISIBLE_DEVICES=<uuid>`` (:attr:`GpuIdentity.uuid`).

The model: nvitop's ``libnvml.py``; nothing outside these three modules touches ``pynvml``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from llama_guard.config.gpu import GpuWatchMode
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy
from llama_guard.gpu.nvml_errors import (
    ERROR_BY_CODE,
    LOST_ERRORS,
    DeviceNotFound,
    LibraryNotFound,
    NoPermission,
    NotSupported,
    NvmlError,
    NvmlHung,
    NvmlTimeout,
    Uninitialized,
    UnknownError,
    describe,
)
from llama_guard.gpu.nvml_session import DEFAULT_CALL_TIMEOUT_S, DeviceSelector, NvmlSession, nvml_text
from llama_guard.gpu.readings import GpuProcess, GpuSample, RemappedRows
from llama_guard.model.types import RecoveryAction

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class WatchOff:
    """GPU watch is off on this host; ``message`` is what the daemon reports, once."""

    reason: str
    error: NvmlError | None = None

    @property
    def message(self) -> str:
        """``GPU watch off: <reason>``."""
        return f"GPU watch off: {self.reason}"


# ---------------------------------------------------------------------------------------------
# The chokepoint
# ---------------------------------------------------------------------------------------------
_NOT_CACHED = (NotSupported, NoPermission)
#: Errors that end the whole sample (and release the session), not just one reading.
_SESSION_ERRORS: tuple[type[NvmlError], ...] = (
    UnknownError, Uninitialized, LibraryNotFound, DeviceNotFound, NvmlHung, *LOST_ERRORS)


class Nvml(NvmlSession):
    """One NVML session on one GPU, opened lazily, and its readings.

    Every public method may raise :class:`LibraryNotFound`, :class:`DriverNotLoaded`,
    :class:`DeviceNotFound` (first open) and the :data:`LOST_ERRORS`; after one of those the session
    is released and the next call re-inits.
    """

    def _reading(self, key: str, read: Callable[[], T], missing: list[str]) -> T | None:
        cached_at = self._unsupported.get(key)
        if cached_at is not None and self._clock() - cached_at < self._retry_s:
            missing.append(key)
            return None
        try:
            value = read()
        except _NOT_CACHED as exc:
            self._unsupported[key] = self._clock()
            missing.append(key)
            if key not in self._announced:
                self._announced.add(key)
                log.info("GPU reading %s unavailable, not asked again for %.0f s: %s", key, self._retry_s, exc)
            return None
        except _SESSION_ERRORS:
            raise
        except NvmlError as exc:  # an odd one-off answer: no value this time, not cached
            log.debug("GPU reading %s failed: %s", key, exc)
            missing.append(key)
            return None
        if cached_at is not None:
            del self._unsupported[key]
            if key in self._announced:
                self._announced.discard(key)
                log.info("GPU reading %s is available again", key)
        return value

    def _static_reading(self, key: str, read: Callable[[], Any], missing: list[str]) -> Any:
        if key not in self._static:
            value = self._reading(key, read, missing)
            if value is None:
                return None
            self._static[key] = value
        return self._static[key]

    # -- the sample ------------------------------------------------------------------------------
    def sample(self) -> GpuSample:
        """One snapshot of the GPU (about a dozen NVML calls; thresholds and driver version are
        read once per session). Raises :class:`LibraryNotFound`, :class:`DriverNotLoaded`,
        :class:`DeviceNotFound` or one of :data:`LOST_ERRORS` (the session is then released)."""
        with self._lock:
            try:
                try:
                    return self._sample()
                except Uninitialized:
                    self._release()  # someone shut NVML down under us: one fresh session, once
                    return self._sample()
            except _SESSION_ERRORS:
                self._release()
                raise

    def _sample(self) -> GpuSample:
        identity = self.open()
        m = self._load_module()
        missing: list[str] = []
        r = self._reading
        s = self._static_reading

        def threshold(kind: int) -> Callable[[], int]:
            return lambda: int(self._dev("nvmlDeviceGetTemperatureThreshold", kind))

        driver = s("driver_version", lambda: nvml_text(self._raw("nvmlSystemGetDriverVersion")), missing)
        slowdown = s("temp_slowdown_c", threshold(m.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN), missing)
        shutdown = s("temp_shutdown_c", threshold(m.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN), missing)
        gpu_max = s("temp_gpu_max_c", threshold(m.NVML_TEMPERATURE_THRESHOLD_GPU_MAX), missing)
        temp = r("temperature_c",
                 lambda: int(self._dev("nvmlDeviceGetTemperature", m.NVML_TEMPERATURE_GPU)), missing)
        power = r("power_mw", lambda: int(self._dev("nvmlDeviceGetPowerUsage")), missing)
        limit = r("power_limit_mw", lambda: int(self._dev("nvmlDeviceGetEnforcedPowerLimit")), missing)
        reasons = r("clock_event_reasons", self._clock_events, missing)
        mem = r("memory", lambda: self._dev("nvmlDeviceGetMemoryInfo"), missing)
        procs = r("processes", self._processes, missing)
        persistence = r("persistence_mode", lambda: bool(self._dev("nvmlDeviceGetPersistenceMode")), missing)
        ecc = r("ecc_uncorrected_volatile", lambda: int(self._dev(
            "nvmlDeviceGetTotalEccErrors", m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC)),
            missing)
        rows = r("remapped_rows", self._remapped_rows, missing)
        gen = r("pcie_gen", lambda: int(self._dev("nvmlDeviceGetCurrPcieLinkGeneration")), missing)
        width = r("pcie_width", lambda: int(self._dev("nvmlDeviceGetCurrPcieLinkWidth")), missing)
        pstate = r("pstate", lambda: int(self._dev("nvmlDeviceGetPerformanceState")), missing)
        return GpuSample(
            identity=identity,
            driver_version=driver,
            temperature_c=temp,
            temp_slowdown_c=slowdown,
            temp_shutdown_c=shutdown,
            temp_gpu_max_c=gpu_max,
            power_mw=power,
            power_limit_mw=limit,
            clock_event_reasons=reasons,
            memory_used_bytes=None if mem is None else int(mem.used),
            memory_total_bytes=None if mem is None else int(mem.total),
            processes=procs,
            persistence_mode=persistence,
            ecc_uncorrected_volatile=ecc,
            remapped_rows=rows,
            pcie_gen=gen,
            pcie_width=width,
            pstate=pstate,
            unsupported=tuple(missing),
        )

    def _clock_events(self) -> int:
        try:
            return int(self._dev("nvmlDeviceGetCurrentClocksEventReasons"))
        except NotSupported as exc:
            if exc.code != 13:
                raise
            return int(self._dev("nvmlDeviceGetCurrentClocksThrottleReasons"))  # pynvml < 12.535

    def _processes(self) -> tuple[GpuProcess, ...]:
        infos = self._dev("nvmlDeviceGetComputeRunningProcesses")
        return tuple(
            GpuProcess(pid=int(p.pid), used_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in infos
        )

    def _remapped_rows(self) -> RemappedRows:
        corr, unc, pending, failure = self._dev("nvmlDeviceGetRemappedRows")
        return RemappedRows(int(corr), int(unc), bool(pending), bool(failure))

    # -- narrow extras ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        """The lock held and the session open for one narrow reading; an error that ends the session
        (:data:`_SESSION_ERRORS`) releases it, then propagates."""
        with self._lock:
            self.open()
            try:
                yield
            except _SESSION_ERRORS:
                self._release()
                raise

    def processes(self) -> tuple[GpuProcess, ...]:
        """Only the compute process list (cheaper than :meth:`sample`); raises like :meth:`sample`,
        and :class:`NotSupported` when this GPU cannot list processes."""
        with self._session():
            return self._processes()

    def process_busy(self, pids: frozenset[int], since_us: int) -> tuple[bool, int]:
        """Whether any of ``pids`` used the GPU (SM or memory utilisation above 0 %) in a sample
        newer than ``since_us``, and the newest sample's timestamp (pass it as the next
        ``since_us``). From ``nvmlDeviceGetProcessUtilization`` (NVIDIA NVML API reference, "Device
        Queries"): per-process samples the driver keeps with CPU timestamps in microseconds. NVML
        answers NOT_FOUND when no process has a sample since ``since_us`` (and this pynvml raises
        status 0 for an empty answer): nobody used the GPU, False. Raises like :meth:`sample`, and
        :class:`NotSupported` where the GPU keeps no per-process samples."""
        with self._lock:
            self.open()
            try:
                samples = self._dev("nvmlDeviceGetProcessUtilization", since_us)
            except NvmlError as exc:
                if exc.code in (0, 6):  # NOT_FOUND (or an empty answer): no sample since since_us
                    return False, since_us
                if isinstance(exc, _SESSION_ERRORS):
                    self._release()
                raise
        newest, busy = since_us, False
        for sample in samples:
            stamp = int(sample.timeStamp)
            if stamp <= since_us:
                continue
            newest = max(newest, stamp)
            # An unavailable figure reads as 0xFFFFFFFF on some drivers: only 1..100 % counts.
            if int(sample.pid) in pids and any(0 < int(v) <= 100 for v in (sample.smUtil, sample.memUtil)):
                busy = True
        return busy, newest

    def memory_interface(self) -> tuple[int, int]:
        """``(bus width in bits, max memory clock in MHz)`` (``nvmlDeviceGetMemoryBusWidth``,
        ``nvmlDeviceGetMaxClockInfo(NVML_CLOCK_MEM)``), for the bandwidth ceiling. Raises like
        :meth:`sample`, and :class:`NotSupported` when the GPU does not report them."""
        with self._session():
            m = self._load_module()
            return (int(self._dev("nvmlDeviceGetMemoryBusWidth")),
                    int(self._dev("nvmlDeviceGetMaxClockInfo", m.NVML_CLOCK_MEM)))

    def recovery_action(self) -> RecoveryAction:
        """What the driver says the GPU needs: the ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` field
        (``nvmlDeviceGetFieldValues``; 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and
        reset, ...). The call succeeds even for a field the driver does not know: the field's own
        return code then says so (INVALID_ARGUMENT or NOT_SUPPORTED: :class:`NotSupported`, as is a
        ``pynvml`` without the constant). Raises like :meth:`sample` otherwise."""
        call = "nvmlDeviceGetFieldValues(GPU_RECOVERY_ACTION)"
        with self._session():
            m = self._load_module()
            try:
                field_id = m.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
            except AttributeError:
                raise NotSupported(call, 13, "this pynvml has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION") from None
            (value,) = self._dev("nvmlDeviceGetFieldValues", [field_id])
        code = int(value.nvmlReturn)
        if code in (2, 3):  # INVALID_ARGUMENT (a field this driver does not know), NOT_SUPPORTED
            raise NotSupported(call, code, "the driver does not report the GPU recovery action")
        if code != 0:
            raise ERROR_BY_CODE.get(code, NvmlError)(call, code, f"field return code {code}")
        try:
            return RecoveryAction(int(value.value.uiVal))
        except ValueError:
            raise NvmlError(call, -1, f"unknown recovery action {int(value.value.uiVal)}") from None

    def set_persistence(self, enabled: bool) -> None:
        """The ONE writing call: set persistence mode (root only). Raises :class:`NoPermission`
        without root. Call it only when ``[gpu].enable_persistence`` is set; never in probes."""
        with self._lock:
            self.open()
            m = self._load_module()
            value = m.NVML_FEATURE_ENABLED if enabled else m.NVML_FEATURE_DISABLED
            self._dev("nvmlDeviceSetPersistenceMode", value)

    def xid_event_set(self) -> XidEventSet:
        """Register for critical Xid events on the watched GPU; raises :class:`NotSupported` where
        the GPU cannot deliver them (see :mod:`llama_guard.gpu.xid`)."""
        with self._lock:
            self.open()
            m = self._load_module()
            event_set = self._raw("nvmlEventSetCreate")
            try:
                self._dev("nvmlDeviceRegisterEvents", m.nvmlEventTypeXidCriticalError, event_set)
            except NvmlError:
                with contextlib.suppress(NvmlError):
                    self._raw("nvmlEventSetFree", event_set)
                raise
            return XidEventSet(self, event_set, m.nvmlEventTypeXidCriticalError)


class XidEventSet:
    """An NVML event set registered for Xid critical errors; made by :meth:`Nvml.xid_event_set`."""

    def __init__(self, nvml: Nvml, event_set: Any, xid_type: int) -> None:
        self._nvml = nvml
        self._set = event_set
        self._xid_type = xid_type
        self.closed = False

    def wait(self, timeout_ms: int) -> int | None:
        """Block up to ``timeout_ms`` for the next Xid; returns the Xid number, or None on NVML's
        (normal) timeout or a non-Xid event. Raises :data:`LOST_ERRORS` / :class:`NvmlError`."""
        try:
            data = self._nvml._raw("nvmlEventSetWait_v2", self._set, timeout_ms, wait_s=timeout_ms / 1000)
        except NvmlTimeout:
            return None
        if int(getattr(data, "eventType", self._xid_type)) & self._xid_type == 0:
            return None
        return int(data.eventData)

    def close(self) -> None:
        """Free the event set (``nvmlEventSetFree``); never raises."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(NvmlError):
                self._nvml._raw("nvmlEventSetFree", self._set)

STEP_TIMEOUT_S = 60.0
"""The deadline of one step made of NVML calls run off the loop (a sample, a mode change): each call
has its own ``call_timeout_s``, and after one hangs the rest fail at once, so this is never reached
while NVML answers."""


async def nvml_step(lane: Lane, fn: Callable[[], T], what: str) -> T:
    """``fn()`` (NVML calls, or waits on our NVML threads) on ``lane`` (a ``GPU`` lane) within
    :data:`STEP_TIMEOUT_S`: its result, or its :class:`NvmlError`; a step past the deadline (or a
    lane full of such) raises :class:`NvmlHung` naming ``what``, as a hung call does."""
    try:
        return await lane.run(fn, STEP_TIMEOUT_S, what)
    except CallTimeout:
        raise NvmlHung(what, STEP_TIMEOUT_S) from None
    except LaneBusy:
        raise NvmlHung.behind(lane.stuck, what, STEP_TIMEOUT_S) from None


def open_gpu(selector: DeviceSelector, *, enabled: GpuWatchMode = GpuWatchMode.AUTO, module: Any = None,
             clock: Callable[[], float] = time.monotonic,
             call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> Nvml | WatchOff:
    """The daemon's entry point: an opened :class:`Nvml`, or :class:`WatchOff` with the reason.

    ``enabled`` is ``[gpu].enabled``: ``"off"`` → WatchOff without touching NVML. With ``"on"`` the
    caller should treat a WatchOff as a configuration error (the GPU is required); with ``"auto"``
    report ``WatchOff.message`` once and carry on. A lost GPU at start is a WatchOff too, with its
    error kept in ``WatchOff.error`` so the caller can tell it from a host without a driver.
    """
    if enabled is GpuWatchMode.OFF:
        return WatchOff("disabled by [gpu].enabled = \"off\"")
    nvml = Nvml(selector, module=module, clock=clock, call_timeout_s=call_timeout_s)
    try:
        nvml.open()
    except NvmlError as exc:
        nvml.close()
        return WatchOff(describe(exc), exc)
    return nvml
