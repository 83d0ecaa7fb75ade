"""The syntax of an rlimit value in ``[limits]``: a count, a byte size with a unit (memlock), or
``"unlimited"``. Pure; validated by :class:`llama_guard.config.sections.LimitsConfig`, applied by
:mod:`llama_guard.limits`."""

from __future__ import annotations

import re
import resource
from typing import Literal

RLIM_INFINITY = resource.RLIM_INFINITY

_UNLIMITED_WORDS = frozenset({"unlimited", "infinity", "inf", "-1"})
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtpe]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50, "e": 60}


def parse_limit_value(value: int | str, *, sizes: bool = False) -> int:
    """Parse one limit value into an integer for :func:`resource.setrlimit`.

    Accepts a non-negative ``int``, a decimal string, or ``"unlimited"`` / ``"infinity"`` /
    ``"inf"`` / ``-1`` (returned as :data:`RLIM_INFINITY`). With ``sizes=True`` (memlock, in
    bytes) a unit suffix is accepted, binary as systemd's ``LimitMEMLOCK=`` reads it:
    ``K``/``KiB``/``KB`` = 1024, ``M`` = 1024², ``G``, ``T``, ``P``, ``E``; ``"64M"`` is
    67108864 bytes and ``"1.5G"`` is rounded down to whole bytes.

    Raises :class:`ValueError` naming the bad value (negative, empty, unknown unit, a unit on
    a count, a bool).
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a limit value")
    if isinstance(value, int):
        if value == -1:
            return RLIM_INFINITY
        if value < 0:
            raise ValueError(f"{value} is negative (use \"unlimited\")")
        return value
    text = str(value).strip()
    if text.lower() in _UNLIMITED_WORDS:
        return RLIM_INFINITY
    if text.isdigit():
        return int(text)
    match = _SIZE_RE.match(text)
    if match is None or not sizes or (not match.group(2) and not match.group(3)):
        allowed = "a byte count with an optional unit (K, M, G, T)" if sizes else "a whole number"
        raise ValueError(f"{value!r} is not a limit: expected {allowed} or \"unlimited\"")
    number, unit = match.group(1), match.group(2).lower()
    return int(float(number) * (1 << _SIZE_SHIFT[unit])) if "." in number else int(number) << _SIZE_SHIFT[unit]


def normalize_config_value(value: int | str | None, *, sizes: bool = False) -> int | Literal["unlimited"] | None:
    """The ``[limits]`` config form of ``value``: ``None``, a non-negative int, or ``"unlimited"``.

    Used by :class:`llama_guard.config.sections.LimitsConfig`'s validator so that ``memlock = "64M"``
    reaches the rest of the daemon as ``67108864``. Raises :class:`ValueError`.
    """
    if value is None:
        return None
    parsed = parse_limit_value(value, sizes=sizes)
    return "unlimited" if parsed == RLIM_INFINITY else parsed
