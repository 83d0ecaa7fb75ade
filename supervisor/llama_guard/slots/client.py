"""llama-server's slot calls (llama.cpp ``tools/server``): ``GET /slots``, ``POST
/slots/{id}?action=save|restore`` (a file name relative to ``--slot-save-path``) and a completion that
reuses a slot's cache (``id_slot``, ``cache_prompt``, ``n_predict`` 0: the prompt is evaluated, nothing
generated). Each call has a deadline; the API key is sent where one is set (:func:`make_client`).
Errors are :class:`SlotCallError`, never a network exception.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llama_guard.core.client import RequestFailed
from llama_guard.core.probes import CANARY_SEED, make_client


class SlotCallError(Exception):
    """A slot call failed (no answer in time, refused, an error status); the message says which."""


@dataclass(frozen=True)
class SlotInfo:
    """One slot of ``GET /slots``: ``processing``; ``id_task`` of its current or last task (None:
    none since the start or a restore); ``n_tokens`` its last prompt's tokens; ``canary``: its last
    task was llama-guard's liveness canary."""

    id: int
    processing: bool
    id_task: int | None
    n_tokens: int
    canary: bool


@dataclass(frozen=True)
class Transfer:
    """A save or restore: ``n_tokens`` tokens, ``n_bytes`` bytes, in ``ms`` (llama-server's own timing)."""

    n_tokens: int
    n_bytes: int
    ms: float


def _slot(item: Any) -> SlotInfo | None:
    if not isinstance(item, dict) or not isinstance(item.get("id"), int):
        return None
    params = item.get("params")
    canary = isinstance(params, dict) and params.get("seed") == CANARY_SEED and params.get("n_predict") == 1
    id_task = item.get("id_task")
    n_tokens = item.get("n_prompt_tokens")
    return SlotInfo(item["id"], bool(item.get("is_processing", True)), id_task if isinstance(id_task, int) else None,
                    n_tokens if isinstance(n_tokens, int) else 0, canary)


class SlotClient:
    """The slot calls to the llama-server at ``base_url``; each waits at most ``timeout_s`` seconds."""

    def __init__(self, base_url: str, get_key: Callable[[], str], timeout_s: float) -> None:
        self._client = make_client(get_key, base_url)
        self.timeout_s = timeout_s

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, path: str, json: Any = None) -> Any:
        try:
            resp = await self._client.request(method, path, timeout_s=self.timeout_s, json=json)
        except RequestFailed as exc:
            raise SlotCallError(f"{method} {path}: {exc}") from None
        if resp.status != 200:
            raise SlotCallError(f"{method} {path}: HTTP {resp.status}: {' '.join(resp.text.split())[:300]}")
        try:
            return resp.json()
        except ValueError:
            raise SlotCallError(f"{method} {path}: the answer is not JSON") from None

    async def slots(self) -> list[SlotInfo]:
        """``GET /slots``, one :class:`SlotInfo` per slot it understood."""
        data = await self._call("GET", "/slots")
        if not isinstance(data, list):
            raise SlotCallError("GET /slots: not a list")
        return [s for s in map(_slot, data) if s is not None]

    async def _transfer(self, slot_id: int, action: str, filename: str, keys: tuple[str, str, str]) -> Transfer:
        data = await self._call("POST", f"/slots/{slot_id}?action={action}", json={"filename": filename})
        timings = data.get("timings") if isinstance(data, dict) else None
        try:
            if isinstance(data, dict) and isinstance(timings, dict):
                return Transfer(int(data[keys[0]]), int(data[keys[1]]), float(timings[keys[2]]))
        except (KeyError, TypeError, ValueError):
            pass
        raise SlotCallError(f"POST /slots/{slot_id}?action={action}: unexpected answer {data!r:.200}")

    async def save(self, slot_id: int, filename: str) -> Transfer:
        """Save slot ``slot_id`` to ``filename`` (in ``--slot-save-path``)."""
        return await self._transfer(slot_id, "save", filename, ("n_saved", "n_written", "save_ms"))

    async def restore(self, slot_id: int, filename: str) -> Transfer:
        """Load ``filename`` (in ``--slot-save-path``) into slot ``slot_id``."""
        return await self._transfer(slot_id, "restore", filename, ("n_restored", "n_read", "restore_ms"))

    async def reuse(self, slot_id: int, tokens: list[int]) -> int:
        """Evaluate ``tokens`` on slot ``slot_id`` with its cache, generating nothing: the tokens
        llama-server took from the cache (``timings.cache_n``)."""
        data = await self._call("POST", "/completion", json={
            "prompt": tokens, "id_slot": slot_id, "cache_prompt": True, "n_predict": 0})
        timings = data.get("timings") if isinstance(data, dict) else None
        cache_n = timings.get("cache_n") if isinstance(timings, dict) else None
        if not isinstance(cache_n, int):
            raise SlotCallError(f"POST /completion: no timings.cache_n in {data!r:.200}")
        return cache_n
