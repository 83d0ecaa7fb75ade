"""The NVML binding wrapper under :class:`llama_guard.gpu.nvml.Nvml`: every call into the ``pynvml``
module goes through :meth:`NvmlSession._raw`.

* lazy ``nvmlInit`` on first use, and a fresh init after the session broke (driver reloaded,
  GPU back after a reset) — :meth:`NvmlSession.close` releases the session, e.g. before a GPU reset;
* NVML's error codes raised as the typed exceptions of :mod:`llama_guard.gpu.nvml_errors`;
  ``NVML_ERROR_UNKNOWN`` on a device handle is retried once with a fresh handle and then becomes
  :class:`GpuLost`;
* device selection by ``[gpu].uuid``, else ``[gpu].pci_bus_id``, else ``[gpu].index``;
* a deadline on every call: each runs on a worker thread of this session (a ``Lane``) and is waited
  for at most ``call_timeout_s`` seconds; one that does not return raises :class:`NvmlHung` naming
  the call, and while it stays stuck every later call fails at once with :class:`NvmlHung` too (no
  worker piles up behind it, :meth:`NvmlSession.close` returns at once). The workers are daemon
  threads, so a hung driver never holds up the process's exit.

The ``pynvml`` module is injectable (``module=``): tests pass a fake. The methods are thread-safe
(one lock around the session state).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llama_guard.core.offload import CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.gpu.nvml_errors import (
    DeviceNotFound,
    GpuLost,
    LibraryNotFound,
    NotSupported,
    NvmlError,
    NvmlHung,
    Suspended,
    UnknownError,
    translate,
)
from llama_guard.gpu.pci import normalise_pci
from llama_guard.gpu.readings import GpuIdentity


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



DEFAULT_CALL_TIMEOUT_S = 5.0


class NvmlSession:
    """One NVML session on one GPU, opened lazily: the init, the device handle, the identity and the
    raw calls with their deadlines. :class:`llama_guard.gpu.nvml.Nvml` adds the readings.

    ``module`` is the pynvml module (default: imported on first use). ``clock`` is monotonic
    seconds, used for the retry of cached "not supported" readings (after ``unsupported_retry_s``
    seconds; the cache is emptied at every fresh init).
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
            raise NvmlHung.behind(lane.stuck, call, timeout_s) from None
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
        uuid = nvml_text(self._raw("nvmlDeviceGetUUID", handle))
        pci = self._raw("nvmlDeviceGetPciInfo", handle)
        bus_id = nvml_text(getattr(pci, "busId", ""))
        name = nvml_text(self._raw("nvmlDeviceGetName", handle))
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


def nvml_text(value: Any) -> str:
    """A ``pynvml`` string answer as text (older bindings return bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)
