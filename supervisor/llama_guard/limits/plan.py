"""The plan for llama-server's rlimits: what to set in the child (before exec) and why.

Pure given its inputs (the config, the daemon's own limits and privileges); set on the child by
the parent before the child's exec (:class:`llama_guard.core.child.ChildSetup`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llama_guard.config.limit_values import parse_limit_value
from llama_guard.limits.own import OwnLimits
from llama_guard.limits.rlimits import (
    MEMLOCK,
    NOFILE,
    NPROC,
    RLIM_INFINITY,
    SPECS,
    LimitSpec,
    Pair,
    fix_hint,
    format_limit,
    order_of,
)

if TYPE_CHECKING:
    from llama_guard.config import Config

# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


class LimitAction(enum.Enum):
    """What the plan does with one limit."""

    INHERIT = "inherit"  # not configured: the child inherits the daemon's limit
    SET = "set"          # within the daemon's hard limit: soft = hard = wanted
    RAISE = "raise"      # above the daemon's hard limit, privileged: soft = hard = wanted
    CAPPED = "capped"    # above what may be set: soft = hard = the best reachable value


@dataclass(frozen=True)
class LimitDecision:
    """The decision on one limit.

    ``configured`` is the config's value (``None``: not set; for memlock, ``"unlimited"``
    when ``[server].mlock`` implied it); ``wanted`` the parsed value; ``own`` the daemon's
    (soft, hard); ``target`` the (soft, hard) the child gets (``None`` for INHERIT);
    ``problem`` a full human sentence when the child gets less than wanted; ``note`` an
    informational remark.
    """

    spec: LimitSpec
    configured: int | str | None
    wanted: int | None
    own: Pair
    action: LimitAction
    target: Pair | None
    problem: str = ""
    note: str = ""

    @property
    def effective(self) -> Pair:
        """The (soft, hard) the child should run with."""
        return self.target if self.target is not None else self.own


@dataclass(frozen=True)
class LimitPlan:
    """What to set on the child (see :func:`plan_child_limits`).

    ``settings`` holds ``(resource, (soft, hard))`` pairs for the child's set-up
    (:class:`llama_guard.core.child.ChildSetup`: set by the parent with prlimit(2) before the exec).
    ``thread_notes`` are warnings about ``--threads``/``--threads-batch`` against the CPUs and
    the process/task limits.
    """

    decisions: tuple[LimitDecision, ...]
    settings: tuple[tuple[int, Pair], ...]
    thread_notes: tuple[str, ...] = ()
    estimated_threads: int | None = None

    def decision(self, name: str) -> LimitDecision:
        """The decision for ``name`` (``"RLIMIT_NOFILE"``…); raises KeyError."""
        for d in self.decisions:
            if d.spec.name == name:
                return d
        raise KeyError(name)


def _wanted(cfg: Config, spec: LimitSpec) -> tuple[int | str | None, str]:
    raw: int | str | None = getattr(cfg.limits, spec.key)
    if spec is MEMLOCK and raw is None and cfg.server.mlock:
        return "unlimited", "memlock defaults to unlimited because [server].mlock is true"
    return raw, ""


def _why_unprivileged(euid: int) -> str:
    if euid == 0:
        return ("root without CAP_SYS_RESOURCE: a container or a unit whose capability bounding set "
                "drops it")
    return f"euid {euid}, not root and no CAP_SYS_RESOURCE"


def _decide(spec: LimitSpec, raw: int | str | None, own: Pair, privileged: bool, nr_open: int | None,
            euid: int, note: str) -> LimitDecision:
    if raw is None:
        return LimitDecision(spec, raw, None, own, LimitAction.INHERIT, None, note=note)
    wanted = parse_limit_value(raw, sizes=spec is MEMLOCK)
    reachable = wanted
    problem = ""
    if spec is NOFILE and nr_open is not None and order_of(wanted) > nr_open:
        # The kernel refuses RLIMIT_NOFILE above fs.nr_open, even to root.
        reachable = nr_open
        if wanted == RLIM_INFINITY:
            note = (note + "; " if note else "") + f"nofile \"unlimited\" means fs.nr_open = {nr_open}"
        else:
            problem = (f"{spec.name}: configured {wanted} {spec.unit}, but the kernel caps it at "
                       f"fs.nr_open = {nr_open}; llama-server gets {nr_open}. "
                       f"Raise the ceiling with `sysctl -w fs.nr_open={wanted}` (and in /etc/sysctl.d/).")
    hard = own[1]
    if order_of(reachable) <= order_of(hard):
        return LimitDecision(spec, raw, wanted, own, LimitAction.SET, (reachable, reachable), problem, note)
    if privileged:
        return LimitDecision(spec, raw, wanted, own, LimitAction.RAISE, (reachable, reachable), problem, note)
    # Not privileged: the soft limit may go up to the hard one, no further.
    problem = (f"{spec.name} ({spec.what}): llama-server needs {format_limit(wanted, spec.unit)} but "
               f"llama-guard runs with a hard limit of {format_limit(hard, spec.unit)} and cannot "
               f"raise it ({_why_unprivileged(euid)}); llama-server gets "
               f"{format_limit(hard, spec.unit)}. Raise it with {fix_hint(spec, wanted)}.")
    return LimitDecision(spec, raw, wanted, own, LimitAction.CAPPED, (hard, hard), problem, note)


def estimate_server_threads(threads: int | None, threads_batch: int | None, parallel: int,
                            cpu_count: int) -> int:
    """About how many threads llama-server runs: main + compute pool + HTTP pool + a margin.

    Compute: ``max(--threads, --threads-batch)`` (unset: the CPU count). HTTP: llama-server's
    default ``--threads-http`` = ``max(parallel + 2, cpu_count - 1)``. Margin: 4 (logger,
    GPU runtime helpers). An estimate for a warning, not an exact count.
    """
    compute = max(threads or cpu_count, threads_batch or threads or cpu_count)
    http = max(parallel + 2, cpu_count - 1)
    return 1 + compute + http + 4


def _thread_notes(cfg: Config, own: OwnLimits, nproc: Pair, privileged: bool) -> tuple[int | None,
                                                                                       tuple[str, ...]]:
    srv = cfg.server
    if own.cpu_count is None:
        return None, ()
    notes: list[str] = []
    for flag, value in (("threads", srv.threads), ("threads_batch", srv.threads_batch)):
        if value is not None and value > own.cpu_count:
            notes.append(f"[server].{flag} = {value} exceeds the {own.cpu_count} CPUs llama-guard may run on: "
                         f"oversubscribed threads slow generation down; set it to {own.cpu_count} or less")
    estimate = estimate_server_threads(srv.threads, srv.threads_batch, srv.parallel, own.cpu_count)
    soft = nproc[0]
    if not privileged and soft != RLIM_INFINITY and estimate > soft:
        notes.append(f"RLIMIT_NPROC is {soft} but llama-server needs about {estimate} threads "
                     f"(and the limit counts every thread of uid {own.euid}); thread creation would fail "
                     f"with 'Resource temporarily unavailable'. Raise it with {fix_hint(NPROC, estimate * 4)}.")
    if own.pids_max is not None:
        free = own.pids_max - (own.pids_current or 0)
        if estimate > free:
            notes.append(f"the cgroup's pids.max is {own.pids_max} with {own.pids_current} tasks in use; "
                         f"llama-server needs about {estimate} threads. Raise TasksMax= in "
                         f"llama-guard.service (or the container's --pids-limit).")
    return estimate, tuple(notes)


def plan_child_limits(cfg: Config, own_limits: OwnLimits, is_root: bool) -> LimitPlan:
    """Decide the (soft, hard) of RLIMIT_NOFILE, RLIMIT_MEMLOCK and RLIMIT_NPROC for the server.

    Pure: reads ``cfg.limits`` (``nofile``, ``memlock``, ``nproc``), ``cfg.server`` (``mlock``,
    ``threads``, ``threads_batch``, ``parallel``) and ``own_limits``; ``is_root`` means the
    daemon may raise hard limits (:func:`can_raise_hard_limits`). For each limit:

    ============================ ======================= ================================
    situation                    child gets (soft, hard) report
    ============================ ======================= ================================
    not configured               inherited               --
    wanted ≤ daemon's hard       (wanted, wanted)        --
    wanted > hard, privileged    (wanted, wanted)        --
    wanted > hard, unprivileged  (hard, hard)            ``problem`` naming the fix
    nofile > fs.nr_open          (nr_open, nr_open)      ``problem`` (``unlimited``: note)
    ============================ ======================= ================================

    memlock defaults to ``unlimited`` when ``[server].mlock`` is true and ``memlock`` is unset.
    Raises :class:`ValueError` for an unparsable configured value (the config validator
    normally catches it first).
    """
    decisions: list[LimitDecision] = []
    for spec in SPECS:
        raw, note = _wanted(cfg, spec)
        own = own_limits.rlimits.get(spec.name, (RLIM_INFINITY, RLIM_INFINITY))
        decisions.append(_decide(spec, raw, own, is_root, own_limits.nr_open, own_limits.euid, note))
    settings = tuple((d.spec.resource, d.target) for d in decisions if d.target is not None)
    nproc = next(d.effective for d in decisions if d.spec is NPROC)
    estimate, notes = _thread_notes(cfg, own_limits, nproc, is_root)
    return LimitPlan(tuple(decisions), settings, notes, estimate)
