"""Blocking calls off the caller: one bounded lane per kind of call, each call with a deadline.

``asyncio.to_thread`` shares one default executor: a few calls stuck for good (``open()`` of a
model on a hung network filesystem, a FIFO, a wedged NVML or ``/proc`` read) take its threads and
every later call waits behind them. A :class:`Lane` instead runs each call on a worker thread of
its own (daemon threads: a stuck one never holds up the interpreter's exit; an idle worker is
reused for the next call), at most ``max_calls`` at a time. A call that does not finish within its
timeout raises :class:`CallTimeout` to the waiting caller (the thread stays stuck, still counted,
and :attr:`Lane.stuck` names it), and once every slot is taken by unfinished calls new calls fail
at once with :class:`LaneBusy` instead of queueing. Nothing on one lane can delay another lane or
the event loop.

Callers wait either on the event loop (:meth:`Lane.run`) or on their own thread
(:meth:`Lane.run_sync`: ``llama-guard check``, the NVML wrapper's calls). This is the one policy
for every blocking call of the daemon: nothing calls ``asyncio.to_thread`` (its shared executor has
neither a bound nor a deadline). A lane is named by its :class:`LaneKind`, which also gives its
default number of slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LaneKind(enum.Enum):
    """What the calls of a lane do (each owner holds one lane per kind it uses)."""

    CONFIG = "config"  # the config file, the model file's head, the API key file: a hung mount, a FIFO
    PROBE = "probe"  # running the llama-server binary (--help, --version)
    PROC = "proc"  # /proc walks (psutil): CPU time, RSS, port and pipe holders, our own limits
    NVML_CALL = "nvml-call"  # one NVML call (gpu/nvml_session.py)
    NVML_EVENT_WAIT = "nvml-event-wait"  # NVML's blocking Xid event wait
    GPU = "gpu"  # the GPU watcher's steps made of NVML calls (each NVML call bounded on its own lane)
    VRAM_NEED = "vram-need"  # measuring the model's VRAM need (a child process)
    VRAM_NEED_KEY = "vram-need-key"  # the model file's identity for the need cache (stat, metadata)
    SCRAPE = "scrape"  # rendering /metrics for one scrape
    CHECK = "check"  # ``llama-guard check``'s own calls (:func:`run_with_deadline`)
    SLOT_FILES = "slot-files"  # the slot store's files: hashing, checking, committing, pruning (slots/)
    TRIAL = "trial"  # a build's trial: completions that measure its decode speed (upgrade/)


MAX_CALLS = {LaneKind.CONFIG: 2, LaneKind.PROBE: 1, LaneKind.PROC: 2, LaneKind.NVML_CALL: 1,
             LaneKind.NVML_EVENT_WAIT: 1, LaneKind.GPU: 8, LaneKind.VRAM_NEED: 2, LaneKind.VRAM_NEED_KEY: 4,
             LaneKind.SCRAPE: 2, LaneKind.CHECK: 1, LaneKind.SLOT_FILES: 1,
             LaneKind.TRIAL: 1}
"""Each kind's slots: calls of that kind that may be unfinished at once (stuck ones included)."""
PROC_TIMEOUT_S = 5.0  # the deadline of one /proc walk on a PROC lane (seconds)


class CallTimeout(TimeoutError):
    """A call on a lane did not return within its timeout (seconds in :attr:`timeout_s`)."""

    def __init__(self, lane: LaneKind, what: str, timeout_s: float) -> None:
        super().__init__(f"{what} did not return within {timeout_s:g} s ({lane.value} lane)")
        self.lane = lane
        self.what = what
        self.timeout_s = timeout_s


class LaneBusy(RuntimeError):
    """Every slot of a lane is held by calls that have not returned: refused at once."""


class _Call(Generic[T]):
    """One call handed to a worker: its function, when it started (monotonic s), its outcome."""

    def __init__(self, fn: Callable[[], T], what: str) -> None:
        self.fn = fn
        self.what = what
        self.started = time.monotonic()
        self.done = threading.Event()
        self.ok = False
        self.value: object = None
        self.on_done: Callable[[], None] | None = None  # set before submit; runs on the worker

    def outcome(self) -> T:
        if not self.ok:
            assert isinstance(self.value, BaseException)
            raise self.value
        return self.value  # type: ignore[return-value]


