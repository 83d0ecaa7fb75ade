"""Two facts the policy asks for by action, found off the loop and answered as typed inputs: who
holds llama-server's port (:class:`~llama_guard.model.actions.FindPortHolder` → ``PortHolder``) and
what the binary's build is (:class:`~llama_guard.model.actions.ReadBuild` → ``BuildInfo``, asked only
when a verdict that names it may follow)."""

from __future__ import annotations

import os

from llama_guard.config.argv import resolve_binary
from llama_guard.config.server import ServerConfig
from llama_guard.core.child import child_environ
from llama_guard.core.offload import PROC_TIMEOUT_S, CallTimeout, Lane, LaneBusy
from llama_guard.core.privileges import server_user_argv
from llama_guard.host.build import version_line
from llama_guard.host.procs import port_holder
from llama_guard.model.inputs import BuildInfo, PortHolder

BUILD_TIMEOUT_S = 5.0  # ``--version`` for a verdict that names the build (seconds)
BUILD_CALL_S = BUILD_TIMEOUT_S + 2.0  # the child's own deadline, then the time to kill and reap it


async def find_port_holder(port: int, lane: Lane) -> PortHolder:
    """The process listening on TCP ``port`` (pid and name, from /proc on ``lane``, bounded);
    ``PortHolder(port, None)`` when nobody does or the scan did not answer in time."""
    try:
        pid, name = await lane.run(lambda: port_holder(port), PROC_TIMEOUT_S, "port holder")
    except (CallTimeout, LaneBusy):
        return PortHolder(port, None, "")
    return PortHolder(port, pid, name)


async def read_build(server: ServerConfig, lane: Lane) -> BuildInfo:
    """``[server].binary --version`` (resolved on $PATH like the spawn) run as llama-server is (as
    ``[server].user``, with ``[server].env``: never as root) on ``lane``, bounded by BUILD_TIMEOUT_S
    (the child's own deadline) and BUILD_CALL_S; "unknown" when it did not answer."""
    path = resolve_binary(server.binary)
    if path is None:
        return BuildInfo(f"unknown ({server.binary!r} not found)")

    def read() -> str:
        try:
            prefix = server_user_argv(server.user, server.group, server.supplementary_groups)
        except (ValueError, FileNotFoundError) as exc:
            return f"unknown ({exc})"
        return version_line(path, BUILD_TIMEOUT_S, child_environ(os.environ, server.env), prefix)
    try:
        return BuildInfo(await lane.run(read, BUILD_CALL_S, f"{path} --version"))
    except (CallTimeout, LaneBusy) as exc:
        return BuildInfo(f"unknown ({exc})")
