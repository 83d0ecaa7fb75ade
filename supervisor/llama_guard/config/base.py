"""What every ``[section]`` model shares: the pydantic base (unknown keys refused, frozen, defaults
validated), the positive-float type of durations and rates, the host name syntax (RFC 1123
labels) that ``[server].host`` and the ``listen`` addresses accept, and the markers that declare,
beside a key's type, default and bounds, what else is fixed about it:

- :class:`Reload`: when a reload (SIGHUP) that changes the key applies it. A section's
  :attr:`Section.reload` is the default of its keys; a key overrides it with its own marker
  (``interval_s: Annotated[PositiveFloat, Reload.LIVE] = 5.0``). :func:`reload_of` reads it.
- :class:`Policy`: the policy reads the key as a field of ``model.types.Params`` (its own name, or
  ``Policy("other_name")``); ``model.params.params_from`` copies every such key (:func:`policy_keys`).

A key's unit is the suffix of its name (``_s`` seconds, ``_mib`` MiB, ``_c`` °C, ``_fraction``).
"""

from __future__ import annotations

import enum
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?")
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def path_problem(name: str, path: str) -> str:
    """Why ``path`` (the value of key ``name``) cannot be a path llama-guard names ("" when it can): a
    NUL byte, or a control character (C0, DEL, C1) — a path goes into events and text log lines and
    ``status`` and ``check`` print it to a terminal: a newline would forge a line, an escape sequence
    drive the terminal."""
    if "\0" in path:
        return f"{name} contains a NUL byte"
    control = next((ch for ch in path if unicodedata.category(ch) == "Cc"), None)
    return "" if control is None else f"{name} contains the control character {control!r}; rename it"


class Reload(enum.Enum):
    """When a reload (SIGHUP) that changes a key applies it (``config_reloaded``'s report)."""

    LIVE = "applied"                     # at once: read live by the policy's parameters or a watcher
    NEXT_SERVER = "next_server_start"    # fixed when a server starts: from the next start, no restart forced
    SERVER_RESTART = "server_restart"    # shapes the server's argv or rlimits: the reload restarts the server
    DAEMON_RESTART = "daemon_restart"    # read once at daemon start (``systemctl restart llama-guard``)


@dataclass(frozen=True)
class Policy:
    """Marks a key the policy reads: ``Params.<name>`` (``""``: the key's own name) gets the key's
    value, through ``convert`` when given (``frozenset``, ``str``)."""

    name: str = ""
    convert: Callable[[Any], Any] | None = None


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    #: When a reload applies a changed key of this section that carries no :class:`Reload` marker.
    reload: ClassVar[Reload] = Reload.DAEMON_RESTART


def reload_of(section: type[Section], key: str) -> Reload:
    """When a reload applies a change of ``section``'s ``key`` (its marker, else the section's)."""
    marks = [m for m in section.model_fields[key].metadata if isinstance(m, Reload)]
    return marks[0] if marks else section.reload


def policy_keys(section: type[Section]) -> Iterator[tuple[str, str, Policy]]:
    """``(key, Params field, marker)`` for each key of ``section`` the policy reads."""
    for key, info in section.model_fields.items():
        for mark in info.metadata:
            if isinstance(mark, Policy):
                yield key, mark.name or key, mark
