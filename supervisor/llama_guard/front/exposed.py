"""The endpoints llama-guard enables on llama-server for itself, answered as the user's own flags would.

llama-guard starts llama-server with ``--metrics`` and ``--slots`` (its liveness probe, drains and KV
carry-over read them) and, for the carry-over, ``--slot-save-path`` on its own slot directory. A client
of the front door must not see more than llama-server would show under the user's flags
(:func:`llama_guard.config.argv.user_endpoints`): what the user did not enable is answered here exactly as
llama-server answers it when off (``tools/server/server-context.cpp`` in llama.cpp: 501, ``Server:
llama.cpp`` and ``{"error":{"code":501,"message":...,"type":"not_supported_error"}}``, checked byte for
byte against the real binary in tests/e2e/test_front_transparency_e2e.py), and never reaches the
server — a ``POST /slots/{id}?action=save|restore|erase`` in particular would otherwise read and write
files in llama-guard's own slot directory.

One difference remains: with an API key, llama-server checks the key before the route (401 without a
valid one); the front door answers 501 to every such request, which tells nothing but that the endpoint
is off.
"""

from __future__ import annotations

import json
from urllib.parse import unquote

from aiohttp import hdrs, web

from llama_guard.config.argv import Endpoints
from llama_guard.front.endpoints import path_of

NOT_SUPPORTED = 501  # llama-server's ERROR_TYPE_NOT_SUPPORTED
# llama-server's messages when the endpoint is off (server-context.cpp).
METRICS_OFF = "This server does not support metrics endpoint. Start it with `--metrics`"
SLOTS_OFF = "This server does not support slots endpoint. Start it with `--slots`"
SLOT_ACTIONS_OFF = "This server does not support slots action. Start it with `--slot-save-path`"
_READ = (hdrs.METH_GET, hdrs.METH_HEAD)  # cpp-httplib serves HEAD with the GET route


def _off_message(method: str, path: str, endpoints: Endpoints) -> str | None:
    """llama-server's message for ``method path`` when its endpoint is off under ``endpoints``; None
    when the request is the server's to answer."""
    if path == "/metrics" and method in _READ and not endpoints.metrics:
        return METRICS_OFF
    if path == "/slots" and method in _READ and not endpoints.slots:
        return SLOTS_OFF
    # the route "/slots/:id_slot": one path segment after /slots/
    if method == hdrs.METH_POST and path.startswith("/slots/") and "/" not in path[len("/slots/"):] \
            and path != "/slots/" and not endpoints.slot_actions:
        return SLOT_ACTIONS_OFF
    return None


def not_enabled(method: str, target: str, endpoints: Endpoints) -> web.Response | None:
    """llama-server's answer to ``method target`` (an origin-form target) when the endpoint it names is
    one the user did not enable (``endpoints``): 501 with llama-server's body; None when the request goes
    to the server."""
    # as cpp-httplib routes it: the path percent-decoded ("/metric%73" is "/metrics")
    message = _off_message(method, unquote(path_of(target), errors="surrogateescape"), endpoints)
    if message is None:
        return None
    body = json.dumps({"error": {"code": NOT_SUPPORTED, "message": message, "type": "not_supported_error"}},
                      separators=(",", ":"))
    return web.Response(status=NOT_SUPPORTED, text=body, content_type="application/json", charset="utf-8",
                        headers={hdrs.SERVER: "llama.cpp"})
