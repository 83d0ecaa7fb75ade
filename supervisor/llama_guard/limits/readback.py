"""Reading a process's limits back (``/proc/<pid>/limits``) and checking them against the plan.

What the kernel really gave the child — a raise can be refused silently (a user namespace, a missing
capability) — so every start is verified and the difference named with the setting that fixes it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from llama_guard.limits.plan import LimitPlan
from llama_guard.limits.rlimits import RLIM_INFINITY, SPECS, Pair, fix_hint, format_limit

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
