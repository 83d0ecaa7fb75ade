"""The daemon's planned-restart watcher: the cron schedule, decay triggers, and the restart record.

Once a second :meth:`ScheduleSource.run` asks :class:`~llama_guard.restarts.schedule.PlannedRestarts`
whether a fire is due (wall clock, the server's wall-clock start from :meth:`on_spawn`, and
whether the policy is READY). A due fire becomes ``RestartRequest(cause=RestartCause.SCHEDULE,
drain=True)``: the policy drains (``/slots`` idle, bounded by ``[schedule].drain_timeout_s``,
else ``drain_timeout``) and restarts. Skipped and missed fires are reported here
(``scheduled_restart_skipped`` / ``scheduled_restart_missed``).

Every ``SAMPLE_INTERVAL_S`` (and at once when a server becomes ready and when a drain begins) it
feeds :class:`~llama_guard.restarts.decay.DecayMonitor`: the server's anonymous memory (RssAnon + VmSwap), its VRAM
(from the GPU source's last NVML sample, when there is one) and the ``/metrics`` generation
counters. A trigger past its opt-in bound reports ``decay_detected`` and asks for the same
drained restart: at once when the policy holds that server READY, else from the loop's record that
makes it READY (fed, not polled).

Each planned restart — scheduled, decay, or requested (``llama-guard restart``, SIGUSR1) — is
followed through the records the loop publishes (:meth:`on_transition`, :meth:`on_exit`) into its
record (:mod:`.follow`: ``planned_restart_done``), shown by ``llama-guard status``. The readings
(anonymous memory, VRAM, ``/metrics``) come from :mod:`.readings`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from llama_guard.config import Config
from llama_guard.config.argv import host_cache_cap_mib
from llama_guard.config.cron import ScheduleError
from llama_guard.config.sections import ScheduleConfig
from llama_guard.core.client import ServerClient
from llama_guard.core.offload import PROC_TIMEOUT_S, CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.core.probes import make_client
from llama_guard.core.prometheus import MetricsError
from llama_guard.gpu.readings import GpuSample
from llama_guard.model.inputs import RestartRequest
from llama_guard.model.transition import Transition
from llama_guard.model.types import RestartCause, State
from llama_guard.model.watcher import Context, Watcher
from llama_guard.restarts.decay import DecayDecision, DecayMonitor
from llama_guard.restarts.follow import RestartFollower
from llama_guard.restarts.history import RestartHistory
from llama_guard.restarts.readings import fetch_metrics, read_anon_memory_mib, server_vram_mib
from llama_guard.restarts.schedule import Decision, Outcome, PlannedRestarts, planned_restarts
from llama_guard.vocab.phases import Phase

TICK_S = 1.0              # how often the schedule is asked
SAMPLE_INTERVAL_S = 10.0  # how often RSS, VRAM and /metrics are sampled while the server serves

__all__ = ["SAMPLE_INTERVAL_S", "TICK_S", "ScheduleSource"]


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


WARM_TIMEOUT_S = 10.0  # counting the model file's cached pages and asking for the rest (seconds)


class ScheduleSource(Watcher):
    """Planned restarts: cron schedule, decay triggers, before/after record (``llama-guard status``).

    ``gpu_sample``: the GPU watcher's latest NVML sample (its process list gives the server's VRAM;
    None without a GPU watch). ``wall_clock`` (aware datetimes), ``rng`` (jitter), ``rss_reader``
    and ``metrics_reader`` (``(base_url, timeout_s) -> text | None``) are injectable for tests.
    """

    name = "planned_restarts"

    def __init__(self, *, gpu_sample: Callable[[], GpuSample | None] = lambda: None,
                 wall_clock: Callable[[], datetime] = _utc_now,
                 rng: random.Random | None = None, sample_interval_s: float = SAMPLE_INTERVAL_S,
                 rss_reader: Callable[[int], float | None] = read_anon_memory_mib,
                 metrics_reader: Callable[[str, float], Awaitable[str | None]] | None = None) -> None:
        self._gpu_sample = gpu_sample
        self._wall = wall_clock
        self._rng = rng or random.Random()
        self._sample_interval_s = sample_interval_s
        self._rss_reader = rss_reader
        self._metrics_reader = metrics_reader
        self._lane = Lane(LaneKind.PROC)
        self._file_lane = Lane(LaneKind.CONFIG)  # the model file's page cache (a hung mount stays here)
        self._client: ServerClient | None = None
        self.schedule: PlannedRestarts | None = None
        self.monitor: DecayMonitor = DecayMonitor()
        self.follower = RestartFollower()
        self._pid: int | None = None
        self._start_wall: datetime | None = None
        self._start_mono: float | None = None
        self._decay: tuple[int, DecayDecision] | None = None  # a fired trigger waiting for READY
        self._last_decision: dict[str, object] | None = None
        self._metrics_warned = False
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._drained: int | None = None  # the server whose drain ended: asked nothing more before its SIGTERM
        # The policy's phase and the server it names, as the loop's last record showed them.
        self._phase: Phase = Phase.STOPPED
        self._policy_pid: int | None = None

    # ------------------------------------------------------------ set-up

    def _build_schedule(self, cfg: ScheduleConfig) -> PlannedRestarts:
        return planned_restarts(cfg, now_wall=self._wall(), rng=self._rng)

    @property
    def history(self) -> RestartHistory:
        """The record of planned restarts."""
        return self.follower.history

    async def start(self, ctx: Context) -> str | None:
        cfg = ctx.config.schedule
        try:
            self.schedule = self._build_schedule(cfg)
        except (ScheduleError, ValueError) as exc:
            return f"[schedule]: {exc}"
        self.monitor = DecayMonitor.from_config(cfg, host_cache_cap_mib(ctx.config.server))
        self.follower.history = RestartHistory(cfg.history_size)
        if self._metrics_reader is None:
            self._client = make_client(ctx.get_api_key)
        return None

    async def before_drained_stop(self, ctx: Context, pid: int) -> None:
        """Just before the drained server's SIGTERM: a sample still asking it finishes first (each of its
        requests bounded by ``[health].timeout_s``), none starts after, and this watcher's idle
        connection is closed — llama-server's graceful exit waits for the requests it is answering
        and for idle keep-alive connections (a ``/metrics`` in flight at the SIGTERM held it 1–2 s)."""
        async with self._lock:
            self._drained = pid
            if self._client is not None:
                await self._client.aclose()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    def on_reload(self, ctx: Context, old: Config, new: Config) -> None:
        o, n = old.schedule, new.schedule
        if self.schedule is None or (o.restart_cron, o.timezone, o.jitter_s) != (n.restart_cron, n.timezone,
                                                                                   n.jitter_s):
            try:
                self.schedule = self._build_schedule(n)  # the next fire after now
            except (ScheduleError, ValueError) as exc:
                ctx.emit("config_error", reason=f"[schedule]: {exc}; keeping the previous schedule")
        else:  # the same fires: keep the cursor, so a fire about to be due is not lost
            self.schedule.min_uptime_s = n.min_uptime_s
            self.schedule.misfire_grace_s = n.misfire_grace_s
        decay_keys = ("vram_growth_mib", "rss_growth_mib", "speed_drop_fraction", "decay_warmup_s",
                      "decay_baseline_samples", "decay_confirm", "speed_window_tokens")
        if (any(getattr(o, k) != getattr(n, k) for k in decay_keys)
                or host_cache_cap_mib(old.server) != host_cache_cap_mib(new.server)):
            self.monitor = DecayMonitor.from_config(n, host_cache_cap_mib(new.server))
            self.monitor.reset(self._start_mono)
        if o.history_size != n.history_size:
            self.follower.history = RestartHistory(n.history_size, self.history.records())

    # ------------------------------------------------------------ the server's life

    def on_spawn(self, ctx: Context, pid: int) -> None:
        self._pid = pid
        self._start_wall = self._wall()
        self._start_mono = ctx.clock()
        self.monitor.reset(self._start_mono)
        self._decay = None

    def on_exit(self, ctx: Context, pid: int, returncode: int | None) -> None:
        if pid == self._pid:
            self._pid = None
        self.follower.exited(pid, ctx.clock())

    def follow(self, state: State) -> None:
        """The policy's phase and server pid from a record's state (:meth:`on_transition`)."""
        self._phase, self._policy_pid = state.phase, state.pid

    def on_transition(self, ctx: Context, step: Transition) -> None:
        """Follow a planned restart through the loop's records (never event names)."""
        self.follow(step.after)
        if step.restart_begins:
            self.follower.begin(step, self.monitor, wall=self._wall(), front_on=ctx.config.front.address is not None)
            self._spawn_task(self._warm_model(ctx))
        if step.entered(Phase.DRAINING) and self.follower.follows(step.before.pid):
            self._spawn_task(self._sample(ctx))  # "just before" figures while it drains
        self.follower.stopped(step, self.monitor)
        if step.entered(Phase.READY):
            self.follower.ready(ctx, step.after.pid)
            self._spawn_task(self._sample(ctx))  # the start of the new server's speed window
            self._send_decay(ctx)  # a trigger that fired while the server drained or loaded

    async def _warm_model(self, ctx: Context) -> None:
        """While the old server drains: the model file into the page cache for the new one
        (:mod:`.page_cache`), or ``model_page_cache_short`` when the host's RAM cannot hold it."""
        from llama_guard.restarts.page_cache import warm  # ctypes: imported at the first planned restart, not at start

        model = Path(ctx.config.server.model)
        try:
            warmth = await self._file_lane.run(lambda: warm(model), WARM_TIMEOUT_S, f"the page cache of {model}")
        except (OSError, LaneBusy):  # CallTimeout is an OSError
            return  # the spawn's own model check names a file that cannot be opened or does not answer
        if not warmth.fits:
            ctx.emit("model_page_cache_short", **warmth.fields(model))

    # ------------------------------------------------------------ the loops

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self, ctx: Context) -> None:
        await asyncio.gather(self._tick_loop(ctx), self._sample_loop(ctx))

    async def _tick_loop(self, ctx: Context) -> None:
        while True:
            self.tick(ctx)
            await asyncio.sleep(TICK_S)

    async def _sample_loop(self, ctx: Context) -> None:
        while True:
            await asyncio.sleep(self._sample_interval_s)
            await self._sample(ctx)

    def tick(self, ctx: Context) -> Decision | None:
        """Ask the schedule once; the decision, if any."""
        serving = self._phase is Phase.READY
        if self.schedule is None:
            return None
        started = self._start_wall if self._pid is not None else None
        try:
            decision = self.schedule.due(self._wall(), started, serving=serving)
        except ValueError as exc:  # a naive clock: a programming error, reported once per tick
            ctx.emit("config_error", reason=f"planned restarts: {exc}")
            return None
        if decision.outcome is Outcome.WAIT:
            return decision
        self._last_decision = dict(decision.fields())
        if decision.restart:
            ctx.post(RestartRequest(decision.reason, cause=RestartCause.SCHEDULE, drain=True))
        elif decision.event is not None:
            ctx.emit(decision.event, server_pid=self._policy_pid, **decision.fields())
        return decision

    async def _sample(self, ctx: Context) -> None:
        async with self._lock:
            await self._sample_locked(ctx)

    async def _sample_locked(self, ctx: Context) -> None:
        pid = self._pid
        if (pid is None or self._policy_pid != pid or self._phase not in (Phase.READY, Phase.DRAINING)
                or self._drained == pid):
            return
        try:
            rss = await self._lane.run(lambda: self._rss_reader(pid), PROC_TIMEOUT_S, "server RSS")
        except (CallTimeout, LaneBusy):  # /proc does not answer: no reading this round
            rss = None
        if rss is not None and self._pid == pid:
            self._observe(ctx, pid, self.monitor.observe_rss(ctx.clock(), rss))
        vram = server_vram_mib(self._gpu_sample(), pid)
        if vram is not None and self._pid == pid:
            self._observe(ctx, pid, self.monitor.observe_vram(ctx.clock(), vram))
        cfg = ctx.config
        if self._metrics_reader is not None:
            text = await self._metrics_reader(cfg.server.base_url, cfg.health.timeout_s)
        elif self._client is not None:
            text = await fetch_metrics(self._client, cfg.server.base_url, cfg.health.timeout_s)
        else:
            text = None
        if text is None or self._pid != pid:
            return
        try:
            decision = self.monitor.observe_metrics(ctx.clock(), text)
        except MetricsError as exc:
            if cfg.schedule.speed_drop_fraction > 0 and not self._metrics_warned:
                self._metrics_warned = True
                ctx.emit("config_error", reason=f"speed_drop_fraction is set but {exc}")
            return
        self._observe(ctx, pid, decision)

    def _observe(self, ctx: Context, pid: int, decision: DecayDecision) -> None:
        if decision.fire and self._decay is None:
            ctx.emit("decay_detected", server_pid=pid, **decision.fields())
            self._decay = (pid, decision)
            self._send_decay(ctx)
        self.follower.fill_after(self._pid, self.monitor)

    def _send_decay(self, ctx: Context) -> None:
        """Ask for the decay restart of a fired trigger once the policy holds its server READY: at once
        when it does, else from the record that makes it READY (:meth:`on_transition`); never polled."""
        if self._decay is None or self._phase is not Phase.READY or self._policy_pid != self._decay[0]:
            return
        _, fired = self._decay
        self._decay = None
        self.follower.decay_trigger = fired.trigger.value
        ctx.post(RestartRequest(f"decay: {fired.reason}", cause=RestartCause.DECAY, drain=True))

    # ------------------------------------------------------------ status

    def snapshot(self) -> dict[str, Any] | None:
        sched = self.schedule
        nxt = sched.next_fire(self._wall()) if sched is not None else None
        zone = sched.tz if sched is not None else None
        return {
            "cron": sched.cron.strip() if sched is not None else "",
            "timezone": getattr(zone, "key", None) or (str(zone) if zone is not None else ""),
            "next_fire": nxt.isoformat() if nxt is not None else None,
            "last_decision": self._last_decision,
            "decay": {"enabled": self.monitor.enabled, **self.monitor.snapshot()},
            "history": self.history.to_json(),
        }

