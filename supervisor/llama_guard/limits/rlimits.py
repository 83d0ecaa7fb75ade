"""Resource limits of llama-server: parse, decide, apply in the child, read back.

Three rlimits matter to llama-server (see ``/work/shared/facts/llama-server.md``, family 5):

* ``RLIMIT_NOFILE`` (open files, a count): every HTTP connection is a file descriptor.
* ``RLIMIT_MEMLOCK`` (locked memory, bytes): ``--mlock`` locks the whole model in RAM.
* ``RLIMIT_NPROC`` (processes, a count): on Linux it counts every *thread* of every process of
  the child's real uid; thread creation fails with ``Resource temporarily unavailable`` (EAGAIN)
  when it is reached, as it does at the cgroup's ``pids.max`` (systemd's ``TasksMax=``).

The flow, as the daemon uses it::

    own = read_own_limits()                                   # at start, once per spawn
    plan = plan_child_limits(cfg, own, can_raise_hard_limits())
    for problem in plan.problems: emit("limit_not_raised", ...)
    Popen(argv, preexec_fn=plan.preexec)                      # apply_in_child(plan)
    applied = read_limits(child.pid)                          # read back from the process
    for text in verify_applied(plan, applied): emit("limit_not_raised", ...)

:func:`plan_child_limits` is pure (no I/O, no clock); :func:`apply_in_child` is the only code
that runs in the forked child and only calls :func:`resource.setrlimit` with integers computed
in the parent.
"""

from __future__ import annotations

import enum
import math
import os
import re
import resource
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import psutil

if TYPE_CHECKING:
    from llama_guard.config import Config

from llama_guard.config import parse_limit_value

RLIM_INFINITY: int = resource.RLIM_INFINITY
"""The kernel's "unlimited" (``-1`` as Python's :mod:`resource` and psutil spell it on Linux)."""

CAP_SYS_RESOURCE = 24
"""Bit number of ``CAP_SYS_RESOURCE`` in ``/proc/<pid>/status`` ``CapEff`` (linux/capability.h)."""

Pair = tuple[int, int]


@dataclass(frozen=True)
class LimitSpec:
    """What is fixed about one rlimit: its names, unit and where an operator raises it.

    ``key`` is the ``[limits]`` config key; ``proc_name`` the row of ``/proc/<pid>/limits``;
    ``systemd`` the unit directive; ``ulimit`` the shell flag (``ulimit -l`` counts KiB, the
    others the limit's own unit); ``docker`` the ``--ulimit`` name (bytes for memlock).
    """

    name: str
    resource: int
    key: Literal["nofile", "memlock", "nproc"]
    unit: Literal["files", "bytes", "processes"]
    proc_name: str
    systemd: str
    ulimit: str
    docker: str
    what: str


NOFILE = LimitSpec("RLIMIT_NOFILE", resource.RLIMIT_NOFILE, "nofile", "files", "Max open files",
                   "LimitNOFILE", "-n", "nofile", "open files")
MEMLOCK = LimitSpec("RLIMIT_MEMLOCK", resource.RLIMIT_MEMLOCK, "memlock", "bytes", "Max locked memory",
                    "LimitMEMLOCK", "-l", "memlock", "locked memory")
NPROC = LimitSpec("RLIMIT_NPROC", resource.RLIMIT_NPROC, "nproc", "processes", "Max processes",
                  "LimitNPROC", "-u", "nproc", "processes/threads of the uid")
SPECS: tuple[LimitSpec, ...] = (NOFILE, MEMLOCK, NPROC)
SPEC_BY_NAME: dict[str, LimitSpec] = {spec.name: spec for spec in SPECS}
SPEC_BY_KEY: dict[str, LimitSpec] = {spec.key: spec for spec in SPECS}


# --------------------------------------------------------------------------------------------
# Parsing and formatting
# --------------------------------------------------------------------------------------------

def _order(value: int) -> float:
    """A limit as a comparable number: :data:`RLIM_INFINITY` is +∞."""
    return math.inf if value == RLIM_INFINITY else float(value)


