"""The front door's holding rules, in process: every held request ends in exactly one outcome that the
episode's counts add up to, hold times run from each request's arrival, a planned drain holds the
deadlines, a pending exit refuses held requests at once."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from llama_guard.front.admission import Admission, Episode, FailReason, Refused
from llama_guard.model.types import AfterStop, Params, Phase, State

READY = State(params=Params(), phase=Phase.READY, pid=42, ready_at=0.0)


def admission_with(episodes: list[Episode], phase: Phase = Phase.BACKOFF) -> Admission:
    admission = Admission(time.monotonic, episodes.append)
    admission.update(replace(READY, phase=phase))
    return admission


async def until(predicate: object, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


async def test_every_held_request_ends_in_one_outcome_and_the_counts_add_up() -> None:
    episodes: list[Episode] = []
    admission = admission_with(episodes)
    now = time.monotonic()
    arrived_long_ago = now - 30.0  # a replay: held from its first arrival, 30 s ago

    def hold(seq: int, hold_s: float = 60.0, *, arrived: float = now, replay: bool = False,
             max_held: int = 5) -> asyncio.Task[tuple[int, float]]:
        return asyncio.create_task(admission.admit(seq, arrived=arrived, since=time.monotonic(), hold_s=hold_s,
                                                   max_held=max_held, replay=replay))

    forwarded = [hold(1), hold(2)]
    replayed = hold(3, arrived=arrived_long_ago, replay=True)
    timed_out = hold(4, hold_s=2.0)  # still held when the queue is seen full, however slow the loop's first steps
    gone = hold(5)
    await until(lambda: admission.waiting == 5, "5 held")
    with pytest.raises(Refused) as full:
        await hold(6)
    assert full.value.reason is FailReason.QUEUE_FULL
    with pytest.raises(Refused) as late:
        await timed_out
    assert late.value.reason is FailReason.HOLD_TIMEOUT
    gone.cancel()  # the client left
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert admission.waiting == 3 and not episodes
    admission.update(READY)
    results = await asyncio.gather(*forwarded, replayed)
    assert [pid for pid, _ in results] == [42, 42, 42]
    assert results[2][1] >= 30.0  # the replay's hold time runs from its first arrival
    [episode] = episodes
    assert (episode.held, episode.forwarded, episode.replayed, episode.failed, episode.gone, episode.refused) == \
        (5, 2, 1, 1, 1, 1)
    assert episode.held == episode.forwarded + episode.replayed + episode.failed + episode.gone
    assert episode.longest_s >= 30.0


async def test_clients_that_leave_are_counted_gone_with_their_hold_time() -> None:
    episodes: list[Episode] = []
    admission = admission_with(episodes, Phase.STARTING)
    arrived = time.monotonic() - 2.0
    waiters = [asyncio.create_task(admission.admit(i, arrived=arrived, since=arrived, hold_s=60.0, max_held=9))
               for i in range(3)]
    await until(lambda: admission.waiting == 3, "3 held")
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    admission.update(READY)
    [episode] = episodes
    assert (episode.held, episode.gone, episode.forwarded, episode.failed) == (3, 3, 0, 0)
    assert episode.longest_s >= 2.0


async def test_a_planned_drain_holds_the_deadline_then_the_restart_gets_the_whole_hold_timeout() -> None:
    episodes: list[Episode] = []
    admission = admission_with(episodes, Phase.DRAINING)
    hold_s = 0.3
    start = time.monotonic()
    waiter = asyncio.create_task(admission.admit(1, arrived=start, since=start, hold_s=hold_s, max_held=9))
    done, _ = await asyncio.wait({waiter}, timeout=3 * hold_s)  # the drain outlasts hold_timeout_s
    assert not done and admission.waiting == 1
    drain_end = time.monotonic()
    admission.update(replace(READY, phase=Phase.STOPPING, after_stop=AfterStop.RESTART))
    with pytest.raises(Refused) as late:  # the next server never comes: timed out hold_s after the drain
        await waiter
    assert late.value.reason is FailReason.HOLD_TIMEOUT
    assert time.monotonic() - drain_end >= hold_s
    admission.update(READY)
    assert episodes[0].failed == 1 and "draining" in episodes[0].phases


async def test_a_request_held_through_a_drain_goes_to_the_next_server() -> None:
    episodes: list[Episode] = []
    admission = admission_with(episodes, Phase.DRAINING)
    start = time.monotonic()
    waiter = asyncio.create_task(admission.admit(1, arrived=start, since=start, hold_s=0.1, max_held=9))
    done, _ = await asyncio.wait({waiter}, timeout=0.5)
    assert not done
    for phase in (Phase.STOPPING, Phase.STARTING):
        admission.update(replace(READY, phase=phase, after_stop=AfterStop.RESTART))
    admission.update(replace(READY, pid=43))
    pid, held_s = await waiter
    assert pid == 43 and held_s >= 0.5
    assert (episodes[0].held, episodes[0].forwarded) == (1, 1)


@pytest.mark.parametrize("phase", [Phase.RESETTING, Phase.DRAINING, Phase.STOPPING])
async def test_a_pending_exit_refuses_held_and_new_requests_at_once(phase: Phase) -> None:
    episodes: list[Episode] = []
    admission = admission_with(episodes, phase)
    now = time.monotonic()
    waiter = asyncio.create_task(admission.admit(1, arrived=now, since=now, hold_s=600.0, max_held=9))
    await until(lambda: admission.waiting == 1, "held")
    admission.update(replace(READY, phase=phase, pid=None, after_stop=AfterStop.EXIT))  # SIGTERM meanwhile
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(waiter, 5.0)
    assert refused.value.reason is FailReason.DAEMON_EXITING
    with pytest.raises(Refused):
        await admission.admit(2, arrived=now, since=now, hold_s=600.0, max_held=9)
    assert episodes[0].failed == 1


async def test_a_hold_that_times_out_while_the_gpu_is_lent_to_tune_says_when_to_come_back() -> None:
    """A hold past ``hold_timeout_s`` while the window lent to tune lasts: 503 naming the window, its
    ``Retry-After`` the window's time left (not the default 5 s); any other hold timeout keeps the default."""
    from llama_guard.model.types import Lend

    clock = [100.0]
    admission = Admission(lambda: clock[0], lambda e: None)
    admission.update(replace(READY, phase=Phase.LENT, pid=None, lend=Lend(7, 600.0, until=412.3)))
    timed_out = asyncio.create_task(admission.admit(1, arrived=100.0, since=100.0, hold_s=0.01, max_held=5))
    with pytest.raises(Refused) as lent:
        await timed_out
    assert lent.value.status == 503 and lent.value.retry_after_s == 313
    assert "lent to llama-guard tune" in lent.value.message
    admission.update(replace(READY, phase=Phase.STARTING, pid=None))
    with pytest.raises(Refused) as plain:
        await admission.admit(2, arrived=100.0, since=100.0, hold_s=0.01, max_held=5)
    assert plain.value.retry_after_s is None  # the front door's default Retry-After then
