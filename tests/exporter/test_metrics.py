"""The metrics watcher: events counted by cause, phases timed, peers' readings exported, the text
parsed back with prometheus_client.parser (the daemon-level test is in test_insight_e2e.py)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from harness import free_port
from llama_guard.config import Config, ConfigError
from llama_guard.config.listen import MetricsConfig, parse_listen
from llama_guard.exporter.metrics import MetricsSource
from llama_guard.gpu.readings import GpuIdentity, GpuSample
from llama_guard.limits.usage import UsageSample
from llama_guard.model.actions import Action, Emit, Spawn
from llama_guard.model.inputs import Boot, Drained, Exited, GpuFault, HealthOk, Input, ParamsChanged, Spawned, Tick
from llama_guard.model.policy import decide
from llama_guard.model.transition import Transition
from llama_guard.model.types import AfterStop, GpuFaultKind, Params, State, XidAction, XidScope, initial_state
from llama_guard.model.watcher import Context
from llama_guard.vocab.phases import Phase
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp: Path, listen: str = "", gpu: GpuSample | None = None, usage: UsageSample | None = None,
         port_wait_s: float = 30.0) -> tuple[MetricsSource, Context, dict[str, State], Clock]:
    cfg = Config.model_validate({"runtime": {"dir": str(tmp)}, "metrics": {"listen": listen},
                                 "recovery": {"port_wait_s": port_wait_s}})
    holder = {"state": State()}
    clock = Clock()
    ctx = Context(get_config=lambda: cfg, emit=lambda *a, **k: None,
                  post=lambda i: None, post_threadsafe=lambda i: None, clock=clock,
                  loop=asyncio.get_event_loop_policy().get_event_loop())
    return MetricsSource(gpu_sample=lambda: gpu, usage=lambda: usage), ctx, holder, clock


def deliver(src: MetricsSource, ctx: Context, holder: dict[str, State], *actions: Action) -> None:
    """What the daemon does with one step that kept the state ``holder["state"]`` and asked for ``actions``:
    the sources see the record (``on_transition``), then each action is executed — an ``Emit`` goes
    through the emitter, whose sinks (the metrics source among them, as wiring attaches it) get it."""
    src.on_transition(ctx, Transition(holder["state"], holder["state"], Tick(), actions, ctx.clock()))
    for action in actions:
        if isinstance(action, Emit):
            src.write({"event": action.name, **action.fields})


def scrape(source: MetricsSource) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(source.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_restarts_counted_by_cause_and_phase_times(tmp_path: Path) -> None:
    gpu = GpuSample(GpuIdentity(0, "GPU-0", "0000:00:00.0", "H200"), temperature_c=61, power_mw=250_000,
                    power_limit_mw=700_000, memory_used_bytes=5 * 2**30, memory_total_bytes=80 * 2**30,
                    clock_event_reasons=0x20)
    usage = UsageSample(pid=1, fds=40, threads=9, nofile_limit=4096, nproc_limit=-1)
    src, ctx, holder, clock = make(tmp_path, gpu=gpu, usage=usage)
    assert await src.start(ctx) is None
    holder["state"] = replace(holder["state"], phase=Phase.STARTING)
    deliver(src, ctx, holder, Spawn())
    clock.now += 2.5
    holder["state"] = replace(holder["state"], phase=Phase.READY, ready_at=clock.now)
    deliver(src, ctx, holder, Emit("server_ready", {"server_pid": 1}))
    clock.now += 30
    for cause in ("oom", "hang", "oom"):
        deliver(src, ctx, holder, Emit("server_restart", {"reason": "x", "restart_cause": cause}))
    deliver(src, ctx, holder, Emit("gpu_reset", {"outcome": "succeeded", "trigger": "oom"}))
    deliver(src, ctx, holder, Emit("gpu_vram_not_released", {"waited_s": 4.0}))
    m = scrape(src)
    assert m[("llama_guard_restarts_total", (("cause", "oom"),))] == 2
    assert m[("llama_guard_restarts_total", (("cause", "hang"),))] == 1
    assert m[("llama_guard_gpu_resets_total", (("outcome", "succeeded"), ("trigger", "oom")))] == 1
    assert m[("llama_guard_phase", (("phase", "ready"),))] == 1
    assert m[("llama_guard_phase", (("phase", "stopped"),))] == 0
    assert m[("llama_guard_server_ready", ())] == 1
    assert m[("llama_guard_ready_duration_seconds", ())] == pytest.approx(30)
    assert m[("llama_guard_phase_seconds_sum", (("phase", "starting"),))] == pytest.approx(2.5)
    assert m[("llama_guard_vram_wait_seconds_sum", ())] == 4.0
    assert m[("llama_guard_gpu_temperature_celsius", (("gpu", "0"),))] == 61
    assert m[("llama_guard_gpu_power_watts", (("gpu", "0"),))] == 250
    assert m[("llama_guard_gpu_throttle_reason", (("gpu", "0"), ("reason", "sw_thermal_slowdown")))] == 1
    assert m[("llama_guard_gpu_throttle_reason", (("gpu", "0"), ("reason", "hw_slowdown")))] == 0
    assert m[("llama_guard_rlimit_used", (("limit", "RLIMIT_NOFILE"),))] == 40
    assert m[("llama_guard_gpu_reset_budget_remaining", ())] == 2  # state.resets is empty here
    snap = src.snapshot()
    assert snap is not None and snap["restarts_by_cause"] == {"oom": 2, "hang": 1}


async def test_bench_figures_exported_when_recorded(tmp_path: Path) -> None:
    src, ctx, _, _ = make(tmp_path)
    await src.start(ctx)
    assert not any(k[0].startswith("llama_guard_bench") for k in scrape(src))
    (tmp_path / "bench.json").write_text(json.dumps({"eval_tokens_per_s": {"median": 123.4},
                                                     "prompt_tokens_per_s": {"median": 456.0},
                                                     "ceiling": {"ceiling_tokens_per_s": 900.0},
                                                     "finished": 1.7e9}))
    m = scrape(src)
    assert m[("llama_guard_bench_eval_tokens_per_second", ())] == 123.4
    assert m[("llama_guard_bench_ceiling_tokens_per_second", ())] == 900.0


async def test_served_only_when_listen_is_set_and_bound_to_loopback(tmp_path: Path) -> None:
    off, ctx, _, _ = make(tmp_path)
    await off.start(ctx)
    assert off.listening is None and off.snapshot()["listen"] is None  # type: ignore[index]
    port = free_port()
    on, ctx2, _, _ = make(tmp_path, listen=str(port))
    assert await on.start(ctx2) is None
    try:
        assert on.listening == ("127.0.0.1", port)
        async with httpx.AsyncClient() as client:
            body = (await client.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
        assert "llama_guard_phase" in body
        # A port held (here by this very process) is named; with no wait allowed, refused at once.
        busy, ctx3, _, _ = make(tmp_path, listen=str(port), port_wait_s=0.0)
        reason = await busy.start(ctx3)
        assert reason is not None and f"port {port} is held by pid {os.getpid()}" in reason, reason
    finally:
        await on.close()


def test_listen_values() -> None:
    assert parse_listen("9466") == ("127.0.0.1", 9466)
    assert parse_listen("0.0.0.0:9466") == ("0.0.0.0", 9466)
    assert parse_listen("[::1]:9466") == ("::1", 9466)
    assert MetricsConfig().address is None
    for bad in ("0", "70000", "host:", "[::1]9466", "bad host:1", "abc"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_listen(bad)


def test_bad_listen_is_a_config_error(tmp_path: Path) -> None:
    from llama_guard.config import load_config

    path = tmp_path / "c.toml"
    path.write_text('[metrics]\nlisten = "localhost:99999"\n')
    with pytest.raises(ConfigError, match=r"metrics\.listen"):
        load_config(path)


async def test_the_listener_answers_health_on_the_loop_and_a_blocked_loop_answers_nothing(tmp_path: Path) -> None:
    """/livez and /readyz come from the daemon's loop (beside /metrics, on one aiohttp server): while
    the loop is blocked, a probe gets no answer at all until its own timeout."""
    port = free_port()
    src, ctx, holder, _ = make(tmp_path, listen=str(port))
    holder["state"] = State(phase=Phase.READY, pid=7)
    assert await src.start(ctx) is None
    deliver(src, ctx, holder)  # the listener answers from the loop's records, as the metrics do
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            live = await client.get(base + "/livez", timeout=5)
            ready = await client.get(base + "/readyz", timeout=5)
            assert (live.status_code, live.json()) == (200, {"live": True, "phase": "ready"})
            assert (ready.status_code, ready.json()) == (200, {"ready": True, "phase": "ready", "cause": None,
                                                              "restart_cause": None, "retry_after_s": None})
            holder["state"] = State(phase=Phase.DRAINING, pid=7, after_stop=AfterStop.EXIT)
            deliver(src, ctx, holder)
            draining = await client.get(base + "/readyz", timeout=5)
            assert draining.status_code == 503 and draining.json()["cause"] == "stopping"
            assert int(draining.headers["Retry-After"]) == draining.json()["retry_after_s"] >= 1
            assert (await client.post(base + "/metrics", timeout=5)).status_code == 405
            scraped = await client.get(base + "/metrics", timeout=5)
            assert scraped.headers["content-type"].startswith("text/plain") and "llama_guard_phase{" in scraped.text
        outcome: list[str] = []
        ended = threading.Event()

        def probe() -> None:
            try:
                outcome.append(str(httpx.get(base + "/livez", timeout=0.5).status_code))
            except httpx.TimeoutException:
                outcome.append("timeout")
            ended.set()

        threading.Thread(target=probe, daemon=True).start()
        assert ended.wait(60)  # the loop is blocked here until the probe has its outcome
        assert outcome == ["timeout"]
    finally:
        await src.close()


async def test_as_an_emitter_sink_it_counts_the_watchers_own_events(tmp_path: Path) -> None:
    from llama_guard.app.wiring import make_watchers
    from llama_guard.output.eventlog import Emitter

    cfg = Config.model_validate({"runtime": {"dir": str(tmp_path)}, "gpu": {"enabled": "off"}})
    emitter = Emitter(min_level="error", fmt="json")
    metrics = make_watchers(cfg, emitter=emitter).watchers[-1]
    assert isinstance(metrics, MetricsSource) and metrics in emitter.sinks
    _, ctx, _, _ = make(tmp_path)
    metrics.ctx = ctx
    emitter.emit("gpu_temperature_high", gpu_index=0, gpu_temp_c=90, threshold_c=85)  # a watcher's own event
    emitter.emit("server_line", server_pid=1, line="x")
    metrics.on_transition(ctx, Transition(ctx.initial, ctx.initial, Tick(), (Emit("server_oom", {}),), ctx.clock()))
    # seen as an action of a step: counted once, through the sink only (the emit below)
    emitter.emit("server_oom", server_pid=1, line="CUDA error: out of memory", cause="oom")
    emitter.emit("server_restart", reason="oom", restart_cause="oom")
    m = scrape(metrics)
    assert m[("llama_guard_events_total", (("event", "gpu_temperature_high"),))] == 1
    assert m[("llama_guard_events_total", (("event", "server_oom"),))] == 1
    assert ("llama_guard_events_total", (("event", "server_line"),)) not in m
    assert m[("llama_guard_restarts_total", (("cause", "oom"),))] == 1


class PolicyRun:
    """The real policy driven input by input, each action handed to the metrics source as the daemon
    does (``on_transition`` with ``holder["state"]`` already the state after the step, then :func:`deliver`'s
    execution of each action)."""

    def __init__(self, src: MetricsSource, ctx: Context, holder: dict[str, State], clock: Clock,
                 params: Params) -> None:
        self.src, self.ctx, self.holder, self.clock = src, ctx, holder, clock
        holder["state"] = initial_state(params)

    def feed(self, event: Input, after_s: float = 0.1) -> State:
        self.clock.now += after_s
        before = self.holder["state"]
        state, actions = decide(before, event, self.clock.now)
        self.holder["state"] = state
        self.src.on_transition(self.ctx, Transition(before, state, event, tuple(actions), self.clock.now))
        for action in actions:
            if isinstance(action, Emit):
                self.src.write({"event": action.name, **action.fields})
        return state

    def until_restart(self) -> State:
        """Ticks until the backoff's deadline has passed and the restart is decided."""
        while self.holder["state"].phase is Phase.BACKOFF:
            deadline = self.holder["state"].deadline
            self.feed(Tick(), after_s=max(0.1, (deadline or self.clock.now) - self.clock.now))
        return self.holder["state"]

    def start(self, pid: int, *, ready: bool = True) -> None:
        self.feed(Spawned(pid, ("llama-server",)))
        if ready:
            self.feed(HealthOk(pid))


