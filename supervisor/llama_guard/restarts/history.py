"""The record of planned restarts: what each cost and what it bought (``llama-guard status``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

__all__ = ["RestartHistory", "RestartRecord"]


@dataclass(frozen=True)
class RestartRecord:
    """One planned restart (schedule, decay trigger, SIGUSR1) with before/after figures.

    ``kind``: ``scheduled``, ``vram_growth``, ``rss_growth``, ``speed_drop``, ``requested``…;
    ``requested_at``: aware wall-clock time of the request; ``uptime_s``: the old server's age;
    ``drained``: True if it drained, False if ``drain_timeout_s`` ran out, None while pending;
    ``server_exited``: the old server died while it drained (a crash, a kill -9), before its stop;
    ``unavailable_s``: what clients saw, from the stop of the old server (with the front door on: from
    the drain's start, when it began to hold their requests) to READY of the new one (None while pending);
    ``tokens_per_s_*``: generation speed (tokens/s) just before (the old process's last window)
    and after (the new process's baseline window); ``vram_mib_*``: the server's VRAM just before
    (last sample) and after (the new baseline).
    """

    kind: str
    reason: str
    requested_at: datetime
    uptime_s: float
    drained: bool | None = None
    server_exited: bool = False
    unavailable_s: float | None = None
    tokens_per_s_before: float | None = None
    tokens_per_s_after: float | None = None
    vram_mib_before: float | None = None
    vram_mib_after: float | None = None

    @property
    def outcome(self) -> str:
        """``drained``, ``drain_timeout``, ``server_exited`` or ``pending``."""
        if self.server_exited:
            return "server_exited"
        return {True: "drained", False: "drain_timeout", None: "pending"}[self.drained]

    def summary(self) -> str:
        """One human line with the before → after figures (``?`` for unknown)."""
        def fmt(value: float | None, unit: str) -> str:
            return "?" if value is None else f"{value:.1f} {unit}"
        parts = []
        if self.tokens_per_s_before is not None or self.tokens_per_s_after is not None:
            parts.append(f"{fmt(self.tokens_per_s_before, 'tokens/s')} → {fmt(self.tokens_per_s_after, 'tokens/s')}")
        if self.vram_mib_before is not None or self.vram_mib_after is not None:
            parts.append(f"VRAM {fmt(self.vram_mib_before, 'MiB')} → {fmt(self.vram_mib_after, 'MiB')}")
        return ", ".join(parts) or "no speed or VRAM figures yet"

    def fields(self) -> dict[str, object]:
        """Event fields for ``planned_restart_done`` (JSON-able; None values omitted)."""
        data = {k: v for k, v in self.to_dict().items() if v is not None}
        data["outcome"] = self.outcome
        data["summary"] = self.summary()
        return data

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (``requested_at`` in ISO 8601) for the status snapshot."""
        data = asdict(self)
        data["requested_at"] = self.requested_at.isoformat()
        return data



class RestartHistory:
    """The last ``size`` planned restarts, oldest first (a ring). Not thread-safe; one loop owns it."""

    def __init__(self, size: int = 10, records: Iterable[RestartRecord] = ()) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self._ring: deque[RestartRecord] = deque(records, maxlen=size)

    def begin(self, record: RestartRecord) -> None:
        """Add the record of a restart that is starting (drain begun); the oldest falls out."""
        self._ring.append(record)

    def update_last(self, **changes: Any) -> RestartRecord | None:
        """Fill in the latest record (e.g. ``drained=True``, ``unavailable_s=4.2``,
        ``tokens_per_s_after=…``); returns it, or None if the history is empty.
        Raises ``TypeError`` for an unknown field."""
        if not self._ring:
            return None
        updated = replace(self._ring[-1], **changes)
        self._ring[-1] = updated
        return updated

    def last(self) -> RestartRecord | None:
        """The latest record, if any."""
        return self._ring[-1] if self._ring else None

    def records(self) -> list[RestartRecord]:
        """All records, oldest first."""
        return list(self._ring)

    def to_json(self) -> list[dict[str, Any]]:
        """JSON-able list for the status snapshot."""
        return [record.to_dict() for record in self._ring]