def format_limit(value: int | None, unit: str = "") -> str:
    """A limit for humans: ``unlimited``, ``1048576``, or for bytes ``64 MiB (67108864 bytes)``."""
    if value is None:
        return "(inherited)"
    if value == RLIM_INFINITY:
        return "unlimited"
    if unit == "bytes" and value >= 1024:
        for shift, name in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
            if value >= 1 << shift:
                amount = value / (1 << shift)
                text = f"{amount:.0f}" if amount == int(amount) else f"{amount:.1f}"
                return f"{text} {name} ({value} bytes)"
    return str(value)


def fix_hint(spec: LimitSpec, wanted: int) -> str:
    """Where an operator raises ``spec`` to ``wanted``: the unit directive, the shell, the container.

    ``ulimit -l`` counts KiB, so memlock is converted; ``unlimited`` reads as ``infinity``
    for systemd and ``-1`` for ``docker run --ulimit``.
    """
    if wanted == RLIM_INFINITY:
        systemd, shell, docker = "infinity", "unlimited", "-1"
    else:
        systemd = docker = str(wanted)
        shell = str(-(-wanted // 1024)) if spec is MEMLOCK else str(wanted)
    return (f"{spec.systemd}={systemd} in the [Service] section of llama-guard.service, "
            f"`ulimit -H{spec.ulimit[1:]} {shell}` (as root) in the shell that starts llama-guard, "
            f"or `--ulimit {spec.docker}={docker}:{docker}` on its container")


# --------------------------------------------------------------------------------------------
# The daemon's own situation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OwnLimits:
    """What the daemon sees of itself before it spawns the server (an input of the plan).

    ``rlimits`` maps a limit name (``"RLIMIT_NOFILE"``…) to its (soft, hard), from
    :func:`resource.getrlimit`. ``nr_open`` is ``/proc/sys/fs/nr_open``, the kernel's ceiling
    on ``RLIMIT_NOFILE`` even for root. ``cpu_count`` is the CPUs this process may run on
    (``os.sched_getaffinity``, else ``os.cpu_count``). ``pids_max`` / ``pids_current`` are the
    smallest cgroup ``pids.max`` on the path of the daemon's cgroup (systemd's ``TasksMax=``)
    and that cgroup's ``pids.current``; ``None`` where unreadable or ``max``.
    """

    rlimits: Mapping[str, Pair]
    nr_open: int | None = None
    cpu_count: int | None = None
    pids_max: int | None = None
    pids_current: int | None = None
    euid: int = 0


def can_raise_hard_limits(status_path: str = "/proc/self/status") -> bool:
    """Whether this process may raise a hard rlimit: ``CAP_SYS_RESOURCE`` in its effective set.

    Read from ``CapEff`` in ``/proc/self/status``; falls back to ``euid == 0`` when that file
    is unreadable. Inside a user namespace (rootless containers) the bit can be set while the
    kernel still refuses: :func:`verify_applied` catches that after the spawn.
    """
    try:
        text = Path(status_path).read_text()
    except OSError:
        return os.geteuid() == 0
    match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", text, re.MULTILINE)
    if match is None:
        return os.geteuid() == 0
    return bool(int(match.group(1), 16) >> CAP_SYS_RESOURCE & 1)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_pids(pid: int | str = "self", root: str = "/sys/fs/cgroup",
                proc: str = "/proc") -> tuple[int | None, int | None]:
    """(``pids.max``, ``pids.current``) of the cgroup of ``pid``, from ``/proc/<pid>/cgroup``.

    ``pids.max`` is the smallest finite one from the process's cgroup up to the root (a parent's
    cap applies too); cgroup v2 (``0::/path``) and v1 (``…:pids:/path``) are both read. Either
    value is ``None`` when not readable (no pids controller, ``max``, no permission).
    """
    try:
        lines = Path(proc, str(pid), "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    candidates: list[tuple[Path, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hier, controllers, rel = parts
        if "pids" in controllers.split(","):
            candidates.append((Path(root, "pids"), rel))
        elif _hier == "0" and controllers == "":
            candidates.append((Path(root), rel))
    for base, rel in candidates:
        leaf = base / rel.lstrip("/")
        current = _read_int(leaf / "pids.current")
        smallest: int | None = None
        for directory in (leaf, *leaf.parents):
            if directory != base and base not in directory.parents:
                break
            value = _read_int(directory / "pids.max")
            if value is not None and (smallest is None or value < smallest):
                smallest = value
        if current is not None or smallest is not None:
            return smallest, current
    return None, None


def read_own_limits() -> OwnLimits:
    """The daemon's own limits and host ceilings (see :class:`OwnLimits`); reads ``/proc``."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else os.cpu_count()
    pids_max, pids_current = cgroup_pids("self")
    return OwnLimits(
        rlimits={spec.name: resource.getrlimit(spec.resource) for spec in SPECS},
        nr_open=_read_int(Path("/proc/sys/fs/nr_open")),
        cpu_count=cpus,
        pids_max=pids_max,
        pids_current=pids_current,
        euid=os.geteuid(),
    )


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

    ``settings`` holds only ints and tuples, built in the parent, for :func:`apply_in_child`.
    ``thread_notes`` are warnings about ``--threads``/``--threads-batch`` against the CPUs and
    the process/task limits.
    """

    decisions: tuple[LimitDecision, ...]
    settings: tuple[tuple[int, Pair], ...]
    thread_notes: tuple[str, ...] = ()
    estimated_threads: int | None = None

    @property
    def problems(self) -> tuple[str, ...]:
        """One sentence per limit the child gets less of than configured."""
        return tuple(d.problem for d in self.decisions if d.problem)

    def decision(self, name: str) -> LimitDecision:
        """The decision for ``name`` (``"RLIMIT_NOFILE"``…); raises KeyError."""
        for d in self.decisions:
            if d.spec.name == name:
                return d
        raise KeyError(name)

    def preexec(self) -> None:
        """``preexec_fn`` for :class:`subprocess.Popen`: :func:`apply_in_child` on this plan."""
        apply_in_child(self)


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
    if spec is NOFILE and nr_open is not None and _order(wanted) > nr_open:
        # The kernel refuses RLIMIT_NOFILE above fs.nr_open, even to root.
        reachable = nr_open
        if wanted == RLIM_INFINITY:
            note = (note + "; " if note else "") + f"nofile \"unlimited\" means fs.nr_open = {nr_open}"
        else:
            problem = (f"{spec.name}: configured {wanted} {spec.unit}, but the kernel caps it at "
                       f"fs.nr_open = {nr_open}; llama-server gets {nr_open}. "
                       f"Raise the ceiling with `sysctl -w fs.nr_open={wanted}` (and in /etc/sysctl.d/).")
    hard = own[1]
    if _order(reachable) <= _order(hard):
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


def apply_in_child(plan: LimitPlan) -> None:
    """Set the plan's limits on the current process; meant to run as ``preexec_fn``.

    Runs between fork and exec: only :func:`resource.setrlimit` calls on integers the parent
    computed, no imports, no I/O. Errors (``OSError``, ``ValueError``) are ignored here: the
    parent predicted them in the plan and :func:`verify_applied` reports what really happened.
    """
    setrlimit = resource.setrlimit
    for res, pair in plan.settings:
        try:  # noqa: SIM105 - no contextlib object between fork and exec
            setrlimit(res, pair)
        except (OSError, ValueError):
            pass


# --------------------------------------------------------------------------------------------
# Reading limits back
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessLimits:
    """The rlimits of one running process: name → (soft, hard), and where they were read."""

    pid: int
    values: Mapping[str, Pair]
    source: str = field(default="psutil")

    def soft(self, name: str) -> int | None:
        """The soft limit ``name`` (``"RLIMIT_NOFILE"``…), ``None`` if not read."""
        pair = self.values.get(name)
        return None if pair is None else pair[0]


_PROC_ROW = re.compile(r"^(Max [A-Za-z ]+?)\s{2,}(\S+)\s+(\S+)")


def parse_proc_limits(text: str) -> dict[str, Pair]:
    """Parse the text of ``/proc/<pid>/limits`` into ``{"RLIMIT_NOFILE": (soft, hard), …}``.

    Only the rows of :data:`SPECS` are returned; ``unlimited`` becomes :data:`RLIM_INFINITY`.
    """
    by_row = {spec.proc_name: spec.name for spec in SPECS}
    out: dict[str, Pair] = {}
    for line in text.splitlines():
        match = _PROC_ROW.match(line)
        if match is None or match.group(1) not in by_row:
            continue
        soft, hard = (RLIM_INFINITY if v == "unlimited" else int(v) for v in match.group(2, 3))
        out[by_row[match.group(1)]] = (soft, hard)
    return out


def read_limits(pid: int) -> ProcessLimits:
    """The NOFILE/MEMLOCK/NPROC limits of process ``pid``, as the kernel applies them.

    Tries psutil's ``Process.rlimit`` (the ``prlimit(2)`` syscall: needs the same uid or
    ``CAP_SYS_RESOURCE``), then falls back to parsing ``/proc/<pid>/limits`` (world-readable).
    ``source`` says which: ``"psutil"`` or ``"/proc/<pid>/limits"``. Raises
    :class:`ProcessLookupError` when the process does not exist, :class:`PermissionError` when
    neither source is readable.
    """
    try:
        proc = psutil.Process(pid)
        values = {spec.name: tuple(proc.rlimit(spec.resource)) for spec in SPECS}
        return ProcessLimits(pid, {k: (int(v[0]), int(v[1])) for k, v in values.items()}, "psutil")
    except psutil.NoSuchProcess as exc:
        raise ProcessLookupError(f"no process {pid}") from exc
    except (psutil.AccessDenied, OSError, AttributeError):
        pass
    path = f"/proc/{pid}/limits"
    try:
        text = Path(path).read_text()
    except FileNotFoundError as exc:
        raise ProcessLookupError(f"no process {pid}") from exc
    return ProcessLimits(pid, parse_proc_limits(text), path)


def verify_applied(plan: LimitPlan, applied: ProcessLimits) -> list[str]:
    """Sentences for each limit whose read-back value differs from the plan's target.

    Catches what the plan could not predict: a user namespace refusing to raise a hard limit,
    a seccomp filter, a wrapper that resets limits. Unplanned (INHERIT) limits are not checked.
    """
    out: list[str] = []
    for d in plan.decisions:
        if d.target is None:
            continue
        got = applied.values.get(d.spec.name)
        if got is None or got == d.target:
            continue
        unit = d.spec.unit
        out.append(f"{d.spec.name}: llama-server pid {applied.pid} runs with soft "
                   f"{format_limit(got[0], unit)} / hard {format_limit(got[1], unit)} "
                   f"(read from {applied.source}), not the planned {format_limit(d.target[0], unit)}; "
                   f"the kernel refused to raise it. Raise it with {fix_hint(d.spec, d.target[0])}.")
    return out


def limits_report(plan: LimitPlan, applied: ProcessLimits | None = None) -> list[dict[str, str]]:
    """Rows for ``llama-guard check`` / ``status``: limit, configured, planned, effective, source.

    ``effective`` is the read-back value when ``applied`` is given, else ``-``.
    """
    rows = []
    for d in plan.decisions:
        unit = d.spec.unit
        eff = applied.values.get(d.spec.name) if applied is not None else None
        rows.append({
            "limit": d.spec.name,
            "configured": ("(unset)" if d.configured is None else format_limit(d.configured, unit)
                           if isinstance(d.configured, int) else str(d.configured)),
            "daemon": f"{format_limit(d.own[0], unit)} / {format_limit(d.own[1], unit)}",
            "planned": (f"{format_limit(d.target[0], unit)} / {format_limit(d.target[1], unit)}"
                        if d.target is not None else "(inherited)"),
            "effective": (f"{format_limit(eff[0], unit)} / {format_limit(eff[1], unit)}"
                          if eff is not None else "-"),
            "source": applied.source if applied is not None else "-",
            "action": d.action.value,
        })
    return rows
