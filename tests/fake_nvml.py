"""A scriptable stand-in for the ``pynvml`` module (only what llama_guard.gpu calls).

Pass a :class:`FakeNvml` as ``module=`` to :class:`llama_guard.gpu.nvml.Nvml`. Script it with:

* ``gpu.values[key] = value`` — readings (keys: see :data:`DEFAULTS`); a :class:`Seq` gives one
  value per call, the last one sticking (values over time);
  a callable is called on every read;
* ``fake.fail(call, code, times=None)`` — the pynvml function ``call`` raises NVML ``code``
  (``times`` calls, or until ``fake.heal(call)``): NotSupported 3, NoPermission 4, Unknown 999 ...;
* ``fake.lose_gpu()`` — every device call raises GpuIsLost (15) until ``fake.gpu_back()``;
* ``fake.init_error = 9`` (DriverNotLoaded) or ``12`` (LibraryNotFound) — ``nvmlInit`` fails;
* ``fake.hang(call)`` — the pynvml function ``call`` never returns (it blocks until
  ``fake.unhang(call)``): a wedged driver;
* ``gpu.values["recovery_action"] = 1`` — the driver asks for a GPU reset (field values as NVML's
  ``nvmlDeviceGetFieldValues`` gives them: the call succeeds, each field has its own return code);
* ``fake.push_xid(79)`` — the next ``nvmlEventSetWait_v2`` returns that Xid; with none queued it
  raises Timeout (10) at once.

``fake.calls`` counts calls per function name.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llama_guard.gpu.readings import GpuIdentity, GpuProcess, GpuSample, RemappedRows

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_TEMPERATURE_THRESHOLD_MEM_MAX = 2
NVML_TEMPERATURE_THRESHOLD_GPU_MAX = 3
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
nvmlEventTypeXidCriticalError = 0x8
NVML_CLOCK_MEM = 2
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230  # nvidia-ml-py's field id
NVML_VALUE_TYPE_UNSIGNED_INT = 1

GIB = 1024**3


class NVMLError(Exception):
    """Like pynvml's: ``.value`` is the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 4: "Insufficient Permissions", 9: "Driver Not Loaded",
                10: "Timeout", 12: "NVML Shared Library Not Found", 15: "GPU is lost",
                999: "Unknown Error"}.get(self.value, f"error {self.value}")


class Seq:
    """Values over time: one per read, the last one repeating."""

    def __init__(self, *values: Any) -> None:
        self.values = list(values)

    def next(self) -> Any:
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


