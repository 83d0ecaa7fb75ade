"""``check`` rows about the process llama-server would be: the account it runs as (and whether it
reaches its binary, model and key file), its API key, the rlimits it would get."""

from __future__ import annotations

import os
from pathlib import Path

from llama_guard.config import Config, ConfigError
from llama_guard.config.api_key import read_api_key
from llama_guard.config.argv import resolve_binary
from llama_guard.core.privileges import (
    Credentials,
    drop_argv,
    identity_problem,
    read_credentials,
    resolve_identity,
    unreachable,
)
from llama_guard.vocab.verdicts import CheckResult, Verdict


def check_credentials(config: Config, *, creds: Credentials | None = None) -> list[CheckResult]:
    """Who llama-server would run as, and whether llama-guard can start it so: ``[server].user``
    resolves, llama-guard has CAP_SETUID/CAP_SETGID for the switch, and the binary and model are
    reachable by that user (the mode bits of each path component); ``setpriv`` is there to start it.
    WARN when llama-server would run as root, FAIL when it could not be started as configured."""
    server = config.server
    creds = creds if creds is not None else read_credentials()
    try:
        identity = resolve_identity(server.user, server.group, server.supplementary_groups)
    except ValueError as exc:
        return [CheckResult("server user", Verdict.FAIL, str(exc))]
    problem = identity_problem(identity, creds)
    if problem:
        return [CheckResult("server user", Verdict.FAIL, problem)]
    try:  # the wrapper every llama-server child is started through
        drop_argv(identity, creds)
    except FileNotFoundError as exc:
        return [CheckResult("server user", Verdict.FAIL, str(exc))]
    if identity.uid is None:
        if creds.uid == 0:
            return [CheckResult("server user", Verdict.WARN, "llama-server would run as root (without capabilities): "
                                                       "set [server].user to an unprivileged account")]
        return [CheckResult("server user", Verdict.OK, f"llama-server runs as llama-guard's own uid {creds.uid}, "
                                                 "without capabilities")]
    results = [CheckResult("server user", Verdict.OK, f"llama-server runs as {identity.description}, "
                                                "without capabilities, no_new_privs")]
    assert identity.gid is not None
    gids = {identity.gid, *(identity.groups or ())}
    binary = resolve_binary(server.binary)
    for what, path, bit in (("binary", binary, 1), ("model", Path(server.model), 4),
                            ("api key file", Path(server.api_key_file) if server.api_key_file else None, 4)):
        if path is None:
            continue
        blocked = unreachable(path, identity.uid, gids, bit)
        if blocked:
            results.append(CheckResult("server user", Verdict.FAIL, f"{what} {path}: {blocked} for uid {identity.uid}"))
    return results


def check_api_key(config: Config) -> CheckResult:
    """``[server].api_key_file`` can be read (the key is not shown), and a non-loopback ``host``
    has one (WARN otherwise: anyone reaching the port can use the model)."""
    server = config.server
    try:
        key = read_api_key(server)
    except ConfigError as exc:
        return CheckResult("api key", Verdict.FAIL, exc.lines[0])
    if not key:
        if server.loopback:
            return CheckResult("api key", Verdict.OK, f"none; {server.host} is loopback only")
        return CheckResult("api key", Verdict.WARN,
                           f"llama-server listens on {server.host}, beyond loopback, without an "
                           "API key: set [server].api_key_file")
    try:
        others = os.stat(server.api_key_file).st_mode & 0o007
    except OSError:
        others = 0
    if others:
        return CheckResult("api key", Verdict.WARN, f"{server.api_key_file} is readable by every local user: "
                                                    f"chmod o-rwx {server.api_key_file}")
    return CheckResult("api key", Verdict.OK, f"{server.api_key_file} (sent by llama-guard's probes as a Bearer token)")


def check_limits(config: Config) -> list[CheckResult]:
    """The rlimits llama-server would get: configured, the daemon's own, what the child gets.

    Plans exactly as the daemon does before a spawn (:func:`llama_guard.limits.rlimits.plan_child_limits`
    on this process's own limits and privileges), so the answer holds for a daemon run by the
    same user under the same limits. A limit the server would get less of than configured is
    WARN with the fix, as is each thread note (``--threads`` vs CPUs, RLIMIT_NPROC, ``pids.max``).
    """
    from llama_guard.limits.own import can_raise_hard_limits, read_own_limits
    from llama_guard.limits.plan import plan_child_limits
    from llama_guard.limits.readback import limits_report

    try:
        plan = plan_child_limits(config, read_own_limits(), can_raise_hard_limits())
    except ValueError as exc:
        return [CheckResult("limits", Verdict.FAIL, str(exc))]
    results = []
    for row, decision in zip(limits_report(plan), plan.decisions, strict=True):
        detail = (f"configured {row['configured']}; llama-guard has {row['daemon']} (soft / hard); "
                  f"llama-server gets {row['planned']}")
        if decision.note:
            detail += f" ({decision.note})"
        if decision.problem:
            results.append(CheckResult(row["limit"], Verdict.WARN, f"{detail}. {decision.problem}"))
        else:
            results.append(CheckResult(row["limit"], Verdict.OK, detail))
    results += [CheckResult("threads", Verdict.WARN, note) for note in plan.thread_notes]
    return results
