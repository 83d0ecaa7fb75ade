"""``GET /livez`` and ``GET /readyz`` for load balancers, Kubernetes and Nomad.

``/readyz``: 200 while llama-server is ready and not draining, else 503; ``/livez``: 200 while the
daemon's asyncio loop — the one that runs every decision — answers, else 503. Both answer a small JSON
body naming the phase. The front door serves them from that loop itself; the ``[metrics]`` listener
(a thread of prometheus-client's WSGI server) serves them through :func:`with_health`, asking the loop
with a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from llama_guard.core.types import State
from llama_guard.vocab.phases import Phase

LOOP_ANSWER_S = 2.0  # /livez on the metrics listener: the loop must answer within this many seconds

Wsgi = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def readiness(state: State) -> tuple[int, dict[str, object]]:
    """``/readyz``'s status and body for the policy's ``state``."""
    ready = state.phase is Phase.READY and state.pid is not None
    return (200 if ready else 503), {"ready": ready, "phase": state.phase.value}


def liveness(state: State) -> tuple[int, dict[str, object]]:
    """``/livez``'s status and body, computed on the daemon's loop (so its running is the proof)."""
    live = state.phase is not Phase.EXITED
    return (200 if live else 503), {"live": live, "phase": state.phase.value}


def liveness_from_thread(loop: asyncio.AbstractEventLoop, get_state: Callable[[], State],
                         timeout_s: float = LOOP_ANSWER_S) -> tuple[int, dict[str, object]]:
    """``/livez`` asked from another thread: the loop must run :func:`liveness` within ``timeout_s``."""

    future: concurrent.futures.Future[tuple[int, dict[str, object]]] = concurrent.futures.Future()

    def answer() -> None:
        if future.set_running_or_notify_cancel():
            future.set_result(liveness(get_state()))

    try:
        loop.call_soon_threadsafe(answer)
    except RuntimeError:  # the loop is closed
        return 503, {"live": False, "reason": "the daemon's loop is closed"}
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        return 503, {"live": False, "reason": f"the daemon's loop did not answer within {timeout_s:g} s"}


def with_health(app: Wsgi, *, ready: Callable[[], tuple[int, dict[str, object]]],
                live: Callable[[], tuple[int, dict[str, object]]]) -> Wsgi:
    """``app`` (prometheus-client's metrics app) with ``GET``/``HEAD`` ``/livez`` and ``/readyz`` in front."""
    routes = {"/livez": live, "/readyz": ready}

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None or environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return app(environ, start_response)
        status, body = route()
        data = json.dumps(body).encode()
        start_response(f"{status} {'OK' if status == 200 else 'Service Unavailable'}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [b""] if environ.get("REQUEST_METHOD") == "HEAD" else [data]

    return serve


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per request (a slow scrape holds no other), daemon threads (never block exit)."""

    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log on stderr."""


def start_wsgi(host: str, port: int, app: Wsgi) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``app`` on ``host:port`` (IPv4 or IPv6, by what ``host`` resolves to) from a daemon thread,
    as prometheus-client's ``start_http_server`` does. Raises OSError when it cannot bind."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("_Bound", (_Server,), {"address_family": family})
    httpd: WSGIServer = make_server(host, port, app, server_class, handler_class=_Quiet)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread
