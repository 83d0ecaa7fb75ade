"""Binding a listening address of the daemon's own (``[front].listen``, ``[metrics].listen``) that another
process may hold: as llama-server's port is, a taken port is retried every ``port_retry_s`` for
``[recovery].port_wait_s``, its holder named (:func:`llama_guard.host.procs.port_holder`) when first seen
and whenever it changes; then the refusal names it.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable, Callable
from typing import TypeVar

from llama_guard.config.listen import host_port
from llama_guard.core.offload import PROC_TIMEOUT_S, CallTimeout, Lane, LaneBusy
from llama_guard.host.procs import port_holder
from llama_guard.model.params import params_from
from llama_guard.model.policy.port import holder_text
from llama_guard.model.watcher import Context
from llama_guard.vocab.events import EventName

T = TypeVar("T")


async def holder_of(lane: Lane, port: int) -> tuple[int, str] | None:
    """Who listens on TCP ``port`` (a /proc scan on ``lane``, bounded by PROC_TIMEOUT_S); None when
    it cannot be told."""
    try:
        pid, name = await lane.run(lambda: port_holder(port), PROC_TIMEOUT_S, f"who holds port {port}")
    except (CallTimeout, LaneBusy):
        return None
    return (pid, name) if pid is not None else None


async def bind_waiting(ctx: Context, lane: Lane, bind: Callable[[], Awaitable[T]], *, setting: str, value: str,
                       address: tuple[str, int], taken: EventName) -> T | str:
    """``bind()``'s result (it raises OSError when it cannot bind ``address``), or why ``address``, of
    ``setting`` = ``value`` (``"[front].listen"``, as configured), cannot be bound. EADDRINUSE is retried within
    ``[recovery].port_wait_s``, event ``taken`` (fields ``listen``, ``holder``, ``waited_s``,
    ``port_wait_s``) naming the holder when first seen and whenever it changes; any other error is
    answered at once. A stop meanwhile cancels the wait."""
    params = params_from(ctx.config)
    since, named = ctx.clock(), ""
    while True:
        try:
            return await bind()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return f"{setting} = {value!r}: cannot listen: {exc.strerror or exc}"
        holder = holder_text(await holder_of(lane, address[1]))
        waited = ctx.clock() - since
        if waited >= params.port_wait_s:
            return (f"{setting} = {value!r}: port {address[1]} is held by {holder}, still after "
                    f"{waited:.0f} s of retries; fix: stop that process or choose another {setting}")
        if holder != named:
            named = holder
            ctx.emit(taken, listen=host_port(*address), holder=holder, waited_s=round(waited, 1),
                     port_wait_s=params.port_wait_s)
        await asyncio.sleep(min(params.port_retry_s, params.port_wait_s - waited))