PARAMS = Params(load_stall_s=5.0, load_timeout_s=600.0, backoff_initial_s=0.1)


def restarts(src: MetricsSource) -> dict[str, float]:
    return {dict(labels)["cause"]: v for (name, labels), v in scrape(src).items()
            if name == "llama_guard_restarts_total"}


async def test_a_load_stall_restart_counts_as_load_stalled(tmp_path: Path) -> None:
    src, ctx, holder, clock = make(tmp_path)
    await src.start(ctx)
    run = PolicyRun(src, ctx, holder, clock, PARAMS)
    run.feed(Boot())
    run.start(100, ready=False)
    assert run.feed(Tick(), after_s=6.0).phase is Phase.STOPPING  # no progress for load_stall_s
    run.feed(Exited(100, -15))
    assert run.until_restart().phase is Phase.STARTING
    assert restarts(src) == {"load_stalled": 1}


async def test_a_reload_followed_by_a_crash_counts_as_crash(tmp_path: Path) -> None:
    src, ctx, holder, clock = make(tmp_path)
    await src.start(ctx)
    run = PolicyRun(src, ctx, holder, clock, PARAMS)
    run.feed(Boot())
    run.start(100)
    deliver(src, ctx, holder, Emit("config_reloaded", {"changed": "health"}))  # the daemon's own event
    assert run.feed(ParamsChanged(PARAMS, server_changed=False)).phase is Phase.READY
    run.feed(Exited(100, -9))
    run.until_restart()
    assert restarts(src) == {"crash": 1}


