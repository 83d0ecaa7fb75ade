"""Who llama-guard and llama-server run as: the privilege model, in one place.

llama-guard runs as root (uid 0) with the bounded capability set :data:`DAEMON_CAPABILITIES`
(the unit's ``CapabilityBoundingSet=``; a test checks the two agree) because a GPU reset needs it:
``nvidia-smi --gpu-reset`` asks the NVIDIA kernel driver for an administrator-only operation, and
the driver's test is ``capable(CAP_SYS_ADMIN)`` on the calling task (``os_is_administrator()`` =
``NV_IS_SUSER()``, kernel-open/common/inc/nv-linux.h), while nvidia-smi itself refuses a non-root
caller. So a reset needs euid 0 *and* CAP_SYS_ADMIN in the effective set
(:data:`RESET_CAPABILITIES`, :func:`reset_precondition`).

llama-server, the network-facing process, runs as ``[server].user`` / ``[server].group`` (+
``supplementary_groups`` for the GPU device nodes) with no capabilities at all (effective,
permitted, inheritable, ambient; the bounding set emptied where CAP_SETPCAP allows) and
``PR_SET_NO_NEW_PRIVS`` — the way supervisord starts each program as its ``user``. The drop runs
in the child between fork and exec (:func:`make_drop`), after the rlimits are applied (raising a
hard limit needs the privileges being dropped); everything it needs is resolved before the fork.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import grp
import os
import pwd
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Capability numbers (linux/capability.h) of the capabilities named here.
CAP_NUMBERS = {
    "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21, "CAP_SYS_RESOURCE": 24, "CAP_SYSLOG": 34,
}

# What llama-guard keeps (the unit's CapabilityBoundingSet=), and why. Nothing is ambient.
DAEMON_CAPABILITIES: dict[str, str] = {
    "CAP_SYS_ADMIN": "GPU reset (nvidia-smi --gpu-reset) and [gpu].enable_persistence",
    "CAP_SETUID": "start llama-server as [server].user",
    "CAP_SETGID": "start llama-server as [server].group and supplementary_groups",
    "CAP_SETPCAP": "empty llama-server's capability bounding set",
    "CAP_KILL": "signal llama-server, which runs under another uid",
    "CAP_SYS_RESOURCE": "raise llama-server's rlimits past llama-guard's own and read them back (prlimit)",
    "CAP_SYS_PTRACE": "count llama-server's open fds and its listening socket (/proc/PID/fd)",
    "CAP_SYSLOG": "read Xid lines from /dev/kmsg (kernel.dmesg_restrict=1)",
}
# What the GPU reset itself needs, on top of euid 0.
RESET_CAPABILITIES: tuple[str, ...] = ("CAP_SYS_ADMIN",)

_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_EXIT_DROP_FAILED = 126

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


@dataclass(frozen=True)
class Credentials:
    """What a process may do, from ``/proc/<pid>/status``: ids and capability masks (bit n = cap n)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    cap_eff: int
    cap_prm: int
    cap_inh: int
    cap_amb: int
    cap_bnd: int
    no_new_privs: bool

    def has(self, name: str) -> bool:
        """Whether capability ``name`` (e.g. ``"CAP_SYS_ADMIN"``) is in the effective set."""
        return bool(self.cap_eff >> CAP_NUMBERS[name] & 1)


def read_credentials(status: Path = Path("/proc/self/status")) -> Credentials:
    """Parse ``status`` (default: this process's). Raises OSError when unreadable.

    ``uid``/``gid`` are the effective ids (second column of ``Uid:``/``Gid:``).
    """
    fields: dict[str, str] = {}
    for line in status.read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()

    def mask(key: str) -> int:
        return int(fields.get(key, "0"), 16)

    return Credentials(
        uid=int(fields["Uid"].split()[1]), gid=int(fields["Gid"].split()[1]),
        groups=tuple(int(g) for g in fields.get("Groups", "").split()),
        cap_eff=mask("CapEff"), cap_prm=mask("CapPrm"), cap_inh=mask("CapInh"), cap_amb=mask("CapAmb"),
        cap_bnd=mask("CapBnd"), no_new_privs=fields.get("NoNewPrivs", "0") == "1")


def reset_precondition(creds: Credentials | None = None) -> str:
    """Why a GPU reset is impossible under ``creds`` (default: this process's), "" when possible."""
    if creds is None:
        try:
            creds = read_credentials()
        except (OSError, KeyError, ValueError) as exc:
            return f"llama-guard's credentials cannot be read (/proc/self/status: {exc})"
    missing = [name for name in RESET_CAPABILITIES if not creds.has(name)]
    reasons = []
    if creds.uid != 0:
        reasons.append(f"llama-guard runs as uid {creds.uid}, not root")
    if missing:
        reasons.append(f"llama-guard lacks {', '.join(missing)} in its effective capabilities")
    if not reasons:
        return ""
    return " and ".join(reasons) + " (nvidia-smi --gpu-reset needs root with CAP_SYS_ADMIN)"