DEFAULTS: dict[str, Any] = {
    "temperature": 45,
    "thr_slowdown": 89,
    "thr_shutdown": 95,
    "thr_gpu_max": 87,
    "power_mw": 100_000,
    "power_limit_mw": 700_000,
    "clock_events": 0x1,
    "memory_used": 1 * GIB,
    "memory_total": 80 * GIB,
    "processes": [],  # list of (pid, bytes or None)
    "persistence": 1,
    "ecc_uncorrected": 0,
    "remapped_rows": (0, 0, 0, 0),
    "pcie_gen": 5,
    "pcie_width": 16,
    "pstate": 0,
    # nvmlDeviceGetProcessUtilization: (pid, smUtil %, memUtil %) of the processes using the GPU
    # now; each call reports them as samples taken at that moment (a driver keeps a window of them).
    "process_util": [],
    "mem_bus_width_bits": 6016,  # an H200's reading (tests/fixtures/h200_gpu_watch.json)
    "mem_clock_max_mhz": 3201,
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: 0 none (the H200's reading, tests/fixtures/h200_recovery);
    # None: a driver that does not know the field (its per-field return is INVALID_ARGUMENT, 2).
    "recovery_action": 0,
}


@dataclass
class FakeGpu:
    index: int = 0
    uuid: str = "GPU-00000000-1111-2222-3333-444444444444"
    bus_id: str = "00000000:02:00.0"
    name: str = "NVIDIA Fake"
    values: dict[str, Any] = field(default_factory=lambda: dict(DEFAULTS))

    def get(self, key: str) -> Any:
        value = self.values[key]
        if isinstance(value, Seq):
            return value.next()
        return value() if callable(value) else value


@dataclass
class Handle:
    gpu: FakeGpu
    generation: int


@dataclass
class _Obj:
    attrs: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.attrs[name]
        except KeyError:
            raise AttributeError(name) from None


class FakeNvml:
    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGpu] | None = None, driver: str = "535.183.01") -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.driver = driver
        self.calls: Counter[str] = Counter()
        self.init_error: int | None = None
        self.refcount = 0  # NVML's init is reference-counted: shutdown only at zero
        self.generation = 0
        self._fail: dict[str, tuple[int, int | None]] = {}  # call -> (code, remaining or None)
        self.lost = False
        self.xids: deque[int] = deque()
        self.event_sets = 0
        self.persistence_writes: list[int] = []
        self._hung: dict[str, threading.Event] = {}
        for name, value in list(globals().items()):
            if name.startswith(("NVML_", "nvmlEventType")):
                setattr(self, name, value)

    # -- scripting ------------------------------------------------------------------------------
    def fail(self, call: str, code: int, times: int | None = None) -> None:
        self._fail[call] = (code, times)

    def hang(self, call: str) -> None:
        self._hung[call] = threading.Event()

    def unhang(self, call: str) -> None:
        event = self._hung.pop(call, None)
        if event is not None:
            event.set()

    def heal(self, call: str) -> None:
        self._fail.pop(call, None)

    def lose_gpu(self) -> None:
        self.lost = True

    def gpu_back(self) -> None:
        self.lost = False

    def push_xid(self, xid: int) -> None:
        self.xids.append(xid)

    # -- machinery ------------------------------------------------------------------------------
    def _enter(self, call: str, handle: Handle | None = None) -> None:
        self.calls[call] += 1
        hung = self._hung.get(call)
        if hung is not None:
            hung.wait()  # a call that does not return (until unhang)
        if call not in ("nvmlInit", "nvmlShutdown") and not self.initialised:
            raise NVMLError(1)  # Uninitialized
        failing = self._fail.get(call)
        if failing is not None:
            code, remaining = failing
            if remaining is not None:
                if remaining <= 1:
                    del self._fail[call]
                else:
                    self._fail[call] = (code, remaining - 1)
            raise NVMLError(code)
        if handle is not None:
            if self.lost:
                raise NVMLError(15)
            if handle.generation != self.generation:
                raise NVMLError(999)  # a handle from an old session

    def _gpu(self, handle: Handle) -> FakeGpu:
        return handle.gpu

    # -- session --------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        if self.refcount == 0:
            self.generation += 1
        self.refcount += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        if self.refcount == 0:
            raise NVMLError(1)
        self.refcount -= 1

    @property
    def initialised(self) -> bool:
        return self.refcount > 0

    def driver_reload(self) -> None:
        """The kernel module was reloaded: every session and handle is void."""
        self.refcount = 0
        self.generation += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver

    # -- handles --------------------------------------------------------------------------------
    def _handle_for(self, call: str, match: Any) -> Handle:
        self._enter(call)
        if self.lost:
            raise NVMLError(15)
        for gpu in self.gpus:
            if match(gpu):
                return Handle(gpu, self.generation)
        raise NVMLError(28 if call.endswith("Index") else 6)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        return self._handle_for("nvmlDeviceGetHandleByIndex", lambda g: g.index == index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Handle:
        return self._handle_for("nvmlDeviceGetHandleByUUID", lambda g: g.uuid == uuid)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> Handle:
        return self._handle_for("nvmlDeviceGetHandleByPciBusId", lambda g: g.bus_id.lower() == bus_id.lower())

    # -- device readings ------------------------------------------------------------------------
    def _read(self, call: str, handle: Handle, key: str) -> Any:
        self._enter(call, handle)
        return self._gpu(handle).get(key)

    def nvmlDeviceGetIndex(self, h: Handle) -> int:
        self._enter("nvmlDeviceGetIndex", h)
        return h.gpu.index

    def nvmlDeviceGetUUID(self, h: Handle) -> str:
        self._enter("nvmlDeviceGetUUID", h)
        return h.gpu.uuid

    def nvmlDeviceGetName(self, h: Handle) -> str:
        self._enter("nvmlDeviceGetName", h)
        return h.gpu.name

    def nvmlDeviceGetPciInfo(self, h: Handle) -> _Obj:
        self._enter("nvmlDeviceGetPciInfo", h)
        return _Obj({"busId": h.gpu.bus_id})

    def nvmlDeviceGetTemperature(self, h: Handle, sensor: int) -> int:
        assert sensor == NVML_TEMPERATURE_GPU
        return int(self._read("nvmlDeviceGetTemperature", h, "temperature"))

    def nvmlDeviceGetTemperatureThreshold(self, h: Handle, kind: int) -> int:
        key = {NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "thr_slowdown", NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
               "thr_shutdown", NVML_TEMPERATURE_THRESHOLD_GPU_MAX: "thr_gpu_max"}[kind]
        return int(self._read("nvmlDeviceGetTemperatureThreshold", h, key))

    def nvmlDeviceGetPowerUsage(self, h: Handle) -> int:
        return int(self._read("nvmlDeviceGetPowerUsage", h, "power_mw"))

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Handle) -> int:
        return int(self._read("nvmlDeviceGetEnforcedPowerLimit", h, "power_limit_mw"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Handle) -> int:
        return int(self._read("nvmlDeviceGetCurrentClocksEventReasons", h, "clock_events"))

    def nvmlDeviceGetMemoryInfo(self, h: Handle) -> _Obj:
        self._enter("nvmlDeviceGetMemoryInfo", h)
        used, total = h.gpu.get("memory_used"), h.gpu.get("memory_total")
        return _Obj({"used": used, "total": total, "free": total - used})

    def nvmlDeviceGetMemoryBusWidth(self, h: Handle) -> int:
        return int(self._read("nvmlDeviceGetMemoryBusWidth", h, "mem_bus_width_bits"))

    def nvmlDeviceGetMaxClockInfo(self, h: Handle, clock: int) -> int:
        assert clock == NVML_CLOCK_MEM, clock
        return int(self._read("nvmlDeviceGetMaxClockInfo", h, "mem_clock_max_mhz"))

    def nvmlDeviceGetComputeRunningProcesses(self, h: Handle) -> list[_Obj]:
        procs = self._read("nvmlDeviceGetComputeRunningProcesses", h, "processes")
        return [_Obj({"pid": pid, "usedGpuMemory": used}) for pid, used in procs]

    def nvmlDeviceGetProcessUtilization(self, h: Handle, last_seen_us: int) -> list[_Obj]:
        """Samples newer than ``last_seen_us`` (CPU time in µs, as NVML stamps them); NVML's
        NOT_FOUND (6) when no process has one, as the real call answers for an idle GPU."""
        util = self._read("nvmlDeviceGetProcessUtilization", h, "process_util")
        now_us = time.time_ns() // 1000
        samples = [_Obj({"pid": pid, "timeStamp": now_us, "smUtil": sm, "memUtil": mem, "encUtil": 0, "decUtil": 0})
                   for pid, sm, mem in util if now_us > last_seen_us]
        if not samples:
            raise NVMLError(6)
        return samples

    def nvmlDeviceGetPersistenceMode(self, h: Handle) -> int:
        return int(self._read("nvmlDeviceGetPersistenceMode", h, "persistence"))

    def nvmlDeviceSetPersistenceMode(self, h: Handle, mode: int) -> None:
        self._enter("nvmlDeviceSetPersistenceMode", h)
        self.persistence_writes.append(mode)
        h.gpu.values["persistence"] = mode

    def nvmlDeviceGetTotalEccErrors(self, h: Handle, err_type: int, counter: int) -> int:
        assert (err_type, counter) == (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
        return int(self._read("nvmlDeviceGetTotalEccErrors", h, "ecc_uncorrected"))

    def nvmlDeviceGetRemappedRows(self, h: Handle) -> tuple[int, int, int, int]:
        return tuple(self._read("nvmlDeviceGetRemappedRows", h, "remapped_rows"))  # type: ignore[return-value]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: Handle) -> int:
        return int(self._read("nvmlDeviceGetCurrPcieLinkGeneration", h, "pcie_gen"))

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: Handle) -> int:
        return int(self._read("nvmlDeviceGetCurrPcieLinkWidth", h, "pcie_width"))

    def nvmlDeviceGetPerformanceState(self, h: Handle) -> int:
        return int(self._read("nvmlDeviceGetPerformanceState", h, "pstate"))

    def nvmlDeviceGetFieldValues(self, h: Handle, field_ids: list[int]) -> list[_Obj]:
        """As the real call: one value per field id; the call itself succeeds, and a field this
        driver does not know has ``nvmlReturn`` INVALID_ARGUMENT (2) — the H200's answer for an
        unknown id (tests/fixtures/h200_recovery/field_values.json)."""
        self._enter("nvmlDeviceGetFieldValues", h)
        out = []
        for fid in field_ids:
            value = h.gpu.get("recovery_action") if fid == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION else None
            known = value is not None
            out.append(_Obj({"fieldId": fid, "scopeId": 0, "nvmlReturn": 0 if known else 2,
                             "valueType": NVML_VALUE_TYPE_UNSIGNED_INT if known else 0,
                             "value": _Obj({"uiVal": int(value) if known else 0})}))
        return out

    # -- events ---------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> str:
        self._enter("nvmlEventSetCreate")
        self.event_sets += 1
        return f"set{self.event_sets}"

    def nvmlDeviceRegisterEvents(self, h: Handle, types: int, event_set: str) -> None:
        self._enter("nvmlDeviceRegisterEvents", h)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> _Obj:
        self._enter("nvmlEventSetWait_v2")
        if self.lost:
            raise NVMLError(15)
        if not self.xids:
            raise NVMLError(10)
        return _Obj({"eventType": nvmlEventTypeXidCriticalError, "eventData": self.xids.popleft(),
                     "device": None})

    def nvmlEventSetFree(self, event_set: str) -> None:
        self._enter("nvmlEventSetFree")
        self.event_sets -= 1


def sample_from_dict(data: Mapping[str, Any]) -> GpuSample:
    """Rebuild a :class:`GpuSample` from :func:`llama_guard.gpu.readings.sample_to_dict` output (a
    recorded fixture); raises KeyError/TypeError if malformed."""
    values = dict(data)
    values["identity"] = GpuIdentity(**values["identity"])
    procs = values.get("processes")
    values["processes"] = None if procs is None else tuple(GpuProcess(**p) for p in procs)
    rows = values.get("remapped_rows")
    values["remapped_rows"] = None if rows is None else RemappedRows(**rows)
    values["unsupported"] = tuple(values.get("unsupported", ()))
    return GpuSample(**values)