async def test_an_xid_that_restarted_nothing_is_not_the_cause_of_a_later_restart(tmp_path: Path) -> None:
    src, ctx, holder, clock = make(tmp_path)
    await src.start(ctx)
    run = PolicyRun(src, ctx, holder, clock, PARAMS)
    run.feed(Boot())
    run.start(100)
    # Another process's application Xid: reported, nothing restarted.
    assert run.feed(GpuFault(GpuFaultKind.XID, "Xid 31: MMU fault", XidAction.RESTART, 31, XidScope.APP,
                             faulting_pid=4242)).phase is Phase.READY
    assert src.events["gpu_xid"] == 1
    run.feed(Exited(100, 1))
    run.until_restart()
    run.start(101, ready=False)
    run.feed(Tick(), after_s=6.0)
    run.feed(Exited(101, -15))
    run.until_restart()
    assert restarts(src) == {"crash": 1, "load_stalled": 1}


async def test_a_planned_restart_counts_by_its_plan_and_an_xid_it_acted_on_as_xid(tmp_path: Path) -> None:
    src, ctx, holder, clock = make(tmp_path)
    await src.start(ctx)
    run = PolicyRun(src, ctx, holder, clock, PARAMS)
    run.feed(Boot())
    run.start(100)
    assert run.feed(ParamsChanged(PARAMS, server_changed=True)).phase is Phase.DRAINING  # changed flags
    assert run.feed(Drained(100)).phase is Phase.STOPPING
    run.feed(Exited(100, -15))
    run.start(101)
    run.feed(GpuFault(GpuFaultKind.XID, "Xid 31: MMU fault", XidAction.RESTART, 31, XidScope.APP,
                      faulting_pid=101))
    run.feed(Exited(101, -15))
    run.until_restart()
    assert restarts(src) == {"reload": 1, "xid": 1}


