"""Xid errors: the table of what each means, whom it is about and what to do, the matching of
NVML's Xid events with kernel-log lines, and a blocking NVML waiter for a thread.

Xids arrive two ways: NVML events (:func:`run_xid_waiter`: the Xid number only, no pid) and
kernel-log lines (:mod:`llama_guard.gpu.kmsg`: ``pid=``/``name=`` of the faulting process).
:class:`XidMatcher` pairs them: an application-scope Xid from NVML waits (bounded) for the kernel
line of the same Xid so that the policy can tell whether the faulting process is our server.

Source of the table: NVIDIA's "Xid Errors" catalogue (docs.nvidia.com/deploy/xid-errors),
condensed in docs/gpu.md: each row says its scope (one application's fault vs the device's) and
its action.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from llama_guard.gpu.kmsg import XidRecord
from llama_guard.gpu.nvml import Nvml, XidEventSet
from llama_guard.gpu.nvml_errors import NotSupported, NvmlError
from llama_guard.model.types import RecoveryAction, XidAction, XidOrigin, XidScope

__all__ = ["XID_TABLE", "XidAction", "XidInfo", "XidMatcher", "XidReport", "recovery_action_of", "run_xid_waiter",
           "xid_info"]


@dataclass(frozen=True)
class XidInfo:
    """One row of the Xid table: ``scope`` APP acts only for our server's own faults."""

    xid: int
    meaning: str
    action: XidAction
    scope: XidScope
    watchdog: bool = False  # a watchdog timeout on one channel (the policy says when it repeats)
    # The GPU still answers and its memory is as it was: llama-server's KV cache can be saved before
    # the reset (not after an uncorrected memory error, a firmware halt or timeout, or a lost GPU).
    kv_readable: bool = False


_A, _S = XidAction, XidScope
XID_TABLE: dict[int, XidInfo] = {
    info.xid: info
    for info in (
        # The channel's idle watchdog (ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT): one process's work
        # stopped on its channel; NVIDIA's catalogue says restart the application.
        XidInfo(8, "GPU stopped processing on one channel (watchdog timeout)", _A.RESTART, _S.APP,
                watchdog=True),
        XidInfo(13, "graphics engine exception", _A.RESTART, _S.APP),
        XidInfo(31, "GPU memory page fault (MMU fault)", _A.RESTART, _S.APP),
        XidInfo(43, "GPU stopped processing (channel reset)", _A.RESTART, _S.APP),
        XidInfo(45, "preemptive cleanup after a previous error (channel removed)", _A.RESTART, _S.APP),
        XidInfo(68, "video decoder (NVDEC) exception", _A.RESTART, _S.APP),
        XidInfo(69, "graphics engine class error", _A.RESTART, _S.APP),
        XidInfo(94, "contained ECC error", _A.RESTART, _S.APP),
        XidInfo(109, "context switch timeout", _A.RESTART, _S.APP),
        XidInfo(48, "double-bit ECC error", _A.RESET, _S.DEVICE),
        XidInfo(62, "internal micro-controller halt", _A.RESET, _S.DEVICE),
        XidInfo(64, "ECC page retirement or row remapping failure", _A.RESET, _S.DEVICE),
        XidInfo(74, "NVLink error", _A.RESET, _S.DEVICE, kv_readable=True),
        XidInfo(95, "uncontained ECC error", _A.RESET, _S.DEVICE),
        XidInfo(119, "GSP RPC timeout", _A.RESET, _S.DEVICE),
        XidInfo(120, "GSP error", _A.RESET, _S.DEVICE),
        # Off the bus: the driver cannot reach the card, a reset cannot either; the catalogue's
        # immediate action is restarting the machine.
        XidInfo(79, "GPU has fallen off the bus", _A.REBOOT, _S.DEVICE),
        XidInfo(63, "ECC page retirement or row remap recording (pending)", _A.EVENT_ONLY, _S.DEVICE),
        XidInfo(92, "high single-bit ECC error rate", _A.EVENT_ONLY, _S.DEVICE),
        XidInfo(154, "GPU recovery action changed", _A.FOLLOW_RECOVERY_ACTION, _S.DEVICE),
    )
}


# Xid 154's text: "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"; the
# "from" part, the "0x" and the parenthesised name are each optional, and a name alone is read too.
_RECOVERY_TO = re.compile(r"recovery action changed\s+(?:from\s+.*?\s+)?to\s+(?P<to>.+)$", re.IGNORECASE)
_CODE = re.compile(r"^(?:0x)?(?P<code>[0-9a-fA-F]+)\b")
_NAMES: tuple[tuple[re.Pattern[str], RecoveryAction], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), action) for pattern, action in (
        (r"drain\s+and\s+reset", RecoveryAction.DRAIN_AND_RESET),
        (r"drain\s+p2p|drain peer", RecoveryAction.DRAIN_P2P),
        (r"imex", RecoveryAction.RECOVER_IMEX_DOMAIN),
        (r"bus\s+reset", RecoveryAction.BUS_RESET),
        (r"system\s+reboot|power\s+cycle", RecoveryAction.SYSTEM_REBOOT),
        (r"node\s+reboot|reboot", RecoveryAction.NODE_REBOOT),
        (r"gpu\s+reset|reset\s+required", RecoveryAction.GPU_RESET),
        (r"\bnone\b", RecoveryAction.NONE),
    ))


