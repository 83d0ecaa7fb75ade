"""The verdict of one line of ``llama-guard check`` (an enum, so no code decides by comparing strings),
the node-level verdict and recommended action of ``check --json``, and one line of the report
(:class:`CheckResult`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Verdict(str, enum.Enum):
    """A preflight line's verdict: FAIL makes ``check`` exit 78; printed as its value."""

    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"
    NOTE = "NOTE"
    HINT = "HINT"

    def __str__(self) -> str:
        return self.value


class NodeVerdict(str, enum.Enum):
    """The one verdict of ``check --json`` for this node, as node-health gates give it: ``pass`` (every
    line OK), ``warn`` (WARN lines only: the server can run), ``fail`` (a FAIL line: it cannot, or should
    not, start here), ``unknown`` (the check itself could not finish)."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    UNKNOWN = "unknown"


class NodeAction(str, enum.Enum):
    """What the operator (or the fleet's automation) should do about this node, least drastic first:
    nothing; fix the configuration (llama-guard's file, the model, the unit, the account); reset the GPU
    (``nvidia-smi --gpu-reset``, with nothing on it); reboot the host (a GPU off the bus, a driver that is
    not loaded or does not match its library, NVML that does not answer)."""

    NONE = "none"
    FIX_CONFIG = "fix_config"
    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"

    @property
    def severity(self) -> int:
        """0 for ``none`` up to 3 for ``reboot``: the most severe action of all lines is the node's."""
        return list(NodeAction).index(self)


@dataclass(frozen=True)
class CheckResult:
    """One line of the preflight report; ``verdict`` is OK, WARN, FAIL (or NOTE, an explanation).
    ``action``: what this line asks of the operator when it is not OK (a FAIL that names none is a
    configuration problem: :mod:`llama_guard.preflight.check_report`)."""

    name: str
    verdict: Verdict
    detail: str
    data: dict[str, Any] | None = field(default=None, compare=False)
    action: NodeAction = NodeAction.NONE