async def test_the_loops_unfinished_tasks_are_counted_from_the_scrapes_thread(tmp_path: Path) -> None:
    """``llama_guard_asyncio_tasks``: the daemon loop's tasks not done yet, read where a scrape renders
    (a lane thread, not the loop): it follows tasks started and finished (what the soak bench reads)."""
    src, ctx, _, _ = make(tmp_path)
    await src.start(ctx)
    ctx.loop = asyncio.get_running_loop()

    async def tasks_now() -> float:
        return (await asyncio.to_thread(scrape, src))[("llama_guard_asyncio_tasks", ())]

    before = await tasks_now()
    assert before == len(asyncio.all_tasks())
    release = asyncio.Event()
    parked = [asyncio.create_task(release.wait()) for _ in range(7)]
    assert await tasks_now() == before + 7
    release.set()
    await asyncio.gather(*parked)
    assert await tasks_now() == before


async def test_a_routers_gpu_figures_headroom_throttled_and_slowdown_threshold(tmp_path: Path) -> None:
    """VRAM headroom (total - used), one "slowed down now" series (a heat or power reason; idle is not one) and
    the GPU's own slowdown temperature; absent where NVML did not say."""
    ident = GpuIdentity(0, "GPU-0", "0000:00:00.0", "H200")
    hot = GpuSample(ident, temperature_c=88, temp_slowdown_c=90, memory_used_bytes=5 * 2**30,
                    memory_total_bytes=80 * 2**30, clock_event_reasons=0x1 | 0x40)
    src, ctx, _, _ = make(tmp_path, gpu=hot)
    await src.start(ctx)
    m = scrape(src)
    gpu0 = (("gpu", "0"),)
    assert m[("llama_guard_gpu_memory_free_bytes", gpu0)] == 75 * 2**30
    assert m[("llama_guard_gpu_throttled", gpu0)] == 1
    assert m[("llama_guard_gpu_slowdown_temperature_celsius", gpu0)] == 90
    for reasons, throttled in ((0x1, 0), (0x0, 0), (0x4, 1), (0x80, 1), (0x2, 0)):
        idle = GpuSample(ident, clock_event_reasons=reasons)
        src, ctx, _, _ = make(tmp_path, gpu=idle)
        await src.start(ctx)
        m = scrape(src)
        assert m[("llama_guard_gpu_throttled", gpu0)] == throttled, hex(reasons)
        assert ("llama_guard_gpu_memory_free_bytes", gpu0) not in m  # no VRAM figures: no headroom
        assert ("llama_guard_gpu_slowdown_temperature_celsius", gpu0) not in m


