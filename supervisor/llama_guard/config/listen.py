"""The sections with a ``listen`` address — ``[metrics]`` (the Prometheus endpoint) and ``[front]``
(the front door) — and the address syntax: ``"PORT"``, ``"HOST:PORT"`` or ``"[IPv6]:PORT"``."""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import Field, field_validator

from llama_guard.config.base import HOSTNAME, Policy, PositiveFloat, Reload, Section


class Listener(Section):
    """A section with a ``listen`` address: ``"PORT"`` (bound to 127.0.0.1), ``"HOST:PORT"`` or
    ``"[IPv6]:PORT"``; "" = off."""

    listen: str = ""

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        if value:
            parse_listens(value)  # ValueError names the problem
        return value

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)`` to bind (the first of :attr:`addresses`), or None when off."""
        return self.addresses[0] if self.listen else None

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Every ``(host, port)`` to bind, in the order given (one port for all); empty when off."""
        return parse_listens(self.listen) if self.listen else []


class MetricsConfig(Listener):
    """``[metrics]``: the Prometheus endpoint (off unless ``listen`` is set; one address)."""

    @field_validator("listen")
    @classmethod
    def _one(cls, value: str) -> str:
        if value and len(parse_listens(value)) > 1:
            raise ValueError(f"{value!r}: the exporter listens on one address")
        return value


class FrontConfig(Listener):
    """``[front]``: the front door, a reverse proxy that holds requests while llama-server is not
    ready (off unless ``listen`` is set; see docs/front.md).

    ``listen``: ``"HOST:PORT"`` (or ``"PORT"``, bound to 127.0.0.1) where clients connect, or several
    comma-separated on one port (``"127.0.0.1:8080,[::1]:8080"``, as llama-server's ``--host A,B``); then
    ``[server].host``/``port`` are llama-server's private address. ``hold_timeout_s``: how long a
    request may wait for a ready server (seconds) before it gets 503 with ``Retry-After``.
    ``max_held``: requests held at once (more get 503 at once). ``max_body_bytes``: the largest request
    body (413 above it). ``max_buffered_bytes``: request bodies kept in memory at once, held and in
    flight together (each is kept until its answer began, for a replay; it counts the bytes received,
    never a declared ``Content-Length``); past it, 503.
    ``header_timeout_s``: a connection must deliver a request's head within this many seconds of
    connecting or of its previous answer (else closed); ``body_timeout_s``: the whole body within
    this many seconds (else 408). ``stall_timeout_s``: a response that had begun and then gets no
    event for this long is reported to the policy as stalled (0 = off; SSE comments, llama-server's
    pings, are no event). ``first_event_timeout_s``: an answer whose headers came (llama-server took the
    request into a slot: its prefill runs) and whose first event (a stream's first SSE data event, another
    answer's first body byte) has not come within this many seconds is ended with 504 (an SSE error event
    for a stream) and reported to the policy as stalled (0 = off). ``max_connections``: client
    connections open at once (more are closed at once; the daemon's RLIMIT_NOFILE must allow them).
    ``stop_drain_s``: on SIGTERM/SIGINT, how long the requests in flight may finish before llama-server
    is stopped, while new ones get 503 at once (0 = stop at once).
    ``crash_refuse_s``: a request (its fingerprint: method, route, body as computed) sent alone into its
    second llama-server crash is answered 422 for this many seconds after it, its retries and variants
    included (docs/front.md, "Requests that crash the server").
    ``hold_after_errors``: that many 5xx answers from llama-server in a row, with no request completed
    between (501, "not implemented", never counts), are reported (``server_http_errors``) and make the
    front door hold new requests while one liveness round confirms at once: a canary that fails too is
    the verdict (the held requests go to the next server), one that answers releases them (0 = off).
    """

    hold_timeout_s: Annotated[PositiveFloat, Reload.LIVE] = 120.0
    max_held: Annotated[int, Field(ge=1), Reload.LIVE] = 256
    max_body_bytes: Annotated[int, Field(ge=1024), Reload.LIVE] = 32 * 1024 * 1024
    max_buffered_bytes: Annotated[int, Field(ge=1024), Reload.LIVE] = 512 * 1024 * 1024
    header_timeout_s: PositiveFloat = 15.0
    body_timeout_s: Annotated[PositiveFloat, Reload.LIVE] = 60.0
    stall_timeout_s: Annotated[float, Field(ge=0.0), Reload.LIVE] = 120.0
    first_event_timeout_s: Annotated[float, Field(ge=0.0, allow_inf_nan=False), Reload.LIVE] = 300.0
    max_connections: int = Field(16384, ge=1)
    stop_drain_s: float = Field(120.0, ge=0.0, allow_inf_nan=False)
    crash_refuse_s: PositiveFloat = 600.0
    hold_after_errors: Annotated[int, Field(ge=0), Reload.LIVE, Policy()] = 3

def parse_listen(value: str) -> tuple[str, int]:
    """``"9400"`` → ``("127.0.0.1", 9400)``; ``"0.0.0.0:9400"``; ``"[::1]:9400"``. Raises ValueError."""
    text = value.strip()
    host = "127.0.0.1"
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1:end + 2] != ":":
            raise ValueError(f"{value!r}: expected [IPv6]:PORT")
        host, port_text = text[1:end], text[end + 2:]
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
    else:
        port_text = text
        if not text.isdigit():
            raise ValueError(f"{value!r}: expected PORT, HOST:PORT or [IPv6]:PORT")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{value!r}: the port must be a number from 1 to 65535")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not HOSTNAME.fullmatch(host):
            raise ValueError(f"{value!r}: {host!r} is not an IP address or host name") from None
    return host, int(port_text)


def parse_listens(value: str) -> list[tuple[str, int]]:
    """A comma-separated list of :func:`parse_listen` addresses on one port (``"127.0.0.1:8080,[::1]:8080"``),
    in order; an address given twice, addresses on different ports or an empty item raise ValueError."""
    addresses = [parse_listen(item) for item in value.split(",")] if "," in value else [parse_listen(value)]
    if len(set(addresses)) < len(addresses):
        raise ValueError(f"{value!r}: an address is given twice")
    ports = {port for _, port in addresses}
    if len(ports) > 1:
        raise ValueError(f"{value!r}: every address takes the same port (as llama-server's --host A,B --port P)")
    return addresses


def listen_text(addresses: list[tuple[str, int]]) -> str:
    """``addresses`` as :func:`parse_listens` reads them back: ``host:port`` joined by commas."""
    return ",".join(host_port(*address) for address in addresses)


def host_port(host: str, port: int) -> str:
    """``host:port`` as :func:`parse_listen` reads it back: an IPv6 host bracketed (``[::1]:8080``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
