"""Blocking calls off the event loop: one bounded lane per kind of call, each call with a deadline.

``asyncio.to_thread`` shares one default executor: a few calls stuck for good (``open()`` of a
model on a hung network filesystem, a FIFO, a wedged NVML or ``/proc`` read) take its threads and
every later call waits behind them. A :class:`Lane` instead runs each call on a thread of its own
(daemon threads: a stuck one never holds up the interpreter's exit), at most ``max_calls`` at a
time; a call that does not finish within its timeout raises :class:`CallTimeout` to the awaiting
coroutine (the thread stays stuck, still counted), and once every slot is taken by stuck calls new
calls fail at once with :class:`LaneBusy` instead of queueing. Nothing on one lane can delay
another lane or the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class CallTimeout(TimeoutError):
    """A call on a lane did not return within its timeout (seconds in :attr:`timeout_s`)."""

    def __init__(self, lane: str, what: str, timeout_s: float) -> None:
        super().__init__(f"{what} did not return within {timeout_s:g} s ({lane} lane)")
        self.lane = lane
        self.what = what
        self.timeout_s = timeout_s


class LaneBusy(RuntimeError):
    """Every slot of a lane is held by calls that have not returned (stuck): refused at once."""


class Lane:
    """At most ``max_calls`` concurrent blocking calls named ``name``; see the module docstring.

    :attr:`in_flight` counts calls whose thread has not returned yet (stuck ones included).
    """

    def __init__(self, name: str, max_calls: int = 2) -> None:
        self.name = name
        self.max_calls = max_calls
        self.in_flight = 0
        self._lock = threading.Lock()

    async def run(self, fn: Callable[[], T], timeout_s: float, what: str = "") -> T:
        """``fn()`` on a thread of this lane; its result or its exception.

        Raises :class:`CallTimeout` after ``timeout_s`` seconds, :class:`LaneBusy` when every slot
        is taken. Cancelling the awaiting task abandons the call (its thread runs on, counted).
        """
        what = what or getattr(fn, "__name__", "call")
        with self._lock:
            if self.in_flight >= self.max_calls:
                raise LaneBusy(f"{what}: {self.in_flight} earlier {self.name} calls have not returned")
            self.in_flight += 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def deliver(ok: bool, value: object) -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)  # type: ignore[arg-type]
            else:
                assert isinstance(value, BaseException)
                future.set_exception(value)

        def work() -> None:
            try:
                result: object = fn()
                ok = True
            except BaseException as exc:  # handed to the awaiting coroutine
                result, ok = exc, False
            finally:
                with self._lock:
                    self.in_flight -= 1
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(deliver, ok, result)

        threading.Thread(target=work, name=f"lane-{self.name}", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            raise CallTimeout(self.name, what, timeout_s) from None


def run_with_deadline(fn: Callable[[], T], timeout_s: float, what: str = "") -> T:
    """``fn()`` on a daemon thread, for synchronous callers (``llama-guard check``): its result or
    exception; :class:`CallTimeout` when it has not returned after ``timeout_s`` seconds."""
    box: list[tuple[bool, object]] = []
    done = threading.Event()

    def work() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:
            box.append((False, exc))
        done.set()

    threading.Thread(target=work, name="deadline-call", daemon=True).start()
    if not done.wait(timeout_s):
        raise CallTimeout("sync", what or getattr(fn, "__name__", "call"), timeout_s)
    ok, value = box[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]
