"""Resource limits of llama-server: parse, decide, apply in the child, read back.

Three rlimits matter to llama-server (docs/llama-server.md, "Resource limits"):

* ``RLIMIT_NOFILE`` (open files, a count): every HTTP connection is a file descriptor.
* ``RLIMIT_MEMLOCK`` (locked memory, bytes): ``--mlock`` locks the whole model in RAM.
* ``RLIMIT_NPROC`` (processes, a count): on Linux it counts every *thread* of every process of
  the child's real uid; thread creation fails with ``Resource temporarily unavailable`` (EAGAIN)
  when it is reached, as it does at the cgroup's ``pids.max`` (systemd's ``TasksMax=``).

The flow, as the daemon uses it::

    own = read_own_limits()                                   # at start, once per spawn
    plan = plan_child_limits(cfg, own, can_raise_hard_limits())
    for d in plan.decisions: d.problem and emit("limit_not_raised", ...)
    spawn(argv, env, ChildSetup(wrapper, plan.settings))      # prlimit(2) before the exec
    applied = read_limits(child.pid)                          # read back from the process
    for text in verify_applied(plan, applied): emit("limit_not_raised", ...)

:func:`plan_child_limits` is pure (no I/O, no clock); the parent sets the planned pairs on the
child while it waits before its exec (:class:`llama_guard.core.child.ChildSetup`): no code of
ours runs in the forked child.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from typing import Literal

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

def order_of(value: int) -> float:
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
