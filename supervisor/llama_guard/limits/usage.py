"""The server's use of its limits: sampling and hysteresis.

* :class:`UsageSampler` reads one :class:`UsageSample` of the running llama-server: open file
  descriptors (psutil ``num_fds``: a listing of ``/proc/<pid>/fd``), threads (``num_threads``:
  ``/proc/<pid>/stat``), inet connections (``net_connections``: ``/proc/net/tcp*`` filtered by
  the pid's socket inodes) and the cgroup's ``pids.current`` / ``pids.max``.
* :class:`UsageTracker` is pure: fed ``(sample, now)`` it returns the events to emit —
  ``limit_low`` past ``warn_fraction`` (once, re-armed only below ``rearm_fraction``, repeated
  every ``reminder_s`` while it lasts), ``limit_ok`` when it falls back below the re-arm mark,
  ``resource_exhausted`` when a limit is reached. (The server's own limit lines are reported by
  the policy, from :func:`~llama_guard.model.server_log.classify_line`.)

Which numbers are compared:

=============== ============================= ================================================
limit           used                          limit value
=============== ============================= ================================================
RLIMIT_NOFILE   open fds of the pid           the pid's soft RLIMIT_NOFILE
RLIMIT_NPROC    threads of the pid            the pid's soft RLIMIT_NPROC (counts every task
                                              of the uid: the pid's threads are a lower bound)
pids.max        the cgroup's ``pids.current`` the smallest ``pids.max`` up the cgroup path
=============== ============================= ================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import psutil

from llama_guard.limits.own import cgroup_pids
from llama_guard.limits.readback import ProcessLimits, read_limits
from llama_guard.limits.rlimits import NOFILE, NPROC, RLIM_INFINITY, SPEC_BY_NAME, fix_hint
from llama_guard.vocab.events import EventName

PIDS_MAX = "pids.max"
"""The name used in events for the cgroup task limit (systemd ``TasksMax=``)."""


@dataclass(frozen=True)
class UsageSample:
    """One reading of llama-server's resource use and the limits it runs under.

    Counts are ``None`` when not readable. Limits are soft limits; ``None`` or
    :data:`~llama_guard.limits.rlimits.RLIM_INFINITY` means no limit to compare against.
    """

    pid: int
    fds: int | None
    threads: int | None
    connections: int | None = None
    nofile_limit: int | None = None
    nproc_limit: int | None = None
    pids_current: int | None = None
    pids_max: int | None = None

    def usages(self) -> list[tuple[str, int, int, str]]:
        """``(limit name, used, limit value, what)`` for each finite limit with a reading."""
        out: list[tuple[str, int, int, str]] = []
        for name, used, limit, what in (
            (NOFILE.name, self.fds, self.nofile_limit, "open file descriptors"),
            (NPROC.name, self.threads, self.nproc_limit, "threads"),
            (PIDS_MAX, self.pids_current, self.pids_max, "tasks in the cgroup"),
        ):
            if used is not None and limit is not None and limit != RLIM_INFINITY and limit > 0:
                out.append((name, used, limit, what))
        return out


class UsageSampler:
    """Samples one llama-server process (keeps one :class:`psutil.Process` between samples).

    ``limits`` are the pid's limits (default: :func:`~llama_guard.limits.rlimits.read_limits` at
    construction).
    ``connections``: also count inet connections. That costs ~10 ms per count (psutil reads
    every fd link and ``/proc/net/tcp*``; see ``benchmarks/bench_usage_sample.py``) against
    ~0.2 ms for fds + threads, so it is counted on every ``connections_every``-th sample
    only (default 6: once a minute at the default 10 s interval); the samples in between
    carry the last count. Connections are reported, not compared to a limit: each one is an
    fd, already counted against RLIMIT_NOFILE.
    ``cgroup``: also read ``pids.current`` / ``pids.max`` of the pid's cgroup.
    Raises :class:`ProcessLookupError` at construction when the pid does not exist.
    """

    def __init__(self, pid: int, limits: ProcessLimits | None = None, *, connections: bool = True,
                 connections_every: int = 6, cgroup: bool = True) -> None:
        if connections_every < 1:
            raise ValueError(f"connections_every must be >= 1 (got {connections_every})")
        self.pid = pid
        try:
            self._proc = psutil.Process(pid)
        except psutil.NoSuchProcess as exc:
            raise ProcessLookupError(f"no process {pid}") from exc
        self.limits = limits if limits is not None else read_limits(pid)
        self._connections = connections
        self._connections_every = connections_every
        self._count = 0
        self._last_connections: int | None = None
        self._cgroup = cgroup

    def sample(self) -> UsageSample:
        """One :class:`UsageSample`; a count that cannot be read (process gone, no access) is ``None``."""
        proc = self._proc
        fds = threads = None
        conns = self._last_connections
        try:
            fds = proc.num_fds()
            threads = proc.num_threads()
            if self._connections and self._count % self._connections_every == 0:
                conns = self._last_connections = len(proc.net_connections(kind="inet"))
        except (psutil.Error, OSError):
            conns = None
        self._count += 1
        pids_max = pids_current = None
        if self._cgroup:
            pids_max, pids_current = cgroup_pids(self.pid)
        return UsageSample(
            pid=self.pid, fds=fds, threads=threads, connections=conns,
            nofile_limit=self.limits.soft(NOFILE.name), nproc_limit=self.limits.soft(NPROC.name),
            pids_current=pids_current, pids_max=pids_max,
        )


@dataclass(frozen=True)
class UsageEvent:
    """An event to emit: ``Emitter.emit(event.name, **event.fields)``."""

    name: EventName
    fields: dict[str, Any]


@dataclass
class _Watch:
    warned: bool = False
    warned_at: float = 0.0
    reminded_at: float = 0.0
    exhausted: bool = False


_SUGGESTED = {"RLIMIT_NOFILE": 1048576, "RLIMIT_MEMLOCK": RLIM_INFINITY, "RLIMIT_NPROC": RLIM_INFINITY}
_CONSEQUENCE = {
    "RLIMIT_NOFILE": "new connections and files fail with EMFILE (Too many open files)",
    "RLIMIT_NPROC": "thread creation fails with EAGAIN (Resource temporarily unavailable)",
    PIDS_MAX: "thread creation fails with EAGAIN (Resource temporarily unavailable)",
    "RLIMIT_MEMLOCK": "the model cannot be locked in RAM (--mlock) and may be paged out",
}


def _fix(limit: str, suggested: int | None = None) -> str:
    if limit == PIDS_MAX:
        return "TasksMax= in the [Service] section of llama-guard.service, or the container's --pids-limit"
    spec = SPEC_BY_NAME[limit]
    return fix_hint(spec, suggested if suggested is not None else _SUGGESTED[limit])


@dataclass
class UsageTracker:
    """Pure hysteresis over :class:`UsageSample` readings; no I/O, no clock reads.

    ``warn_fraction``: ``limit_low`` when used/limit reaches it. ``rearm_fraction``: the
    warning re-arms (and ``limit_ok`` is returned) only once use falls below it.
    ``reminder_s``: while use stays past ``warn_fraction``, ``limit_low`` again (with
    ``reminder=True``) every this many seconds. A sample of a new pid resets the state (a
    restarted server).
    """

    warn_fraction: float = 0.8
    rearm_fraction: float = 0.7
    reminder_s: float = 3600.0
    pid: int | None = None
    _watch: dict[str, _Watch] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.rearm_fraction < self.warn_fraction <= 1:
            raise ValueError(f"need 0 < rearm_fraction ({self.rearm_fraction}) < warn_fraction "
                             f"({self.warn_fraction}) <= 1")

    @classmethod
    def from_config(cls, limits: Any) -> UsageTracker:
        """A tracker from ``[limits]`` (:class:`~llama_guard.config.sections.LimitsConfig`)."""
        return cls(warn_fraction=limits.warn_fraction, rearm_fraction=limits.rearm_at,
                   reminder_s=limits.reminder_interval_s)

    def _switch_pid(self, pid: int) -> None:
        if pid != self.pid:
            self.pid = pid
            self._watch.clear()

    def update(self, sample: UsageSample, now: float) -> list[UsageEvent]:
        """The events for ``sample`` taken at ``now`` (monotonic seconds)."""
        self._switch_pid(sample.pid)
        events: list[UsageEvent] = []
        for limit, used, value, what in sample.usages():
            watch = self._watch.setdefault(limit, _Watch())
            fraction = used / value
            base: dict[str, Any] = {
                "server_pid": sample.pid, "limit": limit, "resource": what, "used": used,
                "limit_value": value, "fraction": fraction, "warn_fraction": self.warn_fraction,
                "fds": sample.fds, "threads": sample.threads, "connections": sample.connections,
            }
            if used >= value:
                repeat = watch.exhausted and now - watch.reminded_at >= self.reminder_s
                if not watch.exhausted or repeat:
                    watch.exhausted = True
                    watch.reminded_at = now
                    events.append(UsageEvent("resource_exhausted", {
                        **base, "source": "sample", "reminder": repeat,
                        "reason": (f"llama-server pid {sample.pid} uses {used} {what}, its whole {limit} "
                                   f"of {value}: {_CONSEQUENCE[limit]}"),
                        "fix": _fix(limit, _grow(value)),
                    }))
                if not watch.warned:  # reaching the limit implies the warning: no limit_low after it
                    watch.warned, watch.warned_at, watch.reminded_at = True, now, now
                continue
            if fraction >= self.warn_fraction:
                if not watch.warned:
                    watch.warned, watch.warned_at, watch.reminded_at = True, now, now
                    events.append(UsageEvent("limit_low", {**base, "reminder": False, "since_s": 0.0,
                                                           "fix": _fix(limit, _grow(value))}))
                elif now - watch.reminded_at >= self.reminder_s:
                    watch.reminded_at = now
                    events.append(UsageEvent("limit_low", {**base, "reminder": True,
                                                           "since_s": now - watch.warned_at,
                                                           "fix": _fix(limit, _grow(value))}))
            elif fraction < self.rearm_fraction:
                if watch.warned:
                    events.append(UsageEvent("limit_ok", {**base, "since_s": now - watch.warned_at}))
                watch.warned = watch.exhausted = False
        return events


def _grow(value: int) -> int:
    """A suggested new value for a limit that ran out: at least double, at least 65536."""
    return max(value * 2, 65536)


def sample_cost_per_hour(sample_s: float, interval_s: float) -> float:
    """CPU seconds per hour spent sampling: one sample of ``sample_s`` every ``interval_s``."""
    if interval_s <= 0 or math.isinf(interval_s):
        raise ValueError(f"interval_s must be positive and finite (got {interval_s})")
    return sample_s * 3600.0 / interval_s