def recovery_action_of(text: str) -> RecoveryAction | None:
    """The recovery action an Xid 154 line changed *to* (its code, else its name); None when the
    text names none or an unknown code (the policy then resets, and NVML's recovery-action field is
    read again before the next start)."""
    match = _RECOVERY_TO.search(text)
    if match is None:
        return None
    to = match["to"].strip()
    code = _CODE.match(to)
    if code is not None:
        try:
            return RecoveryAction(int(code["code"], 16))
        except ValueError:
            return None
    return next((action for pattern, action in _NAMES if pattern.search(to)), None)


def xid_info(xid: int) -> XidInfo:
    """The table row for ``xid``; an unlisted Xid is event-only (device scope: reported, never acted on)."""
    return XID_TABLE.get(xid, XidInfo(xid, "unlisted Xid", XidAction.EVENT_ONLY, XidScope.DEVICE))


@dataclass(frozen=True)
class XidReport:
    """One Xid ready for the policy: which report(s) it came from and the faulting process, if named."""

    xid: int
    origin: XidOrigin
    pid: int | None = None
    name: str | None = None
    text: str = ""


class XidMatcher:
    """Pairs NVML Xid events with kernel-log records of the same Xid (pure; monotonic seconds).

    * An NVML event of an APP-scope Xid is held up to ``window_s`` for its kernel line (the pid);
      with the kernel log off (``kmsg_on`` False) or a DEVICE-scope Xid it is reported at once.
    * A kernel record is reported at once; if an NVML event of that Xid is held, they are reported
      together (``nvml+kmsg``).
    * The second report of one Xid (NVML after kmsg, or kmsg after NVML's was reported) within
      ``window_s`` is a duplicate and is dropped.
    """

    def __init__(self, *, window_s: float = 2.0, kmsg_on: bool = True) -> None:
        self.window_s = window_s
        self.kmsg_on = kmsg_on
        self._held: list[tuple[float, int]] = []            # (deadline, xid) of NVML events waiting
        self._reported: list[tuple[float, int, XidOrigin]] = []  # (time, xid, origin) reported lately

    def _recent(self, now: float) -> None:
        self._reported = [r for r in self._reported if now - r[0] < self.window_s]

    def _seen(self, xid: int, origin: XidOrigin) -> bool:
        return any(x == xid and o is origin for _, x, o in self._reported)

    def nvml(self, xid: int, now: float) -> list[XidReport]:
        """An NVML Xid event at ``now``: the reports to hand on (possibly none yet)."""
        self._recent(now)
        if self._seen(xid, XidOrigin.KMSG):
            return []  # the kernel line came first and was reported
        if not self.kmsg_on or xid_info(xid).scope is XidScope.DEVICE:
            self._reported.append((now, xid, XidOrigin.NVML))
            return [XidReport(xid, XidOrigin.NVML)]
        self._held.append((now + self.window_s, xid))
        return []

    def kmsg(self, record: XidRecord, now: float) -> list[XidReport]:
        """A kernel-log record at ``now`` (a fallen-off-the-bus message without a number is Xid 79)."""
        self._recent(now)
        xid = record.xid if record.xid is not None else 79
        held = next((h for h in self._held if h[1] == xid), None)
        if held is not None:
            self._held.remove(held)
            self._reported.append((now, xid, XidOrigin.KMSG))
            return [XidReport(xid, XidOrigin.NVML_AND_KMSG, record.pid, record.name, record.text)]
        if self._seen(xid, XidOrigin.NVML):
            return []  # NVML's event was already acted on (a device-scope Xid)
        self._reported.append((now, xid, XidOrigin.KMSG))
        return [XidReport(xid, XidOrigin.KMSG, record.pid, record.name, record.text)]

    def due(self, now: float) -> list[XidReport]:
        """Held NVML events whose kernel line did not come within the window: reported without a pid."""
        out = [XidReport(xid, XidOrigin.NVML) for deadline, xid in self._held if now >= deadline]
        self._held = [h for h in self._held if now < h[0]]
        self._reported += [(now, r.xid, XidOrigin.NVML) for r in out]
        return out

    def next_due(self) -> float | None:
        """When :meth:`due` has something next (monotonic seconds), or None."""
        return min((d for d, _ in self._held), default=None)


def run_xid_waiter(nvml: Nvml, stop: threading.Event, on_xid: Callable[[int], None], *,
                   on_error: Callable[[NvmlError], None], timeout_ms: int = 1000,
                   retry_s: float = 5.0) -> str | None:
    """Block on NVML Xid events until ``stop`` is set; run it in its own thread.

    Calls ``on_xid(xid)`` for every critical Xid, ``on_error(exc)`` for a failure (the set is then
    dropped and registered again after ``retry_s``, since a driver reload invalidates it). Waits at
    most ``timeout_ms`` per NVML call so ``stop`` is seen within that time; NVML's Timeout is normal.
    Returns None when ``stop`` ended it, else why it gave up (``"xid events not supported: ..."``,
    said once by the caller).
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
        return None
    finally:
        if event_set is not None:
            event_set.close()