class Lane:
    """At most ``max_calls`` (default: :data:`MAX_CALLS` of ``kind``) concurrent blocking calls of
    ``kind``; see the module docstring.

    :attr:`in_flight` counts calls whose thread has not returned yet (stuck ones included).
    """

    def __init__(self, kind: LaneKind, max_calls: int | None = None, idle_s: float = 30.0) -> None:
        self.kind = kind
        self.max_calls = MAX_CALLS[kind] if max_calls is None else max_calls
        self.idle_s = idle_s
        """How long an idle worker waits for the next call before its thread ends (seconds)."""
        self.in_flight = 0
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_Call[object]]] = []
        self._stuck: dict[int, _Call[object]] = {}

    @property
    def stuck(self) -> tuple[str, float] | None:
        """``(what, monotonic start)`` of the oldest call past its deadline that has not returned."""
        with self._lock:
            calls = sorted(self._stuck.values(), key=lambda c: c.started)
        return None if not calls else (calls[0].what, calls[0].started)

    def _submit(self, call: _Call[T]) -> None:
        with self._lock:
            if self.in_flight >= self.max_calls:
                raise LaneBusy(f"{call.what}: {self.in_flight} earlier {self.kind.value} calls have not returned")
            self.in_flight += 1
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._worker, args=(inbox,), name=f"lane-{self.kind.value}", daemon=True).start()
        inbox.put(call)  # type: ignore[arg-type]

    def _worker(self, inbox: queue.SimpleQueue[_Call[object]]) -> None:
        call = inbox.get()  # started for a call: it is on its way
        while True:
            try:
                call.value, call.ok = call.fn(), True
            except BaseException as exc:  # handed to the waiting caller
                call.value, call.ok = exc, False
            with self._lock:
                self.in_flight -= 1
                self._stuck.pop(id(call), None)
                self._idle.append(inbox)
            call.done.set()
            if call.on_done is not None:
                call.on_done()
            while True:
                try:
                    call = inbox.get(timeout=self.idle_s)
                    break
                except queue.Empty:
                    with self._lock:
                        if inbox in self._idle:  # else a call was just handed over: take it
                            self._idle.remove(inbox)
                            return

    def _timed_out(self, call: _Call[T], timeout_s: float) -> CallTimeout:
        with self._lock:
            if not call.done.is_set():
                self._stuck[id(call)] = call  # type: ignore[assignment]
        return CallTimeout(self.kind, call.what, timeout_s)

    def run_sync(self, fn: Callable[[], T], timeout_s: float, what: str = "") -> T:
        """``fn()`` on a worker of this lane, waited for on the calling thread: its result or its
        exception. Raises :class:`CallTimeout` after ``timeout_s`` seconds, :class:`LaneBusy` when
        every slot is taken."""
        call: _Call[T] = _Call(fn, what or getattr(fn, "__name__", "call"))
        self._submit(call)
        if not call.done.wait(timeout_s):
            raise self._timed_out(call, timeout_s)
        return call.outcome()

    async def run(self, fn: Callable[[], T], timeout_s: float, what: str = "") -> T:
        """``fn()`` on a worker of this lane, awaited on the event loop: its result or its exception.

        Raises :class:`CallTimeout` after ``timeout_s`` seconds, :class:`LaneBusy` when every slot
        is taken. Cancelling the awaiting task abandons the call (its thread runs on, counted).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def resolve() -> None:
            if not future.done():
                future.set_result(None)

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(resolve)

        call: _Call[T] = _Call(fn, what or getattr(fn, "__name__", "call"))
        call.on_done = wake
        self._submit(call)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            raise self._timed_out(call, timeout_s) from None
        return call.outcome()


def run_with_deadline(fn: Callable[[], T], timeout_s: float, what: str = "") -> T:
    """``fn()`` on a fresh one-call :class:`Lane`, for synchronous callers (``llama-guard check``):
    its result or exception; :class:`CallTimeout` when it has not returned after ``timeout_s``."""
    return Lane(LaneKind.CHECK, idle_s=0.0).run_sync(fn, timeout_s, what)


def daemon_lanes() -> dict[LaneKind, Lane]:
    """The daemon's own lanes (the watchers hold theirs): config files, binary probes, /proc walks."""
    return {kind: Lane(kind) for kind in (LaneKind.CONFIG, LaneKind.PROBE, LaneKind.PROC)}
