"""The GPU's Xid intake: NVML's Xid events (a waiter thread) and the kernel log's Xid records (a
reader thread), matched (:class:`~llama_guard.gpu.xid.XidMatcher`) and posted to the policy as
:class:`~llama_guard.model.inputs.GpuFault` with their table row; the policy judges whose they are.

Both threads block in calls that have no asyncio form (``nvmlEventSetWait``, ``poll`` on
``/dev/kmsg``); what they see comes back to the loop through ``call_soon_threadsafe``. The kernel-log
reader is restarted with the daemon's watcher backoff (:func:`llama_guard.core.tasks.backoff_s`)
when it raises, each failure reported (``watcher_failed``, watcher ``gpu.kmsg``); after
:data:`KMSG_MAX_FAILURES` it gives up and :attr:`XidIntake.error` says why (the GPU watcher's task
then raises, supervised). While a GPU reset runs, the Xid waiter drops its NVML event set
(:meth:`XidIntake.halt`), since our NVML session must stay released.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

from llama_guard.core.tasks import backoff_s
from llama_guard.gpu import GpuIdentity, Nvml, NvmlError
from llama_guard.gpu.kmsg import AdapterInitFailed, KmsgOff, KmsgParser, UnparsedXid, XidRecord, open_kmsg
from llama_guard.gpu.xid import XidMatcher, XidReport, recovery_action_of, run_xid_waiter, xid_info
from llama_guard.model.inputs import GpuFault
from llama_guard.model.types import GpuFaultKind, RecoveryAction, XidAction
from llama_guard.model.watcher import Context

XID_MATCH_S = 2.0  # how long an application Xid from NVML waits for its kernel-log line (the pid)
KMSG_MAX_FAILURES = 5  # kernel-log reader failures (each restarted with backoff) before giving up
HALT_WAIT_S = 5.0  # how long a halt waits for the Xid waiter to drop its event set (it blocks ~1 s in NVML)


class XidIntake:
    """The Xid threads of one watched GPU (``nvml``, ``identity``); ``kmsg_backoff_s``: the first
    restart delay of a failed kernel-log reader (seconds)."""

    def __init__(self, nvml: Nvml, identity: GpuIdentity, kmsg_backoff_s: float) -> None:
        self._nvml = nvml
        self._index = identity.index
        self._pci_bus_id = identity.pci_bus_id
        self._kmsg_backoff_s = kmsg_backoff_s
        self.error = ""
        """Why the kernel-log reader gave up for good, else empty."""
        self.matcher = XidMatcher(window_s=XID_MATCH_S, kmsg_on=False)
        self._nvml_recovery: RecoveryAction | None = None  # the field as read with NVML's latest Xid 154
        self._stop = threading.Event()
        self._halt = threading.Event()
        self._idle = threading.Event()  # set while the Xid waiter holds no NVML event set
        self._idle.set()
        self.threads: list[threading.Thread] = []

    def start(self, ctx: Context) -> None:
        """Start the Xid waiter and, when the kernel log can be read (``[gpu].kmsg_path``), its
        reader (else ``gpu_kmsg_off``: NVML's events alone, without the faulting pid)."""
        reader = open_kmsg(ctx.config.gpu.kmsg_path)
        self.matcher = XidMatcher(window_s=XID_MATCH_S, kmsg_on=not isinstance(reader, KmsgOff))
        if isinstance(reader, KmsgOff):
            ctx.emit("gpu_kmsg_off", reason=reader.message)
        else:
            parser = KmsgParser(self._pci_bus_id)

            def kmsg_loop() -> None:
                while not self._stop.is_set():
                    for line in reader.poll(1.0):
                        for rec in parser.feed(line):
                            ctx.loop.call_soon_threadsafe(self._on_kmsg_record, ctx, rec)

            self.threads.append(threading.Thread(target=self._kmsg_thread, args=(ctx, kmsg_loop), name="kmsg",
                                                 daemon=True))
        self.threads.append(threading.Thread(target=self._xid_thread, args=(ctx,), name="xid-waiter", daemon=True))
        for thread in self.threads:
            thread.start()

    def _xid_thread(self, ctx: Context) -> None:
        """NVML's Xid events until stopped; idle (no event set) while a reset halts it."""
        nvml = self._nvml

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

        while not self._stop.is_set():
            self._idle.clear()
            try:
                reason = run_xid_waiter(nvml, self._halt, on_xid, on_error=on_error)
            except Exception as exc:  # a thread that dies says so instead of going silent
                reason = f"the Xid waiter failed: {exc!r}"
            finally:
                self._idle.set()  # its event set is freed
            if reason is not None:
                ctx.loop.call_soon_threadsafe(
                    functools.partial(ctx.emit, "gpu_watch_off", reason=reason, gpu_index=self._index))
                return
            while self._halt.is_set() and not self._stop.is_set():  # a reset runs
                self._stop.wait(0.1)

    def _kmsg_thread(self, ctx: Context, kmsg_loop: Callable[[], None]) -> None:
        """The kernel-log reader ``kmsg_loop``, restarted with backoff when it raises
        (``watcher_failed``); after KMSG_MAX_FAILURES :attr:`error` is set and it gives up."""
        failures = 0
        while not self._stop.is_set():
            try:
                kmsg_loop()
                return
            except Exception as exc:
                failures += 1
                final = failures >= KMSG_MAX_FAILURES
                delay = backoff_s(failures, self._kmsg_backoff_s)
                action = "giving up on the kernel log" if final else f"restarting it in {delay:.1f} s"
                ctx.loop.call_soon_threadsafe(functools.partial(
                    ctx.emit, "watcher_failed", watcher="gpu.kmsg", error=f"{type(exc).__name__}: {exc}",
                    failures=failures, window_s=0.0, action=action))
                if final:
                    self.error = f"the kernel-log reader failed {failures} times: {exc!r}"
                    return
                self._stop.wait(delay)

    def halt(self) -> None:
        """Make the Xid waiter drop its NVML event set (before our NVML session is released for a
        reset); blocks up to HALT_WAIT_S seconds: run it in a worker thread."""
        self._halt.set()
        self._idle.wait(HALT_WAIT_S)

    def resume(self) -> None:
        """The reset is over: the Xid waiter registers again (unless stopping)."""
        if not self._stop.is_set():
            self._halt.clear()

    def stop(self) -> None:
        """Ask both threads to end (they see it within ~1 s; join :attr:`threads`)."""
        self._stop.set()
        self._halt.set()

    # ------------------------------------------------------------ on the loop

    def _on_nvml_xid(self, ctx: Context, xid: int, recovery: RecoveryAction | None = None) -> None:
        if recovery is not None:
            self._nvml_recovery = recovery
        self._post(ctx, self.matcher.nvml(xid, ctx.clock()))
        due = self.matcher.next_due()
        if due is not None:  # an application Xid waits (bounded) for its kernel line
            ctx.loop.call_later(max(0.0, due - ctx.clock()) + 0.01, self._flush, ctx)

    def _on_kmsg_record(self, ctx: Context, record: XidRecord | AdapterInitFailed | UnparsedXid) -> None:
        if isinstance(record, UnparsedXid):
            ctx.emit("gpu_xid_unparsed", gpu_index=self._index, line=record.text)
            return
        if isinstance(record, AdapterInitFailed):
            ctx.post(GpuFault(GpuFaultKind.GPU_LOST, f"the driver cannot initialise GPU {record.pci} (RmInitAdapter "
                              "failed)", XidAction.REBOOT, gpu_index=self._index, line=record.text))
            return
        self._post(ctx, self.matcher.kmsg(record, ctx.clock()))

    def _flush(self, ctx: Context) -> None:
        self._post(ctx, self.matcher.due(ctx.clock()))

    def _post(self, ctx: Context, reports: list[XidReport]) -> None:
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
                              info.scope, rep.pid, rep.name, rep.origin, self._index, rep.text,
                              recovery=recovery, watchdog=info.watchdog, kv_readable=info.kv_readable))
