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
``PR_SET_NO_NEW_PRIVS`` — the way supervisord starts each program as its ``user``. No Python runs
in the child between fork and exec (CPython documents ``preexec_fn`` as unsafe in a process with
threads, which the daemon is): the drop is util-linux ``setpriv``, exec'd as the child's first
program (:func:`drop_argv`), which then execs llama-server; the rlimits are set by the parent
(:mod:`llama_guard.core.child`).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

# Capability numbers (linux/capability.h) of the capabilities named here.
CAP_NUMBERS = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1,
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
    "CAP_CHOWN": "hand the slot directory ([slots]) to [server].user, which writes the KV cache files",
    "CAP_DAC_OVERRIDE": "check, hash, rename and prune the KV cache files llama-server wrote in that directory",
}
# What the GPU reset itself needs, on top of euid 0.
RESET_CAPABILITIES: tuple[str, ...] = ("CAP_SYS_ADMIN",)

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


SETPRIV = "setpriv"  # util-linux (2.33 or later: --pdeathsig); on $PATH


def drop_argv(identity: ServerIdentity, creds: Credentials | None = None) -> list[str]:
    """The exec wrapper that leaves llama-server unprivileged: ``setpriv`` (util-linux) with, in its
    own order, the bounding set emptied (only when llama-guard holds CAP_SETPCAP, which that needs),
    setresgid/setresuid and the supplementary groups of ``identity`` (nothing changed for
    llama-guard's own user), no_new_privs, the inheritable and ambient sets emptied, and
    ``PR_SET_PDEATHSIG`` = SIGKILL last (a credential change clears it). Leaving uid 0 clears the
    effective and permitted sets (capabilities(7)); for llama-guard's own uid, an empty bounding and
    inheritable set leave nothing to gain at exec. A failing step: setpriv writes one line to
    stderr (the server's output pipe) and exits 127 before llama-server runs. ``creds``: llama-guard's
    own (default: read now). Raises FileNotFoundError when setpriv is not on $PATH."""
    setpriv = shutil.which(SETPRIV)
    if setpriv is None:
        raise FileNotFoundError(f"{SETPRIV} (util-linux) is not on $PATH: llama-guard starts llama-server through it")
    creds = creds if creds is not None else read_credentials()
    argv = [setpriv]
    if creds.has("CAP_SETPCAP"):
        argv.append("--bounding-set=-all")
    if identity.uid is not None:
        groups = identity.groups or ()
        argv += [f"--reuid={identity.uid}", f"--regid={identity.gid}",
                 f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"]
    return [*argv, "--no-new-privs", "--inh-caps=-all", "--ambient-caps=-all", "--pdeathsig=KILL", "--"]


def server_identity(user: str, group: str, supplementary_groups: Sequence[str]) -> ServerIdentity:
    """:func:`resolve_identity` checked by :func:`identity_problem`: the identity llama-server can
    be started as. Raises ValueError (a missing user/group, or privileges llama-guard lacks)."""
    identity = resolve_identity(user, group, supplementary_groups)
    problem = identity_problem(identity)
    if problem:
        raise ValueError(problem)
    return identity


def server_user_argv(user: str, group: str, supplementary_groups: Sequence[str]) -> list[str]:
    """The exec wrapper that runs a program as llama-server runs when ``[server].user`` is set
    (:func:`drop_argv` to :func:`server_identity`): how llama-guard runs a build for its ``--version``
    or ``--help``, never as root — a build that account can replace must not gain root's privileges;
    [] when no account is set (llama-guard's own). Raises ValueError (a missing account, privileges
    llama-guard lacks) or FileNotFoundError (no setpriv)."""
    if not user:
        return []
    return drop_argv(server_identity(user, group, supplementary_groups))


def unreachable(path: Path, uid: int, gids: Collection[int], bit: int) -> str:
    """Why ``uid`` (with ``gids``) cannot reach ``path`` and read (bit 4) or execute (bit 1) it; ""
    when it can. Reads only mode bits and owners (no ACLs)."""
    def allowed(st: os.stat_result, want: int) -> bool:
        if st.st_uid == uid:
            return bool(st.st_mode >> 6 & want)
        if st.st_gid in gids:
            return bool(st.st_mode >> 3 & want)
        return bool(st.st_mode & want)

    path = path.absolute()
    try:
        for parent in reversed(path.parents):
            if not allowed(parent.stat(), 1):
                return f"{parent} is not searchable"
        if not allowed(path.stat(), bit):
            return "not readable" if bit == 4 else "not executable"
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def unexecutable_by(identity: ServerIdentity | None, path: Path) -> str:
    """Why llama-server started as ``identity`` could not execute ``path`` (:func:`unreachable`:
    mode bits); "" when it can, or when ``identity`` is None or llama-guard's own user."""
    if identity is None or identity.uid is None:
        return ""
    gids = {g for g in (identity.gid, *(identity.groups or ())) if g is not None}
    blocked = unreachable(path, identity.uid, gids, 1)
    return f"{path}: {blocked} for [server].user (uid {identity.uid})" if blocked else ""
