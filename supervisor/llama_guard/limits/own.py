"""The daemon's own rlimits and privileges: what it can give the llama-server it starts.

Read from ``resource.getrlimit`` (the daemon's soft/hard pairs), ``/proc/sys/fs/nr_open`` (the kernel's
ceiling for nofile), ``/proc/self/status`` (CapEff: CAP_SYS_RESOURCE) and the cgroup's ``pids.max``.
"""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from llama_guard.limits.rlimits import CAP_SYS_RESOURCE, SPECS, Pair

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


