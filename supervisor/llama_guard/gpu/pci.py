"""PCI bus ids in one canonical spelling.

NVML writes ``00000000:02:00.0`` (32-bit domain), the kernel log ``PCI:0000:02:00`` (no function)
or ``0000:b3:00.0``, people ``02:00.0``. :func:`normalise_pci` turns them all into
``dddd:bb:dd.f`` (lower-case hex, 16-bit domain, function defaulting to 0) so that they compare
equal.
"""

from __future__ import annotations

import re

_PCI = re.compile(
    r"^(?:PCI:)?(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"(?:\.(?P<fn>[0-7]))?$"
)


def normalise_pci(text: str) -> str | None:
    """The canonical ``dddd:bb:dd.f`` form of a PCI bus id, or None if ``text`` is not one.

    >>> normalise_pci("00000000:02:00.0"), normalise_pci("PCI:0000:02:00"), normalise_pci("B3:00.0")
    ('0000:02:00.0', '0000:02:00.0', '0000:b3:00.0')
    """
    match = _PCI.match(text.strip().rstrip(":."))
    if match is None:
        return None
    domain = int(match["domain"] or "0", 16)
    if domain > 0xFFFF:
        return None
    return (f"{domain:04x}:{int(match['bus'], 16):02x}:{int(match['dev'], 16):02x}."
            f"{int(match['fn'] or '0')}")
