"""What a reload (SIGHUP) can apply: whether the new file could start a server, and, key by key,
whether a change takes effect now, at the next server start, or only at the next daemon start.

Pure except :func:`startable` (it looks at the binary and the model file: blocking, so the daemon
runs it on a lane with a deadline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llama_guard.argv import resolve_binary
from llama_guard.config import Config
from llama_guard.preflight import model_problem

# Keys read live (from the current config, by the policy's parameters or a watcher's on_reload):
# a change takes effect at once. "*" = every key of the section.
_LIVE: dict[str, frozenset[str]] = {
    "health": frozenset({"interval_s", "startup_poll_s", "load_timeout_s", "hang_strikes"}),
    "gpu": frozenset({"sample_interval_s", "foreign_processes", "require_server_on_gpu",
                      "server_on_gpu_timeout_s", "vram_release_timeout_s", "enable_persistence"}),
    "recovery": frozenset({"*"}),
    "schedule": frozenset({"*"}),
    "log": frozenset({"level"}),
    "runtime": frozenset({"*"}),
    # The front door reads these per request; listen, header_timeout_s and max_connections are fixed
    # when its listener opens.
    "front": frozenset({"hold_timeout_s", "max_held", "max_body_bytes", "max_buffered_bytes", "body_timeout_s",
                        "stall_timeout_s"}),
}
# Keys fixed when a server starts: in force from the next start (no restart is forced for them).
_NEXT_SERVER: dict[str, frozenset[str]] = {
    "health": frozenset({"timeout_s", "canary", "canary_timeout_s"}),
    "log": frozenset({"server_log_file"}),
}
# [server] and [limits] shape the server's argv and rlimits: changing them restarts the server.
_RESTARTS_SERVER = ("server", "limits")


@dataclass
class ReloadReport:
    """The changed keys (``section.key``) sorted by when they take effect."""

    applied: list[str] = field(default_factory=list)
    server_restart: list[str] = field(default_factory=list)
    """Applied by restarting the server now ([server], [limits])."""
    next_server_start: list[str] = field(default_factory=list)
    daemon_restart: list[str] = field(default_factory=list)
    """Not applied: read once at daemon start (``systemctl restart llama-guard``)."""

    @property
    def changed(self) -> list[str]:
        return sorted({key.split(".")[0] for key in
                       (*self.applied, *self.server_restart, *self.next_server_start, *self.daemon_restart)})

    def text(self) -> str:
        """`` (applied: health.interval_s; needs a daemon restart: gpu.index)`` or `` (no change)``."""
        parts = []
        for label, keys in (("applied", self.applied), ("applied by restarting the server", self.server_restart),
                            ("applies at the next server start", self.next_server_start),
                            ("NOT applied, needs a daemon restart", self.daemon_restart)):
            if keys:
                parts.append(f"{label}: {', '.join(keys)}")
        return f" ({'; '.join(parts)})" if parts else " (no change)"


def reload_report(old: Config, new: Config) -> ReloadReport:
    """Which changed keys of ``new`` over ``old`` take effect when (see :class:`ReloadReport`)."""
    report = ReloadReport()
    for section in type(new).model_fields:
        a, b = getattr(old, section), getattr(new, section)
        if a == b:
            continue
        for key in type(b).model_fields:
            if getattr(a, key) == getattr(b, key):
                continue
            name = f"{section}.{key}"
            live = _LIVE.get(section, frozenset())
            if section in _RESTARTS_SERVER:
                report.server_restart.append(name)
            elif "*" in live or key in live:
                report.applied.append(name)
            elif key in _NEXT_SERVER.get(section, frozenset()):
                report.next_server_start.append(name)
            else:
                report.daemon_restart.append(name)
    return report


def startable(config: Config) -> str:
    """Why llama-server could not be started with ``config`` ("" when it could): a reload must not
    replace a running server's configuration with one that cannot start. Blocking (stat, open)."""
    if resolve_binary(config.server.binary) is None:
        return f"server.binary: {config.server.binary!r} not found"
    problem = model_problem(Path(config.server.model))
    return f"server.model: {problem}" if problem else ""
