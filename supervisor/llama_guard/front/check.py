"""``llama-guard check`` on the listeners: the front door's and the exporter's addresses, whether
each host resolves and whether each can be bound now.

Two listeners (or one and ``[server].port``) on one port never get here: the configuration refuses
it (exit 78).
"""

from __future__ import annotations

import socket

from llama_guard.config import Config
from llama_guard.config.listen import host_port, listen_text
from llama_guard.status.instance import port_daemon
from llama_guard.vocab.verdicts import CheckResult, Verdict


def _family(host: str, port: int) -> socket.AddressFamily | str:
    """The address family ``host`` resolves to, or why it does not resolve (getaddrinfo(3)'s text)."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as exc:
        return str(exc.args[1] if isinstance(exc, socket.gaierror) and len(exc.args) > 1 else exc)


def _bind_problem(family: socket.AddressFamily, address: tuple[str, int]) -> str | int:
    """Why ``address`` cannot be bound now (the errno's text), "" when it can, or the pid of this
    user's running llama-guard when that is who listens there
    (:func:`~llama_guard.status.instance.port_daemon`: it serves this port already)."""
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            daemon = port_daemon(address[1])
            return str(exc.strerror or exc) if daemon is None else daemon
    return ""


def check_front(config: Config) -> CheckResult:
    """One report line: where clients connect and where llama-server listens privately; FAIL when
    the front door's host does not resolve; WARN when llama-server listens beyond loopback (clients
    could go around the front door) or the front address is held by something other than this user's
    llama-guard."""
    server = f"{config.server.host}:{config.server.port}"
    addresses = config.front.addresses
    if not addresses:
        return CheckResult("front door", Verdict.NOTE, f"off: clients connect to llama-server at {server} directly "
                           "and see every restart and every endpoint llama-guard enables for itself (/metrics, "
                           "/slots and slot actions; set [front].listen to hold their requests)")
    families = []
    for address in addresses:
        family = _family(*address)
        if isinstance(family, str):
            return CheckResult("front door", Verdict.FAIL, f"[front].listen = {config.front.listen!r}: host "
                               f"{address[0]!r} does not resolve ({family})")
        families.append(family)
    text = f"clients connect to {listen_text(addresses)}; llama-server listens privately on {server}"
    if not config.server.loopback:
        return CheckResult("front door", Verdict.WARN, f"{text}, beyond loopback: clients can go around the front "
                           'door (set [server].host = "127.0.0.1")')
    daemon = None
    for family, address in zip(families, addresses, strict=True):
        problem = _bind_problem(family, address)
        if isinstance(problem, int):
            daemon = problem
        elif problem:
            return CheckResult("front door", Verdict.WARN, f"{text}; {host_port(*address)} cannot be bound now "
                               f"({problem}): held by something other than llama-guard; the front door would not "
                               "start unless that is llama-guard.socket (socket activation)")
    if daemon is not None:
        return CheckResult("front door", Verdict.OK, f"{text}; served now by the running llama-guard (pid {daemon})")
    return CheckResult("front door", Verdict.OK, text)


def check_metrics(config: Config) -> CheckResult:
    """One report line on ``[metrics].listen``: off, FAIL when its host does not resolve, WARN when
    something other than this user's llama-guard holds it, else OK with the address."""
    address = config.metrics.address
    if address is None:
        served = ("/metrics; the front door answers /livez and /readyz" if config.front.address is not None
                  else "/metrics, /livez and /readyz")
        return CheckResult("metrics", Verdict.NOTE, f"off (set [metrics].listen for {served})")
    listen = host_port(*address)
    family = _family(*address)
    if isinstance(family, str):
        return CheckResult("metrics", Verdict.FAIL, f"[metrics].listen = {config.metrics.listen!r}: host "
                           f"{address[0]!r} does not resolve ({family})")
    problem = _bind_problem(family, address)
    if isinstance(problem, int):
        return CheckResult("metrics", Verdict.OK, f"/metrics, /livez and /readyz on {listen}, served now by the "
                           f"running llama-guard (pid {problem})")
    if problem:
        return CheckResult("metrics", Verdict.WARN, f"{listen} cannot be bound now ({problem}): held by something "
                           "other than llama-guard; the exporter would not start")
    return CheckResult("metrics", Verdict.OK, f"/metrics, /livez and /readyz on {listen}")
