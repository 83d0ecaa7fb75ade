"""The verdict of one line of ``llama-guard check`` (an enum, so no code decides by comparing strings)."""

from __future__ import annotations

import enum


class Verdict(str, enum.Enum):
    """A preflight line's verdict: FAIL makes ``check`` exit 78; printed as its value."""

    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"
    NOTE = "NOTE"
    HINT = "HINT"

    def __str__(self) -> str:
        return self.value
