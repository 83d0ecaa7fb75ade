"""The daemon's tracked asyncio tasks: every task it starts is kept until done, and a failure in
one is reported and ends the daemon; a watcher that raises is restarted with backoff.

Used by the loop (:mod:`.daemon`), the per-server tasks (:mod:`.server`) and the watchers' runs; it
knows nothing of the policy. A failure is reported as ``watcher_failed`` and handed to ``on_fatal``
(the loop then exits with status 70, EXIT_SOFTWARE, and systemd restarts it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from llama_guard.model.watcher import Context, Watcher

WATCHER_MAX_FAILURES = 5  # a watcher failing more often than this within WATCHER_WINDOW_S ends the daemon
WATCHER_WINDOW_S = 300.0
WATCHER_BACKOFF_S = 1.0  # the first restart of a failed watcher; doubled per failure, at most 30 s
WATCHER_BACKOFF_MAX_S = 30.0


def backoff_s(failures: int, first_s: float) -> float:
    """The delay (seconds) before restarting something that has now failed ``failures`` times (1:
    the first failure): ``first_s`` doubled per failure, at most WATCHER_BACKOFF_MAX_S. The one
    backoff of the daemon's watchers and their threads."""
    return min(first_s * 2.0 ** (failures - 1), WATCHER_BACKOFF_MAX_S)


def summary(exc: BaseException | None) -> str:
    """``ValueError: bad thing`` (one line) for events."""
    if exc is None:
        return "?"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class TaskSet:
    """Tasks that are tracked (dropped from the set when done: nothing accumulates) and supervised.

    ``emit`` reports (``watcher_failed``); ``on_fatal(reason)`` is called once per failure that must
    end the daemon; ``clock`` is monotonic seconds (the watcher failure window).
    """

    def __init__(self, emit: Callable[..., None], on_fatal: Callable[[str], None],
                 clock: Callable[[], float]) -> None:
        self._emit = emit
        self._on_fatal = on_fatal
        self._clock = clock
        self.tasks: set[asyncio.Task[Any]] = set()
        self._finishing: set[asyncio.Task[Any]] = set()  # let end on their own by cancel_all

    def start(self, coro: Awaitable[Any], name: str, *, core: bool = True, finish: bool = False) -> asyncio.Task[Any]:
        """A tracked task running ``coro``. ``core``: an exception in it is a failure of the daemon
        itself (``watcher_failed`` with ``watcher=core.<name>``, then ``on_fatal``). ``finish``:
        :meth:`cancel_all` lets it end on its own, within its timeout, before it cancels it (the end
        of a server closes what that server held)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        if finish:
            self._finishing.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self.tasks.discard(t)
            self._finishing.discard(t)
            if core and not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                self._emit("watcher_failed", watcher=f"core.{name}", error=summary(exc), failures=1,
                           window_s=0.0, action="a failure in the daemon's core: exiting with status 70")
                self._on_fatal(f"internal error in {name}: {summary(exc)}")

        task.add_done_callback(done)
        return task

    async def supervise(self, watcher: Watcher, ctx: Context) -> None:
        """Run ``watcher.run`` and restart it with backoff when it raises (``watcher_failed``); more
        than WATCHER_MAX_FAILURES failures within WATCHER_WINDOW_S end the daemon."""
        failures: list[float] = []
        while True:
            try:
                await watcher.run(ctx)
                return
            except Exception as exc:
                now = self._clock()
                failures = [t for t in failures if now - t < WATCHER_WINDOW_S] + [now]
                final = len(failures) > WATCHER_MAX_FAILURES
                delay = backoff_s(len(failures), WATCHER_BACKOFF_S)
                self._emit("watcher_failed", watcher=watcher.name, error=summary(exc), failures=len(failures),
                           window_s=WATCHER_WINDOW_S,
                           action=("it keeps failing: exiting with status 70" if final
                                   else f"restarting it in {delay:.0f} s"))
                if final:
                    self._on_fatal(f"watcher {watcher.name} keeps failing: {summary(exc)}")
                    return
                await asyncio.sleep(delay)

    async def cancel_all(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the tasks started with ``finish`` to end, then cancel
        every task still running but the caller's and wait up to ``timeout_s`` seconds for them."""
        finishing = [t for t in self._finishing if t is not asyncio.current_task()]
        if finishing:
            await asyncio.wait(finishing, timeout=timeout_s)
        tasks = [t for t in self.tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
