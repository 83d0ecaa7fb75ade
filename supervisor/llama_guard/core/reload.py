"""A reload (SIGHUP): load and check the new file (:func:`load_candidate`: could it start a
server?), and, key by key, whether a change takes effect now, at the next server start, or only at
the next daemon start (:func:`reload_report`; each key declares when, beside its type in its
section's model: :class:`~llama_guard.config.base.Reload`). The daemon applies an accepted candidate.

Pure except :func:`startable` (it looks at the binary and the model file: blocking) and
:func:`load_candidate`, which runs the blocking steps on the daemon's ``config`` lane with deadlines.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llama_guard.config import Config, ConfigError, load_config
from llama_guard.config.argv import binary_problem, own_slot_save_problem
from llama_guard.config.base import Reload, reload_of
from llama_guard.core.model_file import MODEL_CHECK_TIMEOUT_S, model_problem
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.core.privileges import ServerIdentity
from llama_guard.core.spawner import prepare
from llama_guard.vocab.server_flags import SECRET_FLAGS, is_secret_env

# The key of [server].api_key_file as the report names it (its content changed, not the path).
API_KEY_NAME = "server.api_key_file (the key in it)"
MASK = "***"
VALUE_MAX = 120  # characters of one value in the report; longer ones end in "…"


class _Masked(enum.Enum):
    """How a changed value is shown in the reload report."""

    PLAIN = "plain"
    ENV = "env"          # [server].env: names shown, values never (they may hold credentials)
    ARGS = "args"        # a command line: the value after a secret flag is masked
    SECRET = "secret"    # shown as *** only


@dataclass
class ReloadReport:
    """The changed keys (``section.key``) sorted by when they take effect."""

    applied: list[str] = field(default_factory=list)
    server_restart: list[str] = field(default_factory=list)
    """Applied by restarting the server now ([server], [limits])."""
    next_server_start: list[str] = field(default_factory=list)
    daemon_restart: list[str] = field(default_factory=list)
    """Not applied: read once at daemon start (``systemctl restart llama-guard``)."""
    values: dict[str, str] = field(default_factory=dict)
    """``section.key`` → ``"old → new"``, secrets masked (:func:`shown_change`)."""

    def keys(self, when: Reload) -> list[str]:
        """The list of the changed keys that take effect ``when``."""
        return {Reload.LIVE: self.applied, Reload.SERVER_RESTART: self.server_restart,
                Reload.NEXT_SERVER: self.next_server_start, Reload.DAEMON_RESTART: self.daemon_restart}[when]

    @property
    def changed(self) -> list[str]:
        return sorted({key.split(".")[0] for key in
                       (*self.applied, *self.server_restart, *self.next_server_start, *self.daemon_restart)})

    def values_text(self) -> str:
        """``server.port: 8080 → 8081; health.interval_s: 5.0 → 2.0`` (secrets masked)."""
        return "; ".join(f"{key}: {change}" for key, change in self.values.items())

    def text(self) -> str:
        """`` (applied: health.interval_s 5.0 → 2.0; needs a daemon restart: gpu.index 0 → 1)`` or
        `` (no change)``."""
        parts = []
        for label, keys in (("applied", self.applied), ("applied by restarting the server", self.server_restart),
                            ("applies at the next server start", self.next_server_start),
                            ("NOT applied, needs a daemon restart", self.daemon_restart)):
            if keys:
                parts.append(f"{label}: {', '.join(f'{k} {self.values[k]}' if k in self.values else k for k in keys)}")
        return f" ({'; '.join(parts)})" if parts else " (no change)"


def _clip(text: str) -> str:
    return text if len(text) <= VALUE_MAX else text[:VALUE_MAX - 1] + "…"


def _shown(value: object, how: _Masked) -> str:
    if how is _Masked.SECRET:
        return MASK
    if how is _Masked.ENV and isinstance(value, dict):
        return "{" + ", ".join(f"{k}={MASK}" for k in sorted(value)) + "}"
    if how is _Masked.ARGS and isinstance(value, list):
        words = [str(w) for w in value]
        shown = [MASK if i and (words[i - 1] in SECRET_FLAGS or is_secret_env(words[i - 1].lstrip("-")))
                 else w for i, w in enumerate(words)]
        return _clip(" ".join(shown) if shown else "[]")
    if isinstance(value, enum.Enum):
        value = value.value
    return _clip(repr(value) if isinstance(value, str) else str(value))


def shown_change(name: str, old: object, new: object) -> str:
    """``"old → new"`` for the key ``name`` (``section.key``) as an event may show it: the values of
    ``[server].env`` never (their names only: ``{HF_HOME=***} → {HF_HOME=***, X=***}``), a value
    following a secret flag in a command line never, long values clipped to :data:`VALUE_MAX`."""
    how = (_Masked.ENV if name == "server.env" else _Masked.ARGS if name in ("server.extra_args",
           "recovery.reset_command") else _Masked.SECRET if name == API_KEY_NAME else _Masked.PLAIN)
    if how is _Masked.ENV and isinstance(old, dict) and isinstance(new, dict):
        changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
        detail = f" (value of {', '.join(changed)} changed)" if changed else ""
        return f"{_shown(old, how)} → {_shown(new, how)}{detail}"
    return f"{_shown(old, how)} → {_shown(new, how)}"


def reload_report(old: Config, new: Config, *, key_changed: bool = False) -> ReloadReport:
    """Which changed keys of ``new`` over ``old`` take effect when, and their old → new values
    (see :class:`ReloadReport`); ``key_changed``: the API key read from ``[server].api_key_file``
    differs from the running server's (shown masked: it restarts the server)."""
    report = ReloadReport()
    if key_changed:
        report.server_restart.append(API_KEY_NAME)
        report.values[API_KEY_NAME] = shown_change(API_KEY_NAME, None, None)
    for section in type(new).model_fields:
        a, b = getattr(old, section), getattr(new, section)
        if a == b:
            continue
        for key in type(b).model_fields:
            if getattr(a, key) == getattr(b, key):
                continue
            name = f"{section}.{key}"
            report.values[name] = shown_change(name, getattr(a, key), getattr(b, key))
            report.keys(reload_of(type(b), key)).append(name)
    return report


