"""NVML's failures as typed exceptions: one class per error family NVML's return codes name
(NVIDIA NVML API reference, "Return values"; ``pynvml.NVMLError.value`` is the code), the
:data:`LOST_ERRORS` family after which the GPU cannot be used until it is back, the translation
from a ``pynvml`` error, and a one-line human reason for events."""

from __future__ import annotations

import time


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

    @classmethod
    def behind(cls, stuck: tuple[str, float] | None, call: str, timeout_s: float) -> NvmlHung:
        """``call`` refused at once because its lane is full of calls past their deadline: named
        after ``stuck`` (a lane's oldest stuck call, ``(what, monotonic start)``), else ``call``."""
        if stuck is None:
            return cls(call, timeout_s, first=False)
        return cls(stuck[0], timeout_s, time.monotonic() - stuck[1], first=False)


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

ERROR_BY_CODE: dict[int, type[NvmlError]] = {
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
    cls = ERROR_BY_CODE.get(code, NvmlError)
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
