"""TEMPORARY test shim: wires llama_guard.journal and llama_guard.notify into ``llama-guard run``
the way docs/systemd.md proposes, for tests/test_systemd_e2e.py before the daemon does it itself.
Only loaded when LLAMA_GUARD_E2E_SHIM=1 puts this directory on PYTHONPATH. Delete once wired."""

from __future__ import annotations

try:
    from llama_guard import logsetup
    from llama_guard.config import Config
    from llama_guard.eventlog import Emitter
    from llama_guard.journal import JournalSink, journald_enabled
    from llama_guard.notify import Notifier

    def make_emitter(config: Config) -> Emitter:
        fmt = config.log.format if config.log.format != "journald" else "json"
        if not journald_enabled(config.log.format):
            return Emitter(min_level=config.log.level, fmt=fmt)
        emitter = Emitter(min_level=config.log.level, fmt="json", sinks=[JournalSink()], sink_level="debug")
        emitter.stderr_enabled = False
        return emitter

    def make_notifier() -> Notifier:
        return Notifier(unset_environment=True)

    logsetup.make_emitter = make_emitter  # type: ignore[assignment]
    logsetup.make_notifier = make_notifier  # type: ignore[assignment]
except Exception as exc:  # pragma: no cover - a shim must not break interpreter start
    import sys

    print(f"e2e shim not applied: {exc!r}", file=sys.stderr)
