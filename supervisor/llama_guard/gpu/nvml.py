"""The one NVML chokepoint: every call into the ``pynvml`` module goes through :class:`Nvml`.

Source: NVIDIA's ``nvidia-ml-py`` distribution (import name ``pynvml``), a ctypes binding of
``libnvidia-ml.so`` that ships with the driver. What this module adds:

* lazy ``nvmlInit`` on first use, and a fresh init after the session broke (driver reloaded,
  GPU back after a reset) — :meth:`Nvml.close` releases the session, e.g. before a GPU reset;
* NVML's error codes kept as typed exceptions (:class:`GpuLost`, :class:`DriverNotLoaded`,
  :class:`LibraryNotFound`, :class:`NotSupported`, :class:`NoPermission`, ...) rather than
  flattened to "no value"; ``NVML_ERROR_UNKNOWN`` on a device handle is retried once with a fresh
  handle and then becomes :class:`GpuLost`;
* per-reading "not supported" (and "no permission") answers cached, logged once, asked again
  after ``unsupported_retry_s`` or after a re-init, so a reading that comes back is seen again;
* device selection by ``[gpu].uuid``, else ``[gpu].pci_bus_id``, else ``[gpu].index``;
* a deadline on every call: each runs on a worker thread of this session and is waited for at
  most ``call_timeout_s`` seconds; one that does not return raises :class:`NvmlHung` naming the
  call, and while it stays stuck every later call fails at once with :class:`NvmlHung` too (no
  worker piles up behind it, :meth:`Nvml.close` returns at once). The workers are daemon threads,
  so a hung driver never holds up the process's exit.

The ``pynvml`` module is injectable (``module=``): tests pass a fake. The methods are thread-safe
(one lock around the session state); :meth:`XidEventSet.wait` blocks without holding it.

``[gpu].index`` is NVML's index (PCI bus order, as ``nvidia-smi`` prints it). CUDA numbers GPUs
"fastest first" unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so the index in ``CUDA_VISIBLE_DEVICES``
may name another GPU: start the server with ``CUDA_VISIBLE_DEVICES=<uuid>`` (:attr:`GpuIdentity.uuid`).

One module: the one chokepoint by design (the model: nvitop's ``libnvml.py``); every NVML
call, its deadline, its error translation and its cache live here so nothing else touches ``pynvml``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from llama_guard.config.gpu import GpuWatchMode
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.core.types import RecoveryAction
from llama_guard.gpu.pci import normalise_pci
from llama_guard.gpu.readings import GpuIdentity, GpuProcess, GpuSample, RemappedRows

log = logging.getLogger(__name__)
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Typed errors
# ---------------------------------------------------------------------------------------------
class NvmlError(Exception):
    """An NVML call failed. ``code`` is NVML's return code (``-1`` for errors raised here);
    ``call`` the pynvml function name."""

    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call}: {text} (NVML code {code})")
        self.call = call
        self.code = code
        self.text = text


class GpuLost(NvmlError):
    """The GPU is gone: ``NVML_ERROR_GPU_IS_LOST`` (15), or ``Unknown`` (999) twice on a handle,
    or the selected GPU vanished after it had been found."""


class DriverNotLoaded(NvmlError):
    """``NVML_ERROR_DRIVER_NOT_LOADED`` (9): no kernel driver (driver dropped, or a host without one)."""


class LibraryNotFound(NvmlError):
    """``NVML_ERROR_LIBRARY_NOT_FOUND`` (12) or no ``pynvml`` module: a host without the NVIDIA driver."""


class DriverMismatch(NvmlError):
    """``NVML_ERROR_LIB_RM_VERSION_MISMATCH`` (18): library and kernel module differ (upgrade without reboot)."""


class ResetRequired(NvmlError):
    """``NVML_ERROR_RESET_REQUIRED`` (16): the GPU needs a reset."""


class NotSupported(NvmlError):
    """``NVML_ERROR_NOT_SUPPORTED`` (3), or a function this pynvml/driver lacks: the reading does not exist here."""


class NoPermission(NvmlError):
    """``NVML_ERROR_NO_PERMISSION`` (4): e.g. setting persistence mode without root."""


class NvmlTimeout(NvmlError):
    """``NVML_ERROR_TIMEOUT`` (10): what ``nvmlEventSetWait_v2`` raises when no event came in time (normal)."""


class NvmlHung(NvmlError):
    """An NVML call did not return within its deadline (``call``; ``timeout_s`` seconds), or an
    earlier call is still stuck (``stuck_s``: how long it has been). Code ``-2``."""

    def __init__(self, call: str, timeout_s: float, stuck_s: float = 0.0, first: bool = True) -> None:
        text = (f"did not return within {timeout_s:g} s" if first
                else f"not called: an earlier NVML call has been stuck for {stuck_s:.1f} s")
        super().__init__(call, -2, text)
        self.timeout_s = timeout_s
        self.stuck_s = stuck_s
        self.first = first


class UnknownError(NvmlError):
    """``NVML_ERROR_UNKNOWN`` (999): seen when a device handle goes bad."""


class Uninitialized(NvmlError):
    """``NVML_ERROR_UNINITIALIZED`` (1): the session went away under us; re-initialised on the next call."""


class Suspended(NvmlError):
    """The session is released on purpose (:meth:`Nvml.suspend`, while a GPU reset runs)."""


class DeviceNotFound(NvmlError):
    """The configured uuid / PCI bus id / index names no GPU here (a configuration problem)."""


#: Errors after which the GPU cannot be used until it is back: the ``gpu_lost`` family.
LOST_ERRORS: tuple[type[NvmlError], ...] = (GpuLost, DriverNotLoaded, DriverMismatch, ResetRequired)

_BY_CODE: dict[int, type[NvmlError]] = {
    15: GpuLost,
    1: Uninitialized,
    9: DriverNotLoaded,
    12: LibraryNotFound,
    18: DriverMismatch,
    16: ResetRequired,
    3: NotSupported,
    13: NotSupported,  # NVML_ERROR_FUNCTION_NOT_FOUND: the driver lacks the entry point
    4: NoPermission,
    10: NvmlTimeout,
    999: UnknownError,
    2: DeviceNotFound,  # INVALID_ARGUMENT from a handle lookup
    6: DeviceNotFound,  # NOT_FOUND
    28: DeviceNotFound,  # GPU_NOT_FOUND
}


def translate(exc: BaseException, call: str) -> NvmlError:
    """The typed :class:`NvmlError` for a ``pynvml.NVMLError`` raised by ``call`` (by its ``.value``)."""
    code = getattr(exc, "value", -1)
    code = code if isinstance(code, int) else -1
    cls = _BY_CODE.get(code, NvmlError)
    try:
        text = str(exc)
    except Exception:
        text = type(exc).__name__
    return cls(call, code, text or type(exc).__name__)


def describe(exc: BaseException) -> str:
    """A one-line human reason for an NVML failure, for events and ``GPU watch off: <reason>``."""
    if isinstance(exc, LibraryNotFound):
        return f"NVIDIA driver library not found ({exc.text})"
    if isinstance(exc, DriverNotLoaded):
        return "NVIDIA kernel driver not loaded"
    if isinstance(exc, DriverMismatch):
        return "NVML library and kernel driver versions differ (reboot after a driver upgrade)"
    if isinstance(exc, GpuLost):
        return f"GPU is lost ({exc.text})"
    if isinstance(exc, ResetRequired):
        return "GPU requires a reset"
    if isinstance(exc, DeviceNotFound):
        return f"configured GPU not found ({exc.text})"
    return str(exc)


# ---------------------------------------------------------------------------------------------
# Device selection
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceSelector:
    """Which GPU to watch: ``uuid`` wins over ``pci_bus_id``, which wins over ``index``."""

    index: int = 0
    uuid: str = ""
    pci_bus_id: str = ""

    def describe(self) -> str:
        """How the GPU was chosen, for messages."""
        if self.uuid:
            return f"uuid {self.uuid}"
        if self.pci_bus_id:
            return f"PCI bus id {self.pci_bus_id}"
        return f"index {self.index}"


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

DEFAULT_CALL_TIMEOUT_S = 5.0


class Nvml:
    """One NVML session on one GPU, opened lazily.

    ``module`` is the pynvml module (default: imported on first use). ``clock`` is monotonic
    seconds, used for the retry of cached "not supported" readings. Every public method may raise
    :class:`LibraryNotFound`, :class:`DriverNotLoaded`, :class:`DeviceNotFound` (first open) and the
    :data:`LOST_ERRORS`; after one of those the session is released and the next call re-inits.
    """

    def __init__(
        self,
        selector: DeviceSelector | None = None,
        *,
        module: Any = None,
        clock: Callable[[], float] = time.monotonic,
        unsupported_retry_s: float = 3600.0,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        self.selector = selector or DeviceSelector()
        self._module: Any = module
        self._clock = clock
        self.call_timeout_s = call_timeout_s
        """The deadline of one NVML call, seconds (an event wait: its own timeout on top)."""
        # One call at a time per lane (callers wait their turn on the lock); a call past its
        # deadline keeps its lane's one slot until it returns, and later calls fail at once.
        self._lanes = {False: (Lane(LaneKind.NVML_CALL), threading.Lock()),
                       True: (Lane(LaneKind.NVML_EVENT_WAIT), threading.Lock())}
        self._retry_s = unsupported_retry_s
        self._lock = threading.RLock()
        self._initialised = False
        self._handle: Any = None
        self._identity: GpuIdentity | None = None
        self._static: dict[str, Any] = {}
        self._unsupported: dict[str, float] = {}  # reading -> monotonic time it was cached
        self._announced: set[str] = set()
        self._ever_found = False
        self._suspended = False
        self.init_count = 0

    # -- session -------------------------------------------------------------------------------
    def _load_module(self) -> Any:
        if self._module is None:
            try:
                self._module = importlib.import_module("pynvml")
            except ImportError as exc:
                raise LibraryNotFound("import pynvml", 12,
                                      "the pynvml module (nvidia-ml-py) is not installed") from exc
        return self._module

    @property
    def stuck_call(self) -> tuple[str, float] | None:
        """``(call, seconds stuck)`` while an NVML call is past its deadline, else None."""
        stuck = self._lanes[False][0].stuck or self._lanes[True][0].stuck
        return None if stuck is None else (stuck[0], time.monotonic() - stuck[1])

    def _raw(self, call: str, *args: Any, wait_s: float = 0.0) -> Any:
        """``call(*args)`` with a deadline of ``call_timeout_s`` (+ ``wait_s`` for a call that is
        meant to block, on its own worker). Raises the typed error, or :class:`NvmlHung`."""
        module = self._load_module()
        fn = getattr(module, call, None)
        if fn is None:
            raise NotSupported(call, 13, "function not in this pynvml")
        lane, turn = self._lanes[bool(wait_s)]
        timeout_s = self.call_timeout_s + wait_s
        try:
            with turn:
                return lane.run_sync(lambda: fn(*args), timeout_s, call)
        except CallTimeout:
            raise NvmlHung(call, timeout_s) from None
        except LaneBusy:
            stuck = lane.stuck
            raise NvmlHung(stuck[0] if stuck else call, timeout_s,
                           time.monotonic() - stuck[1] if stuck else 0.0, first=False) from None
        except module.NVMLError as exc:
            raise translate(exc, call) from exc

    def open(self) -> GpuIdentity:
        """Initialise NVML (if not yet) and select the GPU; returns its identity.

        Raises :class:`LibraryNotFound`, :class:`DriverNotLoaded`, :class:`DriverMismatch`,
        :class:`DeviceNotFound` (or :class:`GpuLost` when a GPU found earlier is gone).
        """
        with self._lock:
            if self._initialised and self._identity is not None:
                return self._identity
            if self._suspended:
                raise Suspended("nvmlInit", -1, "NVML is released while the GPU is reset")
            self._raw("nvmlInit")
            self._initialised = True
            self.init_count += 1
            try:
                self._handle = self._get_handle()
                self._identity = self._read_identity()
            except BaseException:
                self._release()
                raise
            self._static.clear()
            self._unsupported.clear()  # a new session may support what the last did not
            self._ever_found = True
            return self._identity

    def _get_handle(self) -> Any:
        sel = self.selector
        try:
            if sel.uuid:
                return self._raw("nvmlDeviceGetHandleByUUID", sel.uuid)
            if sel.pci_bus_id:
                canonical = normalise_pci(sel.pci_bus_id)
                if canonical is None:
                    raise DeviceNotFound("nvmlDeviceGetHandleByPciBusId", -1,
                                         f"not a PCI bus id: {sel.pci_bus_id!r}")
                return self._raw("nvmlDeviceGetHandleByPciBusId", "0000" + canonical)
            return self._raw("nvmlDeviceGetHandleByIndex", sel.index)
        except DeviceNotFound as exc:
            if self._ever_found:
                raise GpuLost(exc.call, exc.code, f"{sel.describe()} no longer found") from exc
            raise DeviceNotFound(exc.call, exc.code, f"no GPU with {sel.describe()}") from exc

    def _read_identity(self) -> GpuIdentity:
        handle = self._handle
        index = int(self._raw("nvmlDeviceGetIndex", handle))
        uuid = _text(self._raw("nvmlDeviceGetUUID", handle))
        pci = self._raw("nvmlDeviceGetPciInfo", handle)
        bus_id = _text(getattr(pci, "busId", ""))
        name = _text(self._raw("nvmlDeviceGetName", handle))
        return GpuIdentity(index=index, uuid=uuid, pci_bus_id=normalise_pci(bus_id) or bus_id, name=name)

    def _release(self) -> None:
        if self._initialised:
            with contextlib.suppress(NvmlError):
                self._raw("nvmlShutdown")
        self._initialised = False
        self._handle = None
        self._identity = None

    def close(self) -> None:
        """Release the NVML session (``nvmlShutdown``); never raises. The next call opens it again."""
        with self._lock:
            self._release()

    def suspend(self) -> None:
        """Release the session and keep it released (every call raises :class:`Suspended`) until
        :meth:`resume`: our own session counts as a user of the GPU, which a reset must not have."""
        with self._lock:
            self._release()
            self._suspended = True

    def resume(self) -> None:
        """End :meth:`suspend`: the next call opens a fresh session."""
        with self._lock:
            self._suspended = False

    @property
    def suspended(self) -> bool:
        """Whether :meth:`suspend` holds the session released."""
        return self._suspended

    # -- calls on the device handle --------------------------------------------------------------
    def _dev(self, call: str, *args: Any) -> Any:
        """Call ``call(handle, *args)``; ``Unknown`` → re-fetch the handle, retry once, then GpuLost."""
        try:
            return self._raw(call, self._handle, *args)
        except UnknownError:
            self._handle = self._get_handle()
            try:
                return self._raw(call, self._handle, *args)
            except UnknownError as exc:
                raise GpuLost(call, exc.code, "Unknown Error twice on the device handle") from exc

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

        driver = s("driver_version", lambda: _text(self._raw("nvmlSystemGetDriverVersion")), missing)
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
    def processes(self) -> tuple[GpuProcess, ...]:
        """Only the compute process list (cheaper than :meth:`sample`); raises like :meth:`sample`,
        and :class:`NotSupported` when this GPU cannot list processes."""
        with self._lock:
            self.open()
            try:
                return self._processes()
            except _SESSION_ERRORS:
                self._release()
                raise

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
        with self._lock:
            self.open()
            try:
                m = self._load_module()
                return (int(self._dev("nvmlDeviceGetMemoryBusWidth")),
                        int(self._dev("nvmlDeviceGetMaxClockInfo", m.NVML_CLOCK_MEM)))
            except _SESSION_ERRORS:
                self._release()
                raise

    def recovery_action(self) -> RecoveryAction:
        """What the driver says the GPU needs: the ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` field
        (``nvmlDeviceGetFieldValues``; 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and
        reset, ...). The call succeeds even for a field the driver does not know: the field's own
        return code then says so (INVALID_ARGUMENT or NOT_SUPPORTED: :class:`NotSupported`, as is a
        ``pynvml`` without the constant). Raises like :meth:`sample` otherwise."""
        call = "nvmlDeviceGetFieldValues(GPU_RECOVERY_ACTION)"
        with self._lock:
            self.open()
            m = self._load_module()
            try:
                field_id = m.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
            except AttributeError:
                raise NotSupported(call, 13, "this pynvml has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION") from None
            try:
                (value,) = self._dev("nvmlDeviceGetFieldValues", [field_id])
            except _SESSION_ERRORS:
                self._release()
                raise
        code = int(value.nvmlReturn)
        if code in (2, 3):  # INVALID_ARGUMENT (a field this driver does not know), NOT_SUPPORTED
            raise NotSupported(call, code, "the driver does not report the GPU recovery action")
        if code != 0:
            raise _BY_CODE.get(code, NvmlError)(call, code, f"field return code {code}")
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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
        stuck = lane.stuck
        raise NvmlHung(stuck[0] if stuck else what, STEP_TIMEOUT_S,
                       time.monotonic() - stuck[1] if stuck else 0.0, first=False) from None


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
