"""Kernel-log Xid lines: a parser for NVIDIA's ``NVRM:`` messages and a reader of new /dev/kmsg records.

Source: the kernel ring buffer, as ``/dev/kmsg`` records (``pri,seq,usec,flags;text``) or ``dmesg``
text (``[  12.345678] text``). Lines recognised (docs/gpu.md, from NVIDIA's Xid documentation and
real kernel logs), across driver generations::

    NVRM: Xid (PCI:0000:02:00): 79, pid=1234, name=llama-server, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:02:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:3b:00): 31, pid=2345, name=python3, channel 0x00000012, intr 00000000. MMU Fault ...
    NVRM: Xid (0000:02:00): 13, Graphics SM Warp Exception ...          (older: no pid/name, no "PCI:")
    NVRM: Xid (PCI:0000:02:00 GPU-I:05): 94, pid=1234, name=llama-server, Contained: ...  (MIG)
    NVRM: Xid (PCI:0000:02:00 GPU-I:05 GPU-CI:00): 94, ...              (MIG, with compute instance)
    NVRM: GPU 0000:02:00.0: GPU has fallen off the bus.                 (no Xid number)
    NVRM: The NVIDIA GPU 0000:b3:00.0                                   (three-line form, no Xid number)
    NVRM: (PCI ID: 10de:26b5) installed in this system has
    NVRM: fallen off the bus and is not responding to commands.

Any ``NVRM: Xid`` line that does not parse comes back as :class:`UnparsedXid` (reported with the
raw line, never dropped). Reading /dev/kmsg needs CAP_SYSLOG when ``kernel.dmesg_restrict=1``; an unreadable log is a
:class:`KmsgOff` value the daemon reports once (NVML's Xid events still work).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
from dataclasses import dataclass

from llama_guard.gpu.pci import normalise_pci

_KMSG_PREFIX = re.compile(r"^\d+,\d+,\d+,[^;]*;")
_DMESG_PREFIX = re.compile(r"^\[\s*\d+\.\d+\]\s?")
# The bus id, then (on a MIG-partitioned GPU) attributes up to ")": "GPU-I:05", "GPU-CI:00" ...
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)(?P<attrs>\s[^)]*)?\)[^:]*: "
                  r"(?P<xid>\d+),?\s*(?P<rest>.*)$")
_GPU_I = re.compile(r"\bGPU-I:(?P<gi>[0-9a-fA-F]+)")
_GPU_CI = re.compile(r"\bGPU-CI:(?P<ci>[0-9a-fA-F]+)")
_PID = re.compile(r"\bpid=(?:'?<unknown>'?|(?P<pid>\d+))")
_NAME = re.compile(r"\bname=(?P<name><unknown>|[^,]+?)(?:,|$)")
_FELL_ONE_LINE = re.compile(r"NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>[0-9a-fA-F:.]+):?\s.*fallen off the bus")
_FELL_START = re.compile(r"NVRM: The NVIDIA GPU (?P<pci>[0-9a-fA-F:.]+)\s*(?P<rest>.*)$")
_FELL_END = re.compile(r"fallen off the bus")
# The driver could not initialise the GPU (after it fell off the bus, or a dead card): every open of
# the device then fails, and the server falls back to the CPU.
# Older drivers name no bus id ("NVRM: RmInitAdapter failed! (0x25:0x65:1211)"): such a line is
# taken as ours, since the driver could not even identify the GPU it failed on.
_ADAPTER = re.compile(r"NVRM: (?:GPU (?:at )?(?:PCI:)?(?P<pci>[0-9a-fA-F:.]+):?\s.*?)?"
                      r"(?:RmInitAdapter|rm_init_adapter) failed")


@dataclass(frozen=True)
class XidRecord:
    """One Xid (or fallen-off-the-bus) report from the kernel log.

    ``pci`` canonical (``0000:02:00.0``); ``xid`` None for the fallen-off-the-bus message without
    a number; ``pid``/``name`` of the faulting process when the driver names one; ``text`` the
    message (joined for the multi-line form).
    """

    pci: str
    xid: int | None
    pid: int | None
    name: str | None
    text: str
    fallen_off_bus: bool
    gpu_instance: int | None = None      # MIG: the ``GPU-I:`` attribute (hex)
    compute_instance: int | None = None  # MIG: the ``GPU-CI:`` attribute (hex)


@dataclass(frozen=True)
class AdapterInitFailed:
    """The driver could not initialise the GPU at ``pci`` (``RmInitAdapter failed!``; "" when neither
    the line nor the parser names one): no reset brings it back; ``text`` is the message."""

    pci: str
    text: str


@dataclass(frozen=True)
class UnparsedXid:
    """An ``NVRM: Xid`` line the parser could not read: ``text`` is the message as it came."""

    text: str


def strip_prefix(line: str) -> str:
    """The message text of a /dev/kmsg record or a dmesg line (prefixes removed, whitespace trimmed)."""
    line = line.rstrip("\r\n")
    return _DMESG_PREFIX.sub("", _KMSG_PREFIX.sub("", line, count=1), count=1).strip()


class KmsgParser:
    """Fed kernel-log lines one at a time; returns the :class:`XidRecord` s and
    :class:`AdapterInitFailed` s for ``pci_bus_id`` (and an :class:`UnparsedXid` for any ``NVRM: Xid``
    line it cannot read, whatever its GPU). The driver's second line about one adapter failure
    (``rm_init_adapter failed`` right after ``RmInitAdapter failed!``) is not reported again.

    ``pci_bus_id`` in any spelling; None keeps every GPU's records. Stateful only for the
    three-line fallen-off-the-bus message.
    """

    def __init__(self, pci_bus_id: str | None) -> None:
        self.pci = normalise_pci(pci_bus_id) if pci_bus_id else None
        self._pending: tuple[str, list[str]] | None = None  # (pci, lines) of a multi-line message
        self._adapter_pci: str | None = None  # the GPU of an adapter failure on the previous NVRM line

    def _ours(self, pci: str | None) -> bool:
        return pci is not None and (self.pci is None or pci == self.pci)

    def feed(self, line: str) -> list[XidRecord | AdapterInitFailed | UnparsedXid]:
        """Parse one line (kmsg record, dmesg line or bare text); kmsg continuation lines
        (starting with a space, e.g. `` SUBSYSTEM=pci``) are ignored."""
        if line.startswith(" ") and "=" in line and "NVRM" not in line:
            return []
        text = strip_prefix(line)
        if "NVRM:" not in text:
            return []
        adapter = _ADAPTER.search(text)
        previous, self._adapter_pci = self._adapter_pci, None
        if adapter is not None:
            pci = normalise_pci(adapter["pci"]) if adapter["pci"] else (self.pci or "")
            self._adapter_pci = pci
            if pci is None or pci == previous or (pci and not self._ours(pci)):
                return []
            return [AdapterInitFailed(pci, text)]
        out: list[XidRecord | AdapterInitFailed | UnparsedXid] = []
        if self._pending is not None:
            pending_pci, lines = self._pending
            lines.append(text)
            if _FELL_END.search(text):
                self._pending = None
                if self._ours(pending_pci):
                    out.append(XidRecord(pending_pci, None, None, None, " ".join(lines), True))
                return out
            if len(lines) < 4 and not text.startswith("NVRM: Xid") and "NVIDIA GPU" not in text:
                return out
            self._pending = None  # the message broke off: forget it, parse this line afresh
        match = _XID.search(text)
        if match:
            xid_pci = normalise_pci(match["pci"])
            if self._ours(xid_pci) and xid_pci is not None:
                rest = match["rest"]
                pid_m, name_m = _PID.search(rest), _NAME.search(rest)
                pid = int(pid_m["pid"]) if pid_m and pid_m["pid"] else None
                name = name_m["name"].strip() if name_m else None
                xid = int(match["xid"])
                attrs = match["attrs"] or ""
                gi, ci = _GPU_I.search(attrs), _GPU_CI.search(attrs)
                out.append(XidRecord(xid_pci, xid, pid, None if name == "<unknown>" else name, text,
                                     xid == 79 or "fallen off the bus" in rest,
                                     int(gi["gi"], 16) if gi else None, int(ci["ci"], 16) if ci else None))
            elif xid_pci is None:
                out.append(UnparsedXid(text))
            return out
        if "NVRM: Xid" in text:
            out.append(UnparsedXid(text))
            return out
        match = _FELL_ONE_LINE.search(text) or _FELL_START.search(text)
        if match:
            pci = normalise_pci(match["pci"])
            if pci is None:
                return out
            if _FELL_END.search(text):
                if self._ours(pci):
                    out.append(XidRecord(pci, None, None, None, text, True))
            elif match.re is _FELL_START:
                self._pending = (pci, [text])
        return out


@dataclass(frozen=True)
class KmsgOff:
    """The kernel log cannot be read; ``message`` is what the daemon reports, once."""

    reason: str

    @property
    def message(self) -> str:
        """``kernel log off: <reason>``."""
        return f"kernel log off (Xids from NVML only): {self.reason}"


class KmsgReader:
    """New records of ``/dev/kmsg`` (or any file or pipe): opened non-blocking, positioned at the
    end so only records written after the start are read. Use :func:`open_kmsg` to make one."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._partial = b""

    def poll(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` seconds for new records; returns them (possibly none).

        /dev/kmsg yields one record per read; ``EPIPE`` (records overwritten before we read them)
        is skipped; a regular file or pipe may yield several lines per read.
        """
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout_s))
        if not ready:
            return []
        lines: list[str] = []
        while True:
            try:
                chunk = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue
                raise
            if not chunk:
                break
            data = self._partial + chunk
            *complete, self._partial = data.split(b"\n")
            lines += [c.decode("utf-8", "replace") for c in complete]
        return lines

    def close(self) -> None:
        """Close the file; never raises."""
        with contextlib.suppress(OSError):
            os.close(self._fd)


def open_kmsg(path: str = "/dev/kmsg") -> KmsgReader | KmsgOff:
    """A :class:`KmsgReader` at the end of ``path``, or :class:`KmsgOff` saying why it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        hint = " (needs CAP_SYSLOG or root)" if exc.errno in (errno.EACCES, errno.EPERM) else ""
        return KmsgOff(f"{path}: {exc.strerror}{hint}")
    with contextlib.suppress(OSError):  # a pipe has nothing old to skip
        os.lseek(fd, 0, os.SEEK_END)
    return KmsgReader(fd)
