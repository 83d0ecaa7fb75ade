"""Builds the daemon's event outputs and service-manager notifier from the configuration."""

from __future__ import annotations

from llama_guard.config import Config
from llama_guard.daemon import Notifier
from llama_guard.eventlog import Emitter


def make_emitter(config: Config) -> Emitter:
    """stderr output at ``[log].level`` (console on a terminal, JSON lines otherwise)."""
    fmt = config.log.format if config.log.format != "journald" else "json"
    return Emitter(min_level=config.log.level, fmt=fmt)


def make_notifier() -> Notifier:
    """The sd_notify notifier (a no-op without ``$NOTIFY_SOCKET``)."""
    return Notifier()
