"""Two facts the policy asks for by action, found off the loop and answered as typed inputs: who
holds llama-server's port (:class:`~llama_guard.core.actions.FindPortHolder` → ``PortHolder``) and
what the binary's build is (:class:`~llama_guard.core.actions.ReadBuild` → ``BuildInfo``, asked only
when a verdict that names it may follow)."""

from __future__ import annotations

import asyncio

from llama_guard.argv import build_of, resolve_binary
from llama_guard.core.inputs import BuildInfo, PortHolder
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy
from llama_guard.core.procs import port_holder

PROC_TIMEOUT_S = 5.0  # a /proc scan for the port's listener


async def find_port_holder(port: int, lane: Lane) -> PortHolder:
    """The process listening on TCP ``port`` (pid and name, from /proc on ``lane``, bounded);
    ``PortHolder(port, None)`` when nobody does or the scan did not answer in time."""
    try:
        pid, name = await lane.run(lambda: port_holder(port), PROC_TIMEOUT_S, "port holder")
    except (CallTimeout, LaneBusy):
        return PortHolder(port, None, "")
    return PortHolder(port, pid, name)


async def read_build(binary: str) -> BuildInfo:
    """``binary --version`` (resolved on $PATH like the spawn; bounded by argv.BUILD_TIMEOUT_S)."""
    path = resolve_binary(binary)
    if path is None:
        return BuildInfo(f"unknown ({binary!r} not found)")
    return BuildInfo(await asyncio.to_thread(build_of, path))