@dataclass(frozen=True)
class ServerIdentity:
    """The uid, gid and supplementary gids llama-server runs as; ``None`` fields: unchanged."""

    uid: int | None
    gid: int | None
    groups: tuple[int, ...] | None
    description: str


def _uid(user: str) -> tuple[int, int]:
    """(uid, primary gid) of a user name or number."""
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, ValueError):
        if user.isdigit():
            return int(user), int(user)
        raise ValueError(f"[server].user: no such user {user!r} (create it: see deploy/install.sh)") from None
    return entry.pw_uid, entry.pw_gid


def _gid(group: str, key: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"{key}: no such group {group!r}") from None


def resolve_identity(user: str, group: str, supplementary_groups: Sequence[str]) -> ServerIdentity:
    """Resolve the ``[server]`` user/group names (or numbers). Raises ValueError naming the key.

    ``user`` "" keeps llama-guard's own uid (and then ``group`` / ``supplementary_groups`` must be
    empty too); ``group`` "" means the user's primary group.
    """
    if not user:
        if group or supplementary_groups:
            raise ValueError("[server].group and supplementary_groups need [server].user")
        return ServerIdentity(None, None, None, "llama-guard's own user")
    uid, primary = _uid(user)
    gid = _gid(group, "[server].group") if group else primary
    groups = tuple(dict.fromkeys(_gid(g, "[server].supplementary_groups") for g in supplementary_groups))
    return ServerIdentity(uid, gid, groups, f"uid {uid} ({user}), gid {gid}, groups {list(groups)}")


def identity_problem(identity: ServerIdentity, creds: Credentials | None = None) -> str:
    """Why llama-guard could not start llama-server as ``identity`` ("" when it can)."""
    if identity.uid is None:
        return ""
    creds = creds if creds is not None else read_credentials()
    if identity.uid == creds.uid and identity.gid == creds.gid:
        return ""
    missing = [c for c in ("CAP_SETUID", "CAP_SETGID") if not creds.has(c)]
    if missing:
        return (f"llama-server should run as {identity.description}, but llama-guard (uid {creds.uid}) "
                f"lacks {' and '.join(missing)}")
    return ""


def make_drop(identity: ServerIdentity, parent_pid: int) -> Callable[[], None]:
    """The preexec step that leaves llama-server unprivileged; call it after the rlimits are set.

    In order: clear the ambient set; empty the bounding set (needs CAP_SETPCAP, skipped per
    capability where refused); setgroups, setresgid, setresuid to ``identity``; capset all
    three sets to zero (setuid away from root clears effective/permitted but not inheritable);
    ``PR_SET_NO_NEW_PRIVS``; and ``PR_SET_PDEATHSIG`` again, since a credential change clears it.
    A failing step writes one line to stderr (the server's output pipe) and exits 126 before exec.
    """
    prctl = _libc.prctl
    capset = _libc.capset
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    try:
        last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last_cap = 63
    caps = tuple(range(last_cap + 1))
    uid, gid, groups = identity.uid, identity.gid, identity.groups
    fail_ids = f"llama-guard: cannot switch llama-server to {identity.description}\n".encode()
    fail_caps = b"llama-guard: cannot clear llama-server's capabilities (capset)\n"
    fail_nnp = b"llama-guard: cannot set no_new_privs for llama-server\n"

    def drop() -> None:
        prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        for cap in caps:
            prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
        try:
            if groups is not None:
                os.setgroups(groups)
            if gid is not None:
                os.setresgid(gid, gid, gid)
            if uid is not None:
                os.setresuid(uid, uid, uid)
        except OSError:
            os.write(2, fail_ids)
            os._exit(_EXIT_DROP_FAILED)
        if capset(ctypes.byref(header), data) != 0:
            os.write(2, fail_caps)
            os._exit(_EXIT_DROP_FAILED)
        if prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            os.write(2, fail_nnp)
            os._exit(_EXIT_DROP_FAILED)
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the daemon died in between
            os._exit(1)

    return drop


def server_identity(user: str, group: str, supplementary_groups: Sequence[str]) -> ServerIdentity:
    """:func:`resolve_identity` checked by :func:`identity_problem`: the identity llama-server can
    be started as. Raises ValueError (a missing user/group, or privileges llama-guard lacks)."""
    identity = resolve_identity(user, group, supplementary_groups)
    problem = identity_problem(identity)
    if problem:
        raise ValueError(problem)
    return identity


def child_hooks(before_drop: Sequence[Callable[[], None]], identity: ServerIdentity,
                parent_pid: int) -> Callable[[], None]:
    """The one preexec step of every llama-server child (the daemon's and ``bench --spawn``'s):
    ``before_drop`` in order (the rlimits: raising a hard limit needs the privileges the drop then
    takes away), then :func:`make_drop` to ``identity``. Async-signal-safe work only."""
    hooks = (*before_drop, make_drop(identity, parent_pid))

    def run_all() -> None:
        for hook in hooks:
            hook()

    return run_all