async def test_build_info_and_slot_figures_only_for_the_server_that_is_ready(tmp_path: Path) -> None:
    from llama_guard import __version__
    from llama_guard.exporter.fleet import SlotReading
    from llama_guard.slots.client import SlotInfo

    src, ctx, holder, _ = make(tmp_path)
    await src.start(ctx)
    m = scrape(src)
    assert m[("llama_guard_build_info", (("version", __version__),))] == 1
    assert not any(k[0] == "llama_guard_server_slots" for k in m)
    reading = SlotReading(100, (SlotInfo(0, True, 7, 30, False), SlotInfo(1, False, 5, 12, False),
                                     SlotInfo(2, False, 9, 1, True), SlotInfo(3, False, None, 0, False)))
    src._slots = reading
    holder["state"] = replace(holder["state"], phase=Phase.READY, pid=100)
    deliver(src, ctx, holder)
    m = scrape(src)
    assert m[("llama_guard_server_slots", (("state", "busy"),))] == 1
    assert m[("llama_guard_server_slots", (("state", "free"),))] == 3
    # slots 0 and 1 hold a conversation; 2 holds the liveness canary's prompt, 3 nothing
    assert m[("llama_guard_kv_cache_conversations", (("place", "server"),))] == 2
    # A reading of another server (the one before a restart) is not this one's.
    holder["state"] = replace(holder["state"], pid=101)
    deliver(src, ctx, holder)
    assert not any(k[0] == "llama_guard_server_slots" for k in scrape(src))


async def test_the_serving_builds_release_and_commit_are_labels(tmp_path: Path) -> None:
    from llama_guard.host.build import Build, release_of

    for text, release, commit in (("version: 4242 (abc1234)\nbuilt with cc", "b4242 (abc1234)", "abc1234"),
                                  ("version: 1.2.0 (build 7, commit 0123abcd)", "v1.2.0 (0123abcd)", "0123abcd"),
                                  ("version: 0.6.0-dev (build 0, commit unknown)", "v0.6.0-dev", "")):
        build = Build(Path("/opt/llama-server"), "f" * 64, text, release_of(text))
        src, ctx, _, _ = make(tmp_path)
        src._build = lambda build=build: build  # type: ignore[misc]
        await src.start(ctx)
        (labels,) = [dict(k[1]) for k in scrape(src) if k[0] == "llama_guard_server_build_info"]
        assert labels["release"] == release and labels["commit"] == commit and labels["sha256"] == "f" * 64


@pytest.mark.parametrize("behaviour", ["silent", "error", "not_a_list", "not_json"])
async def test_a_server_that_answers_slots_badly_or_never_costs_the_scrape_only_its_slot_figures(
        tmp_path: Path, behaviour: str) -> None:
    """The scrape's read of llama-server's /slots is bounded (exporter/fleet.py): a server that never answers,
    answers 500, or answers something else than a list of slots leaves the slot series out and nothing else."""
    from aiohttp import web

    async def slots(request: web.Request) -> web.StreamResponse:
        if behaviour == "silent":
            await asyncio.Event().wait()  # never answers
        if behaviour == "error":
            return web.Response(status=500, text="boom")
        return web.Response(text='{"slots": 1}' if behaviour == "not_a_list" else "<html>")

    app = web.Application()
    app.router.add_get("/slots", slots)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        src, ctx, holder, _ = make(tmp_path)
        cfg = Config.model_validate({"runtime": {"dir": str(tmp_path)}, "server": {"port": port}})
        ctx = replace(ctx, get_config=lambda: cfg)
        await src.start(ctx)
        holder["state"] = State(phase=Phase.READY, pid=7)
        deliver(src, ctx, holder)
        await src.refresh()
        m = scrape(src)
        assert not any(k[0] in ("llama_guard_server_slots", "llama_guard_kv_cache_conversations") for k in m)
        assert m[("llama_guard_phase", (("phase", "ready"),))] == 1
    finally:
        await runner.cleanup()
