"""What of a request's line and headers passes between the client and llama-server: the target in
origin form, and every header but the hop-by-hop ones (RFC 9110, section 7.6.1), which belong to
each connection. The API key (``Authorization``) passes: llama-server checks it. Header names are
compared case-insensitively; values pass byte for byte.
"""

from __future__ import annotations

from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "transfer-encoding", "upgrade"})
# Set again by aiohttp from the body we send (same value) / handled by the front door itself.
REQUEST_DROP = HOP_BY_HOP | {"content-length", "expect"}
RESPONSE_DROP = HOP_BY_HOP | {"content-length"}


def end_to_end(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` without ``drop`` and without the headers the ``Connection`` header names."""
    listed = {token.strip().lower() for value in headers.getall(hdrs.CONNECTION, ()) for token in value.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        low = name.lower()
        if low not in drop and low not in listed:
            out.add(name, value)
    return out


def origin_form(request: web.BaseRequest) -> str | None:
    """The request's target as llama-server gets it: ``/path?query`` byte for byte as the client sent
    it, or the path and query of an absolute-form target (``http://host/path``, which a server must
    accept: RFC 9112, section 3.2.2 — the host it names is not contacted). None for the asterisk form
    (``OPTIONS *``: a question about the front door itself, nothing to forward)."""
    raw = request.raw_path
    if raw.startswith("/"):
        return raw
    if raw == "*":
        return None
    path = request.rel_url.raw_path_qs
    return path if path.startswith("/") else "/" + path