def port_clash(config: Config, listening: list[tuple[str, int] | None]) -> str:
    """Why ``config`` would start llama-server on a port this daemon itself listens on (``listening``:
    the bound addresses of its front door and exporter, which keep their sockets until a daemon
    restart) — "" when it would not. The configuration's own check sees only the new file: turning
    ``[front].listen`` off and giving ``[server].port`` the clients' port passes it, and the server
    could never bind."""
    for address in listening:
        if address is not None and address[1] == config.server.port:
            return (f"server.port: {config.server.port} is where this llama-guard listens ({address[0]}:{address[1]}) "
                    "until it is restarted: llama-server could not bind it")
    return ""


def startable(config: Config) -> str:
    """Why llama-server could not be started with ``config`` ("" when it could): a reload must not
    replace a running server's configuration with one that cannot start. Blocking (stat, open)."""
    problem = binary_problem(config.server.binary)
    if problem:
        return f"server.binary: {problem}"
    problem = model_problem(Path(config.server.model))
    if problem:
        return f"server.model: {problem}"
    problem = own_slot_save_problem(config.server)
    return f"server.{problem}" if problem else ""


@dataclass(frozen=True)
class Candidate:
    """A reloaded configuration that could start a server, with its API key and identity."""

    config: Config
    key: str
    identity: ServerIdentity


async def load_candidate(path: Path, lanes: dict[LaneKind, Lane], emit: Callable[..., None]) -> Candidate | None:
    """Load and check ``path`` for a reload on the ``config`` lane, each step bounded by
    MODEL_CHECK_TIMEOUT_S (a model on a hung filesystem, a FIFO). None when it is refused: every
    reason is reported as ``config_error`` and the running configuration stays."""
    keep = " (keeping the running configuration)"
    try:
        new = await lanes[LaneKind.CONFIG].run(lambda: load_config(path), MODEL_CHECK_TIMEOUT_S, f"loading {path}")
        problem = await lanes[LaneKind.CONFIG].run(lambda: startable(new), MODEL_CHECK_TIMEOUT_S,
                                            f"checking {new.server.model}")
        key, identity = await lanes[LaneKind.CONFIG].run(lambda: prepare(new, path), MODEL_CHECK_TIMEOUT_S,
                                                  "reading [server].api_key_file")
    except ConfigError as exc:
        for line in exc.lines:
            emit("config_error", reason=line + keep)
        return None
    except (CallTimeout, LaneBusy) as exc:
        emit("config_error", reason=f"{path}: {exc}{keep}")
        return None
    except Exception as exc:  # never leave systemd in "reloading"
        emit("config_error", reason=f"{path}: cannot be loaded: {exc!r}{keep}")
        return None
    if problem:
        emit("config_error", reason=f"{path}: {problem}{keep}")
        return None
    return Candidate(new, key, identity)


def emit_reloaded(emit: Callable[..., None], path: Path, old: Config, new: Config, *,
                  key_changed: bool = False) -> None:
    """The ``config_reloaded`` event: which changed keys take effect when, with their old → new
    values, secrets masked (:func:`reload_report`; ``key_changed``: the API key in the file)."""
    report = reload_report(old, new, key_changed=key_changed)
    emit("config_reloaded", config_path=str(path), changed=",".join(report.changed),
         applied=",".join(report.applied), server_restart=",".join(report.server_restart),
         next_server_start=",".join(report.next_server_start),
         needs_daemon_restart=",".join(report.daemon_restart), values=report.values_text(),
         changed_text=report.text())
