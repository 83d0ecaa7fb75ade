"""Xid errors: what each means, what to do about it, and a blocking NVML waiter for a thread.

Sources: facts/gpu.md (NVIDIA's Xid catalogue, condensed). Xids arrive two ways: NVML events
(:func:`run_xid_waiter`, here) and kernel-log lines (:mod:`llama_guard.gpu.kmsg`); both end in
:func:`classify`, which gives the policy an :class:`XidAction`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from llama_guard.core.types import XidAction
from llama_guard.gpu.nvml import NotSupported, Nvml, NvmlError, XidEventSet

__all__ = ["XID_TABLE", "XidAction", "XidInfo", "run_xid_waiter", "xid_event_fields", "xid_info"]


@dataclass(frozen=True)
class XidInfo:
    """One row of the Xid table."""

    xid: int
    meaning: str
    action: XidAction


_A = XidAction
XID_TABLE: dict[int, XidInfo] = {
    info.xid: info
    for info in (
        XidInfo(13, "graphics engine exception", _A.RESTART),
        XidInfo(31, "GPU memory page fault (MMU fault)", _A.RESTART),
        XidInfo(43, "GPU stopped processing (channel reset)", _A.RESTART),
        XidInfo(94, "contained ECC error", _A.RESTART),
        XidInfo(48, "double-bit ECC error", _A.RESET),
        XidInfo(62, "internal micro-controller halt", _A.RESET),
        XidInfo(64, "ECC page retirement or row remapping failure", _A.RESET),
        XidInfo(95, "uncontained ECC error", _A.RESET),
        XidInfo(119, "GSP RPC timeout", _A.RESET),
        XidInfo(120, "GSP error", _A.RESET),
        XidInfo(79, "GPU has fallen off the bus", _A.RESET_ONCE_THEN_ESCALATE),
        XidInfo(63, "ECC page retirement or row remap recording (pending)", _A.EVENT_ONLY),
        XidInfo(92, "high single-bit ECC error rate", _A.EVENT_ONLY),
        XidInfo(154, "GPU recovery action changed", _A.FOLLOW_RECOVERY_ACTION),
    )
}

#: Xids that are about the application only when the faulting process is ours.
_OURS_ONLY = {43}


def xid_info(xid: int, ours: bool | None = None) -> XidInfo:
    """The table row for ``xid``; unknown Xids are event-only. ``ours`` (from the kernel log's
    ``pid=``/``name=``) downgrades an app-level fault of someone else's process to event-only."""
    info = XID_TABLE.get(xid, XidInfo(xid, "unlisted Xid", XidAction.EVENT_ONLY))
    if xid in _OURS_ONLY and ours is False:
        return XidInfo(xid, info.meaning + " (another process)", XidAction.EVENT_ONLY)
    return info


def xid_event_fields(xid: int, gpu_index: int | None, *, source: str, ours: bool | None = None,
                     pid: int | None = None, name: str | None = None) -> dict[str, object]:
    """Fields of the ``gpu_xid`` event for ``xid`` (``source``: ``"nvml"`` or ``"kmsg"``)."""
    info = xid_info(xid, ours)
    return {"gpu_index": gpu_index, "xid": xid, "meaning": info.meaning, "action": info.action.value,
            "source": source, "xid_pid": pid, "xid_name": name, "ours": ours}


def run_xid_waiter(nvml: Nvml, stop: threading.Event, on_xid: Callable[[int], None], *,
                   on_error: Callable[[NvmlError], None], timeout_ms: int = 1000,
                   retry_s: float = 5.0) -> str:
    """Block on NVML Xid events until ``stop`` is set; run it in its own thread.

    Calls ``on_xid(xid)`` for every critical Xid, ``on_error(exc)`` for a failure (the set is then
    dropped and registered again after ``retry_s``, since a driver reload invalidates it). Waits at
    most ``timeout_ms`` per NVML call so ``stop`` is seen within that time; NVML's Timeout is normal.
    Returns why it ended: ``"stopped"`` or ``"xid events not supported: ..."`` (said once by the caller).
    """
    event_set: XidEventSet | None = None
    try:
        while not stop.is_set():
            try:
                if event_set is None:
                    event_set = nvml.xid_event_set()
                xid = event_set.wait(timeout_ms)
            except NotSupported as exc:
                return f"xid events not supported: {exc.text}"
            except NvmlError as exc:
                on_error(exc)
                if event_set is not None:
                    event_set.close()
                    event_set = None
                stop.wait(retry_s)
                continue
            if xid is not None:
                on_xid(xid)
        return "stopped"
    finally:
        if event_set is not None:
            event_set.close()
