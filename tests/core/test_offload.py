"""The one runner of blocking calls with a deadline (core/offload.py), waited for on the event loop
or on a thread: results, exceptions, timeouts, stuck calls, a full lane, worker reuse."""

from __future__ import annotations

import threading
import time

import pytest
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy, LaneKind, run_with_deadline


def _boom() -> int:
    raise ValueError("bad")


def test_sync_result_and_exception() -> None:
    lane = Lane(LaneKind.CONFIG, max_calls=1)
    assert lane.run_sync(lambda: 41 + 1, 5.0) == 42
    with pytest.raises(ValueError, match="bad"):
        lane.run_sync(_boom, 5.0)
    assert lane.in_flight == 0 and lane.stuck is None
    assert run_with_deadline(lambda: "ok", 5.0) == "ok"


async def test_async_result_and_exception() -> None:
    lane = Lane(LaneKind.CONFIG, max_calls=2)
    assert await lane.run(lambda: 7, 5.0) == 7
    with pytest.raises(ValueError, match="bad"):
        await lane.run(_boom, 5.0)
    assert lane.in_flight == 0


def test_a_stuck_call_times_out_holds_its_slot_and_is_named() -> None:
    lane = Lane(LaneKind.CONFIG, max_calls=1)
    release = threading.Event()
    with pytest.raises(CallTimeout) as timed_out:
        lane.run_sync(release.wait, 0.05, "open model")
    assert timed_out.value.what == "open model" and timed_out.value.lane is LaneKind.CONFIG
    stuck = lane.stuck
    assert stuck is not None and stuck[0] == "open model"
    with pytest.raises(LaneBusy):  # refused at once, not queued behind the stuck call
        lane.run_sync(lambda: 1, 5.0)
    release.set()
    deadline = time.monotonic() + 10
    while lane.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lane.in_flight == 0 and lane.stuck is None
    assert lane.run_sync(lambda: 2, 5.0) == 2


async def test_async_timeout_leaves_the_loop_free() -> None:
    lane = Lane(LaneKind.CONFIG, max_calls=1)
    release = threading.Event()
    with pytest.raises(CallTimeout):
        await lane.run(release.wait, 0.05, "fifo")
    assert lane.stuck is not None
    release.set()


def test_an_idle_worker_is_reused_then_ends() -> None:
    lane = Lane(LaneKind.SCRAPE, max_calls=1, idle_s=0.5)
    workers = {lane.run_sync(threading.current_thread, 5.0) for _ in range(20)}
    assert len(workers) == 1  # one worker thread served every call
    worker = workers.pop()
    worker.join(10)  # idle for idle_s: it ends
    assert not worker.is_alive()
