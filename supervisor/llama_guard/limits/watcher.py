"""The daemon's limits watcher: set the server's rlimits, read them back, watch their use.

Before each spawn it plans RLIMIT_NOFILE / RLIMIT_MEMLOCK / RLIMIT_NPROC from ``[limits]`` and
the daemon's own limits (:mod:`limits`), reporting each limit it cannot raise once; the plan is
applied between fork and exec; after the spawn the child's real limits are read back from
``/proc/<pid>/limits``. While the server runs, its fds, threads and connections are sampled
every ``[limits].sample_interval_s`` against those limits (:mod:`usage`).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict
from typing import Any

from llama_guard.core.offload import PROC_TIMEOUT_S, CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.core.ports import RlimitSettings
from llama_guard.limits.own import can_raise_hard_limits, read_own_limits
from llama_guard.limits.plan import LimitPlan, plan_child_limits
from llama_guard.limits.readback import ProcessLimits, limits_report, read_limits, verify_applied
from llama_guard.limits.rlimits import format_limit
from llama_guard.limits.usage import UsageSample, UsageSampler, UsageTracker
from llama_guard.model.watcher import Context, Watcher
from llama_guard.vocab.events import EventName


class LimitsSource(Watcher):
    """Applies and watches the server's resource limits; the daemon's child set-up port
    (:class:`llama_guard.core.ports.ChildSetupPort`)."""

    name = "limits"

    def __init__(self) -> None:
        self.plan: LimitPlan | None = None
        self.applied: ProcessLimits | None = None
        self._said: set[str] = set()
        self._pid: int | None = None
        self._sampler: UsageSampler | None = None
        self._tracker: UsageTracker | None = None
        self._last_usage: UsageSample | None = None
        self._lane = Lane(LaneKind.PROC)

    def _say_once(self, ctx: Context, name: EventName, **fields: Any) -> None:
        key = f"{name}:{fields.get('limit', '')}:{fields.get('reason', '')}"
        if key not in self._said:
            self._said.add(key)
            ctx.emit(name, **fields)

    async def before_spawn(self, ctx: Context, previous_pid: int | None) -> str | None:
        try:
            own = await self._lane.run(read_own_limits, PROC_TIMEOUT_S, "reading the daemon's own limits")
        except (CallTimeout, LaneBusy) as exc:  # /proc does not answer: not now, tried again after backoff
            return f"the child's limits cannot be planned: {exc}"
        plan = plan_child_limits(ctx.config, own, can_raise_hard_limits())
        self.plan = plan
        for d in plan.decisions:
            if d.problem:
                self._say_once(ctx, "limit_not_raised", limit=d.spec.name, reason=d.problem)
        for note in plan.thread_notes:
            self._say_once(ctx, "threads_warning", reason=note)
        return None

    def child_rlimits(self) -> RlimitSettings:
        return self.plan.settings if self.plan is not None else ()

    def on_spawn(self, ctx: Context, pid: int) -> None:
        self._pid = pid
        self.applied = None
        try:
            applied = read_limits(pid)
        except (ProcessLookupError, OSError):
            return
        self.applied = applied
        if self.plan is not None:
            for text in verify_applied(self.plan, applied):
                self._say_once(ctx, "limit_not_raised", limit="read-back", reason=text)
        summary = ", ".join(f"{name} {format_limit(soft)}/{format_limit(hard)}"
                            for name, (soft, hard) in sorted(applied.values.items())
                            if name in ("RLIMIT_NOFILE", "RLIMIT_MEMLOCK", "RLIMIT_NPROC"))
        ctx.emit("limits_applied", server_pid=pid, summary=summary, source=applied.source)
        self._sampler = UsageSampler(pid, applied)
        if self._tracker is None:
            self._tracker = UsageTracker.from_config(ctx.config.limits)

    def on_exit(self, ctx: Context, pid: int, returncode: int | None) -> None:
        if pid == self._pid:
            self._sampler = None

    async def run(self, ctx: Context) -> None:
        while True:
            await asyncio.sleep(ctx.config.limits.sample_interval_s)
            sampler, tracker = self._sampler, self._tracker
            if sampler is None or tracker is None:
                continue
            try:
                sample = await self._lane.run(sampler.sample, PROC_TIMEOUT_S, "usage sample")
            except (ProcessLookupError, OSError, CallTimeout, LaneBusy):
                continue
            self._last_usage = sample
            for event in tracker.update(sample, ctx.clock()):
                ctx.emit(event.name, **event.fields)

    def on_reload(self, ctx: Context, old: Any, new: Any) -> None:
        self._tracker = UsageTracker.from_config(new.limits)

    def snapshot(self) -> dict[str, Any] | None:
        if self.plan is None:
            return None
        usage = {} if self._last_usage is None else asdict(self._last_usage)
        return {"rows": limits_report(self.plan, self.applied), "usage": usage, "daemon_pid": os.getpid()}

    def last_usage(self) -> UsageSample | None:
        """The server's latest resource reading (open fds, threads and their soft limits); None before
        the first. The typed accessor metrics reads."""
        return self._last_usage
