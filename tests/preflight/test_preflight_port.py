"""`llama-guard check` says when the server's port is already taken."""

from __future__ import annotations

import socket

from llama_guard.config import Config
from llama_guard.preflight.server import check_port


def test_port_free_then_taken() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = Config.model_validate({"server": {"port": port}})
    assert check_port(config).verdict == "OK"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        result = check_port(config)
    assert result.verdict == "WARN" and f"127.0.0.1:{port}" in result.detail
