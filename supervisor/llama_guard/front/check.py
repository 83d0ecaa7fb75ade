"""``llama-guard check`` on ``[front]``: both addresses, and whether the front door's can be bound.

A front port equal to ``[server].port`` never gets here: the configuration refuses it (exit 78).
"""

from __future__ import annotations

import socket

from llama_guard.config import Config, host_port
from llama_guard.vocab.verdicts import CheckResult, Verdict


def check_front(config: Config) -> CheckResult:
    """One report line: where clients connect and where llama-server listens privately; WARN when
    llama-server listens beyond loopback (clients could go around the front door) or the front
    address cannot be bound now (perhaps by this very llama-guard)."""
    server = f"{config.server.host}:{config.server.port}"
    address = config.front.address
    if address is None:
        return CheckResult("front door", Verdict.NOTE, f"off: clients connect to llama-server at {server} directly "
                           "and see every restart (set [front].listen to hold their requests)")
    listen = host_port(*address)
    text = f"clients connect to {listen}; llama-server listens privately on {server}"
    if not config.server.loopback:
        return CheckResult("front door", Verdict.WARN, f"{text}, beyond loopback: clients can go around the front "
                           'door (set [server].host = "127.0.0.1")')
    family = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return CheckResult("front door", Verdict.WARN, f"{text}; {listen} cannot be bound now ({exc.strerror}): "
                               "the front door would not start unless that is this llama-guard")
    return CheckResult("front door", Verdict.OK, text)
