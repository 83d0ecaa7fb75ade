"""How a response cut by a server failure ends: for Server-Sent Events, one well-formed error event.

A stream that had begun cannot be replayed (the client already has part of it). When llama-server dies
under it, the client gets one more SSE event, then the end of the body (the last chunk of a chunked
response), so that it sees an error instead of waiting or guessing. The event has the name ``error``
and a ``data:`` line holding ``{"type": "error", "error": {"code", "message", "type"}}``: the ``error``
object is llama-server's own error shape (``format_error_response`` in llama.cpp's
``tools/server/server-common.cpp``: code, message, type), the ``event: error`` line with the
``"type": "error"`` wrapper is what Anthropic-style clients read, and OpenAI-style clients raise on a
``data`` object with an ``error`` member. No ``data: [DONE]`` follows: the stream did not complete.
Format: the WHATWG HTML standard, "Server-sent events" (fields ``event``/``data``, a blank line ends
an event).
"""

from __future__ import annotations

import json

SSE_TYPE = "text/event-stream"
FRONT_DOOR = "llama-guard front door: "  # begins every error message the front door writes itself
# Asks a reverse proxy in front (nginx; others read it too) to pass each event on at once, not buffer it.
NO_BUFFERING = ("X-Accel-Buffering", "no")


def is_sse(content_type: str) -> bool:
    """Whether a ``Content-Type`` header value is ``text/event-stream`` (parameters ignored)."""
    return content_type.split(";", 1)[0].strip().lower() == SSE_TYPE


def error_event(message: str, code: int = 502) -> bytes:
    """The closing SSE error event for ``message`` (one line, UTF-8; ``code`` the HTTP-style status
    the error stands for; the message gets the :data:`FRONT_DOOR` prefix). Begins with a blank line so
    that it is an event of its own even when the cut left an event unfinished."""
    payload = {"type": "error", "error": {"code": code, "message": FRONT_DOOR + message, "type": "server_error"}}
    return b"\n\nevent: error\ndata: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def is_comment(chunk: bytes) -> bool:
    """Whether ``chunk`` holds SSE comment lines only (``:`` first; llama-server's ping is ``:\\n\\n``,
    sent while a stream stays silent for ``--sse-ping-interval`` seconds): no event, nothing a client
    acts on, and no sign that the server computes — its HTTP thread sends it while the decode may hang."""
    return chunk[:1] == b":" and all(line[:1] in (b"", b":", b"\r") for line in chunk.split(b"\n"))
