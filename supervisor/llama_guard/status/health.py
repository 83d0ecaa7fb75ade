"""``GET /livez`` and ``GET /readyz`` for load balancers, Kubernetes and Nomad.

``/readyz``: 200 while llama-server is ready and not draining, else 503; ``/livez``: 200 while the
daemon's asyncio loop — the one that runs every decision — answers, else 503 (the daemon is exiting).
Both answer a small JSON body naming the phase. The front door and the ``[metrics]`` listener
(:mod:`llama_guard.exporter.listener`) are aiohttp servers on that loop and answer them from it: the
answer is the proof that the loop runs, and a blocked loop answers nothing (the prober's own timeout
says so), as Kubernetes' HTTP probes read it.
"""

from __future__ import annotations

from aiohttp import web

from llama_guard.model.types import State
from llama_guard.vocab.phases import Phase

HEALTH_PATHS = frozenset({"/livez", "/readyz"})


def readiness(state: State) -> tuple[int, dict[str, object]]:
    """``/readyz``'s status and body for the policy's ``state``."""
    ready = state.phase is Phase.READY and state.pid is not None
    return (200 if ready else 503), {"ready": ready, "phase": state.phase.value}


def liveness(state: State) -> tuple[int, dict[str, object]]:
    """``/livez``'s status and body, computed on the daemon's loop (so its running is the proof)."""
    live = state.phase is not Phase.EXITED
    return (200 if live else 503), {"live": live, "phase": state.phase.value}


def health_response(path: str, state: State) -> web.Response:
    """The answer to ``GET``/``HEAD`` ``path`` (one of :data:`HEALTH_PATHS`) for the policy's ``state``,
    made on the daemon's loop."""
    status, body = (liveness if path == "/livez" else readiness)(state)
    return web.json_response(body, status=status)
