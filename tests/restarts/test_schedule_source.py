"""The planned-restart source with an injected wall clock, a scripted policy and scripted samples."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from llama_guard.config import Config
from llama_guard.config.sections import ScheduleConfig
from llama_guard.gpu.readings import GpuIdentity, GpuProcess, GpuSample
from llama_guard.model.actions import NotifyReady
from llama_guard.model.inputs import (
    Drained,
    Exited,
    HealthOk,
    Input,
    ParamsChanged,
    Probe,
    RestartRequest,
    Spawned,
    SpeedMeasured,
    Tick,
)
from llama_guard.model.policy import decide
from llama_guard.model.transition import Transition
from llama_guard.model.types import AfterStop, RestartCause, State
from llama_guard.model.watcher import Context
from llama_guard.restarts.watcher import ScheduleSource
from llama_guard.vocab.phases import Phase

UTC = timezone.utc
T0 = datetime(2025, 3, 10, 4, 29, 50, tzinfo=UTC)  # ten seconds before "30 4 * * *"


def metrics(tokens: float, seconds: float) -> str:
    return (f"llamacpp:tokens_predicted_total {tokens}\n"
            f"llamacpp:tokens_predicted_seconds_total {seconds}\n")


class Rig:
    """A ScheduleSource with a fake daemon around it: clocks, policy state, emitted and posted."""

    def __init__(self, server: dict[str, Any] | None = None, front: dict[str, Any] | None = None,
                 **schedule: Any) -> None:
        keys: dict[str, Any] = {"restart_cron": "30 4 * * *", "timezone": "UTC", "min_uptime_s": 0.0}
        keys.update(schedule)
        self.config = Config.model_validate({"schedule": keys, "server": server or {}, "front": front or {}})
        self.wall = T0
        self.mono = 1000.0
        self._state = State(phase=Phase.STOPPED)
        self.emitted: list[tuple[str, dict[str, Any]]] = []
        self.posted: list[Any] = []
        self.rss: list[float] = []
        self.texts: list[str] = []
        self.gpu: GpuSample | None = None
        self.source = ScheduleSource(gpu_sample=lambda: self.gpu, wall_clock=lambda: self.wall,
                                     sample_interval_s=3600,
                                     rss_reader=self._rss, metrics_reader=self._metrics)
        self.ctx = Context(get_config=lambda: self.config,
                           emit=lambda name, **f: self.emitted.append((name, f)), post=self.posted.append,
                           post_threadsafe=self.posted.append, clock=lambda: self.mono,
                           loop=asyncio.get_running_loop())

    @property
    def state(self) -> State:
        return self._state

    @state.setter
    def state(self, new: State) -> None:
        """A state set by hand (no step of the policy): the source follows it as it follows a record."""
        self._state = new
        self.source.follow(new)

    def _rss(self, pid: int) -> float | None:
        return self.rss.pop(0) if self.rss else None

    async def _metrics(self, base_url: str, timeout_s: float) -> str | None:
        return self.texts.pop(0) if self.texts else None

    async def start(self) -> Rig:
        assert await self.source.start(self.ctx) is None
        return self

    def advance(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.mono += seconds

    def serve(self, pid: int) -> None:
        """The policy spawned ``pid`` and it became READY."""
        self.source.on_spawn(self.ctx, pid)
        self.state = replace(self.state, phase=Phase.READY, pid=pid, started_at=self.mono, ready_at=self.mono)

    def play(self, event: Input) -> None:
        """Feed ``event`` to the real policy and hand its actions to the source, as the daemon does."""
        before = self.state
        self._state, actions = decide(before, event, self.mono)
        self.source.on_transition(self.ctx, Transition(before, self.state, event, tuple(actions), self.mono))

    def names(self) -> list[str]:
        return [name for name, _ in self.emitted]

    def event(self, name: str) -> dict[str, Any]:
        found = [fields for n, fields in self.emitted if n == name]
        assert found, f"no {name} in {self.names()}"
        return found[-1]

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        await asyncio.gather(*self.source._tasks)

    async def policy_restarts(self, old: int, new: int, *, cause: RestartCause = RestartCause.SCHEDULE,
                              drain_timeout: bool = False, unavailable_s: float = 4.0, drain_s: float = 0.0) -> None:
        """One drained restart of ``old`` into ``new`` through the real policy (the drain lasts
        ``drain_s``, then ``unavailable_s`` from the stop to READY)."""
        self.play(RestartRequest("why", cause=cause))
        await self.settle()
        self.advance(drain_s)
        if drain_timeout:
            self.advance(self.state.params.drain_timeout_s)
            self.play(Tick())
        else:
            self.play(Drained(old))
        assert self.state.phase is Phase.STOPPING
        self.play(Exited(old, 0))
        self.source.on_exit(self.ctx, old, 0)
        self.advance(unavailable_s)
        self.play(Spawned(new))
        self.source.on_spawn(self.ctx, new)
        self.play(HealthOk(new))
        assert self.state.phase is Phase.READY
        await self.settle()


async def test_the_fire_posts_one_drained_scheduled_restart() -> None:
    rig = await Rig().start()
    rig.serve(100)
    rig.source.tick(rig.ctx)
    assert rig.posted == []
    rig.advance(10.5)
    rig.source.tick(rig.ctx)
    [request] = rig.posted
    assert isinstance(request, RestartRequest)
    assert request.cause is RestartCause.SCHEDULE and request.drain
    assert "'30 4 * * *'" in request.reason and "2025-03-10T04:30:00+00:00" in request.reason
    rig.advance(1)
    rig.source.tick(rig.ctx)
    assert len(rig.posted) == 1  # each fire once
    assert rig.source.snapshot()["next_fire"] == "2025-03-11T04:30:00+00:00"  # type: ignore[index]


async def test_a_recent_start_skips_the_fire_with_an_event() -> None:
    rig = await Rig(min_uptime_s=3600.0).start()
    rig.advance(-1790)  # the server started at 04:00
    rig.serve(100)
    rig.advance(1790 + 11)
    rig.source.tick(rig.ctx)
    assert rig.posted == []
    skipped = rig.event("scheduled_restart_skipped")
    assert skipped["server_pid"] == 100 and skipped["outcome"] == "skip_recent_start"
    assert skipped["uptime_s"] == pytest.approx(1801, abs=1)


async def test_not_serving_skips_and_a_late_wake_is_missed() -> None:
    rig = await Rig().start()
    rig.advance(11)
    rig.state = replace(rig.state, phase=Phase.STARTING)
    rig.source.tick(rig.ctx)
    assert rig.event("scheduled_restart_skipped")["outcome"] == "skip_not_serving"
    rig.serve(100)
    rig.advance(86400 + 4 * 3600)  # asleep through the next night's fire
    rig.source.tick(rig.ctx)
    assert rig.posted == []
    assert rig.event("scheduled_restart_missed")["missed"] == 1


async def test_disabled_schedule_never_posts() -> None:
    rig = await Rig(restart_cron="").start()
    rig.serve(100)
    rig.advance(2 * 86400)
    rig.source.tick(rig.ctx)
    assert rig.posted == [] and rig.emitted == []
    assert rig.source.snapshot()["next_fire"] is None  # type: ignore[index]


async def test_unavailable_is_what_clients_saw_drain_included_with_the_front_door() -> None:
    for front, expected in (({}, 4.2), ({"listen": "127.0.0.1:18080"}, 30.0 + 4.2)):
        rig = await Rig(front=front).start()
        rig.serve(100)
        await rig.policy_restarts(100, 101, unavailable_s=4.2, drain_s=30.0)
        # Without the front door clients reach the server while it drains; with it they are held from its start.
        assert rig.event("planned_restart_done")["unavailable_s"] == pytest.approx(expected)


async def test_a_drained_restart_is_recorded_with_its_figures() -> None:
    rig = await Rig(decay_warmup_s=0.0, speed_window_tokens=100).start()
    rig.serve(100)
    rig.texts = [metrics(0, 0.0)]
    rig.source.on_transition(rig.ctx, Transition(replace(rig.state, phase=Phase.STARTING), rig.state, HealthOk(100),
                                                  (NotifyReady(),), rig.mono))
    await rig.settle()  # the window starts when the server is ready
    rig.advance(11)
    rig.source.tick(rig.ctx)
    rig.texts = [metrics(1000, 10.0)]  # sampled when the drain begins: 100 tokens/s
    await rig.policy_restarts(100, 101, unavailable_s=4.2)
    done = rig.event("planned_restart_done")
    assert done["kind"] == "scheduled" and done["outcome"] == "drained" and done["drained"] is True
    assert done["server_pid"] == 101 and done["uptime_s"] == 11.0
    assert done["unavailable_s"] == pytest.approx(4.2)
    assert done["tokens_per_s_before"] == pytest.approx(100.0)
    assert "100.0 tokens/s → ?" in done["summary"]
    # The new server's first window is the "after" figure, shown by status.
    rig.texts = [metrics(0, 0.0)]
    await rig.source._sample(rig.ctx)
    rig.texts = [metrics(1200, 10.0)]
    await rig.source._sample(rig.ctx)
    [record] = rig.source.snapshot()["history"]  # type: ignore[index]
    assert record["tokens_per_s_after"] == pytest.approx(120.0)
    assert record["kind"] == "scheduled"


async def test_a_drain_timeout_and_a_requested_restart_are_recorded() -> None:
    rig = await Rig().start()
    rig.serve(100)
    await rig.policy_restarts(100, 101, cause=RestartCause.OPERATOR, drain_timeout=True)
    done = rig.event("planned_restart_done")
    assert done["kind"] == "requested" and done["outcome"] == "drain_timeout" and done["drained"] is False
    assert "tokens_per_s_before" not in done  # nothing measured: left out, not zero


async def test_a_reload_to_a_new_build_that_drained_and_measured_the_old_one_is_called_drained() -> None:
    """A reload that names a new build drains the old server, measures it (TRIAL), then stops it: that
    stop follows a drain that answered, so the restart is ``drained`` — not a drain timeout (before:
    the stop's step was the measurement's, and the record said ``drain_timeout``)."""
    rig = await Rig().start()
    rig.serve(100)
    rig.play(ParamsChanged(rig.state.params, server_changed=True, new_build=True))
    await rig.settle()
    rig.play(Drained(100))
    assert rig.state.phase is Phase.TRIAL
    rig.play(SpeedMeasured(100, 80.0))
    assert rig.state.phase is Phase.STOPPING
    rig.play(Exited(100, 0))
    rig.source.on_exit(rig.ctx, 100, 0)
    last = rig.source.history.last()
    assert last is not None and last.drained is True


async def test_a_fault_while_draining_is_not_called_drained() -> None:
    rig = await Rig().start()
    rig.serve(100)
    rig.play(RestartRequest("x"))
    for _ in range(rig.state.params.hang_strikes):  # it hangs while draining: stopped as a fault
        rig.play(Probe(100, health_ok=False, canary_ok=None, busy=False, progressed=False))
    assert rig.state.phase is Phase.STOPPING and rig.state.after_stop is AfterStop.FAILURE
    rig.play(Exited(100, -15))
    rig.source.on_exit(rig.ctx, 100, -15)
    assert rig.source.history.last() is not None and rig.source.history.last().drained is False  # type: ignore[union-attr]


async def test_a_server_killed_while_draining_is_reported_as_such_not_as_a_drain_timeout() -> None:
    rig = await Rig().start()
    rig.serve(100)
    rig.play(RestartRequest("x"))
    await rig.settle()
    rig.play(Exited(100, -9))  # kill -9 while it drains
    rig.source.on_exit(rig.ctx, 100, -9)
    rig.advance(rig.state.deadline - rig.mono if rig.state.deadline else 0.0)
    rig.play(Tick())
    rig.play(Spawned(101))
    rig.source.on_spawn(rig.ctx, 101)
    rig.play(HealthOk(101))
    assert rig.state.phase is Phase.READY
    await rig.settle()
    done = rig.event("planned_restart_done")
    assert done["outcome"] == "server_exited" and done["drained"] is False and done["server_exited"] is True


async def test_rss_growth_fires_one_decay_restart_when_ready() -> None:
    # No host prompt cache (--cache-ram 0): all growth over the bound counts.
    rig = await Rig(server={"extra_args": ["--cache-ram", "0"]}, restart_cron="", rss_growth_mib=100.0,
                    decay_warmup_s=0.0, decay_baseline_samples=1, decay_confirm=2).start()
    rig.serve(100)
    rig.rss = [1000.0, 1150.0, 1160.0, 1170.0]
    for _ in range(4):
        await rig.source._sample(rig.ctx)
        rig.advance(10)
    detected = rig.event("decay_detected")
    assert detected["trigger"] == "rss_growth" and detected["server_pid"] == 100
    assert detected["baseline_mib"] == 1000.0 and detected["growth_mib"] == 160.0
    assert rig.names().count("decay_detected") == 1
    [request] = rig.posted  # asked for by the sample that fired (READY): no schedule tick in between
    assert request.cause is RestartCause.DECAY and request.reason.startswith("decay: rss_growth")
    rig.source.tick(rig.ctx)
    assert len(rig.posted) == 1
    await rig.policy_restarts(100, 101, cause=RestartCause.DECAY)
    assert rig.event("planned_restart_done")["kind"] == "rss_growth"


async def test_a_decay_fired_while_not_ready_is_asked_for_by_the_record_that_makes_it_ready() -> None:
    """The decay restart is fed by the loop's records, never by a poll: a trigger that fired while the
    policy did not hold its server READY is sent by the step that enters READY (no tick, no sleep)."""
    rig = await Rig(server={"extra_args": ["--cache-ram", "0"]}, restart_cron="", rss_growth_mib=100.0,
                    decay_warmup_s=0.0, decay_baseline_samples=1, decay_confirm=2).start()
    rig.serve(100)
    rig.state = replace(rig.state, phase=Phase.DRAINING)
    rig.rss = [1000.0, 1150.0, 1160.0, 1170.0]
    for _ in range(4):
        await rig.source._sample(rig.ctx)
        rig.advance(10)
    assert rig.names().count("decay_detected") == 1 and rig.posted == []  # not READY: held back
    draining = rig.state
    rig._state = replace(draining, phase=Phase.READY)
    rig.source.on_transition(rig.ctx, Transition(draining, rig.state, Tick(), (), rig.mono))
    [request] = rig.posted
    assert request.cause is RestartCause.DECAY and request.reason.startswith("decay: rss_growth")
    await rig.settle()
    rig.source.on_transition(rig.ctx, Transition(rig.state, rig.state, Tick(), (), rig.mono))
    assert len(rig.posted) == 1  # asked for once


@pytest.mark.parametrize(("extra_args", "series", "fires"), [
    # The host prompt cache fills up to its default cap (8192 MiB) and stays: a plateau, no leak.
    ([], [500.0, 2500.0, 6500.0, 8600.0, 8650.0, 8640.0, 8650.0], False),
    # The same cap, and memory still growing past it: a leak.
    ([], [500.0, 4500.0, 8650.0, 9200.0, 9580.0, 9900.0, 10200.0], True),
    # A smaller cap given as --cache-ram=N; the plateau at 2 GiB over the baseline is past it.
    (["--cache-ram=1024"], [500.0, 1500.0, 2600.0, 2650.0, 2640.0, 2650.0, 2650.0], True),
    # -1 (no limit): growth is no evidence; measured, never fired.
    (["-cram", "-1"], [500.0, 9000.0, 20000.0, 30000.0, 40000.0, 50000.0, 60000.0], False),
])
async def test_host_prompt_cache_plateau_is_not_a_leak(extra_args: list[str], series: list[float],
                                                       fires: bool) -> None:
    rig = await Rig(server={"extra_args": extra_args}, restart_cron="", rss_growth_mib=256.0,
                    decay_warmup_s=0.0, decay_baseline_samples=1, decay_confirm=2).start()
    rig.serve(100)
    rig.rss = list(series)
    for _ in series:
        await rig.source._sample(rig.ctx)
        rig.advance(10)
    assert ("decay_detected" in rig.names()) is fires, rig.emitted


async def test_vram_comes_from_the_gpu_watchers_last_sample() -> None:
    rig = await Rig(decay_warmup_s=0.0, decay_baseline_samples=1).start()
    rig.gpu = GpuSample(GpuIdentity(0, "GPU-0", "0000:00:00.0", "H200"),
                        processes=(GpuProcess(100, 2048 << 20), GpuProcess(7, 1 << 30)))
    rig.serve(100)
    await rig.source._sample(rig.ctx)
    assert rig.source.monitor.vram.last_mib == 2048.0


async def test_reload_keeps_the_armed_fire_unless_the_cron_changes() -> None:
    rig = await Rig().start()
    rig.serve(100)
    old = rig.config
    rig.config = Config(schedule=replace_schedule(old.schedule, drain_timeout_s=5.0, min_uptime_s=60.0))
    rig.source.on_reload(rig.ctx, old, rig.config)
    assert rig.source.schedule is not None and rig.source.schedule.min_uptime_s == 60.0
    rig.advance(10.5)  # the fire is due now: it is not lost by the reload
    rig.source.tick(rig.ctx)
    assert rig.event("scheduled_restart_skipped")["outcome"] == "skip_recent_start"
    old = rig.config
    rig.config = Config(schedule=replace_schedule(old.schedule, restart_cron="0 5 * * *"))
    rig.source.on_reload(rig.ctx, old, rig.config)
    assert rig.source.snapshot()["next_fire"] == "2025-03-10T05:00:00+00:00"  # type: ignore[index]


def replace_schedule(cfg: ScheduleConfig, **changes: Any) -> ScheduleConfig:
    return ScheduleConfig(**{**cfg.model_dump(), **changes})
