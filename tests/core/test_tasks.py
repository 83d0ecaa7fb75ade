"""The daemon's task set at shutdown: a task started with ``finish`` ends on its own, the others are
cancelled; each wait is bounded."""

from __future__ import annotations

import asyncio
import time

from llama_guard.core.tasks import TaskSet


def task_set() -> TaskSet:
    return TaskSet(lambda *a, **k: None, lambda reason: None, time.monotonic)


async def test_cancel_all_lets_a_finishing_task_end_and_cancels_the_rest() -> None:
    tasks = task_set()
    closed: list[str] = []

    async def end_of_a_server() -> None:
        await asyncio.sleep(0.05)  # closing what it holds
        closed.append("end")

    ending = tasks.start(end_of_a_server(), "end of a server", finish=True)
    forever = tasks.start(asyncio.sleep(3600), "a watch")
    await tasks.cancel_all(5.0)
    assert closed == ["end"] and not ending.cancelled()
    assert forever.cancelled()
    assert not tasks.tasks


async def test_a_finishing_task_that_does_not_end_is_cancelled_after_the_timeout() -> None:
    tasks = task_set()
    stuck = tasks.start(asyncio.sleep(3600), "end of a server", finish=True)
    await tasks.cancel_all(0.2)  # returns (the task sleeps an hour): the timeout, then the cancel
    assert stuck.cancelled()
