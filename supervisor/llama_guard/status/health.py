"""``GET /livez`` and ``GET /readyz`` for load balancers, Kubernetes and Nomad.

``/readyz``: 200 while llama-server is ready and not draining, else 503 with ``Retry-After``; ``/livez``:
200 while the daemon's asyncio loop — the one that runs every decision — answers, else 503 (the daemon
is exiting). Both answer a small JSON body naming the phase; ``/readyz``'s body also says why the server
is not ready and for about how long (:mod:`llama_guard.status.readiness`):

``{"ready": false, "phase": "draining", "cause": "planned_restart", "restart_cause": "requested",
"retry_after_s": 14}`` — ``cause`` a :class:`~llama_guard.status.readiness.NotReady` value (null when
ready), ``restart_cause`` the :class:`~llama_guard.model.types.RestartCause` of a restart under way (null
otherwise), ``retry_after_s`` the ``Retry-After`` header's seconds (null when ready).

The front door and the ``[metrics]`` listener (:mod:`llama_guard.exporter.listener`) are aiohttp servers
on that loop and answer them from it: the answer is the proof that the loop runs, and a blocked loop
answers nothing (the prober's own timeout says so), as Kubernetes' HTTP probes read it.
"""

from __future__ import annotations

import math

from aiohttp import hdrs, web

from llama_guard.model.types import State
from llama_guard.status.readiness import NotReady, is_ready, not_ready_cause, ready_in_s
from llama_guard.vocab.phases import Phase

HEALTH_PATHS = frozenset({"/livez", "/readyz"})


def readiness(state: State, now: float) -> tuple[int, dict[str, object]]:
    """``/readyz``'s status and body for the policy's ``state`` at monotonic ``now`` (seconds)."""
    if is_ready(state):
        return 200, {"ready": True, "phase": state.phase.value, "cause": None, "restart_cause": None,
                     "retry_after_s": None}
    cause = not_ready_cause(state)
    restarting = cause in (NotReady.PLANNED_RESTART, NotReady.RECOVERING)
    return 503, {"ready": False, "phase": state.phase.value, "cause": cause.value,
                 "restart_cause": state.failure.cause.value if restarting else None,
                 "retry_after_s": max(1, math.ceil(ready_in_s(state, now)))}


def liveness(state: State) -> tuple[int, dict[str, object]]:
    """``/livez``'s status and body, computed on the daemon's loop (so its running is the proof)."""
    live = state.phase is not Phase.EXITED
    return (200 if live else 503), {"live": live, "phase": state.phase.value}


def health_response(path: str, state: State, now: float) -> web.Response:
    """The answer to ``GET``/``HEAD`` ``path`` (one of :data:`HEALTH_PATHS`) for the policy's ``state`` at
    monotonic ``now``, made on the daemon's loop; a 503 of ``/readyz`` carries ``Retry-After``."""
    if path == "/livez":
        status, body = liveness(state)
        return web.json_response(body, status=status)
    status, body = readiness(state, now)
    retry = body["retry_after_s"]
    return web.json_response(body, status=status, headers={hdrs.RETRY_AFTER: str(retry)} if retry else None)
