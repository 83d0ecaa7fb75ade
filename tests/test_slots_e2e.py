"""End to end: each conversation's KV cache carried across a planned restart and a kill -9, with the
REAL llama-server and SmolLM2 model (CPU), through the front door, the canary on (its default).

A conversation of three turns (over 500 tokens of history after the first): ``llama-guard restart``
(SIGUSR1, drained) between turns 1 and 2, a kill -9 of llama-server between turns 2 and 3 once the
rolling save of turn 2 was reported. Every turn must answer 200, and after each restart the server's
own ``timings.cache_n`` must cover the whole previous prompt: only the new turn's tokens were
evaluated (llama-server with an API key: every slot call sends it). The same with two slots and two
conversations. A slot file that does not check out is refused before the server sees it.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from front_fixtures import daemon_pool, start_with_front

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]


@pytest.fixture
def carry(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> Iterator[Any]:
    """``make(parallel, key)``: a started daemon (front door on, rolling save every second; llama-server
    with an API key when ``key`` is set) whose ``front`` is the clients' port, ``first`` the first
    server's pid."""
    with daemon_pool() as pool:
        def make(parallel: int, key: str = "") -> Any:
            server: dict[str, object] = {"parallel": parallel, "ctx_size": 2048 * parallel}
            if key:
                path = tmp_path / "api-key"
                path.write_text(key + "\n")
                path.chmod(0o600)
                server["api_key_file"] = str(path)
            return start_with_front(pool, tmp_path, llama_server_bin, real_model, {
                "server": server,
                "front": {"hold_timeout_s": 120.0},
                "health": {"interval_s": 1.0, "hang_strikes": 5, "timeout_s": 5.0, "canary_timeout_s": 10.0},
                "recovery": {"stable_after_s": 1.0, "max_restarts": 5},
                "schedule": {"drain_timeout_s": 60.0},
                "slots": {"rolling_save_interval_s": 1.0}})

        yield make


class Conversation:
    """A chat whose history grows by each turn's question and answer."""

    def __init__(self, topic: str, facts: int = 25, key: str = "") -> None:
        """``facts``: the history's size (25: over 500 tokens with SmolLM2's tokenizer; checked by the tests)."""
        known = " ".join(f"Fact {i} about {topic}: item {i} weighs {i * 7 % 113} grams and costs {i * 13 % 97} coins."
                         for i in range(facts))
        self.messages: list[dict[str, str]] = [{"role": "system", "content": f"You know these facts. {known}"}]
        self.prompt_tokens = 0  # the previous turn's whole prompt, in tokens
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def turn(self, port: int, question: str) -> dict[str, Any]:
        """One turn through the front door; the server's ``timings``."""
        self.messages.append({"role": "user", "content": question})
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=180.0, headers=self.headers,
                          json={"messages": self.messages, "max_tokens": 8, "temperature": 0})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        self.messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        timings: dict[str, Any] = body["timings"]
        timings["previous_prompt"] = self.prompt_tokens
        self.prompt_tokens = timings["prompt_n"] + timings["cache_n"]
        return timings


def carried(timings: dict[str, Any]) -> bool:
    """The whole previous prompt came from the cache: only the new turn's tokens were evaluated."""
    return bool(timings["cache_n"] >= timings["previous_prompt"] and timings["prompt_n"] < timings["previous_prompt"])


def saved_after(run: Any, pid: int, reason: str, count: int) -> None:
    """Wait for ``count`` saves of server ``pid`` for ``reason`` (distinct slots)."""
    run.wait_event("slot_saved", 60, skip=count - 1,
                   where=lambda e: e["server_pid"] == pid and e["reason"] == reason)


def restarts_keep_conversations(run: Any, chats: list[Conversation]) -> None:
    for chat in chats:
        first = chat.turn(run.front, "Which item weighs the most?")
        assert chat.prompt_tokens >= 500 and first["cache_n"] == 0
    run.signal(signal.SIGUSR1)  # llama-guard restart: drained, saved, restored
    second_pid = run.wait_event("server_ready", 90, skip=1)["server_pid"]
    assert second_pid != run.first
    restored = run.wait_event("slot_restored", 10, skip=len(chats) - 1, where=lambda e: e["server_pid"] == second_pid)
    assert restored["cache_n"] >= restored["n_tokens"] - 1
    for chat in chats:
        assert carried(chat.turn(run.front, "And which item costs the least?")), chat.messages
    saved_after(run, second_pid, "rolling", len(chats))  # the rolling save had its chance: now a crash
    os.kill(second_pid, signal.SIGKILL)
    third_pid = run.wait_event("server_ready", 90, skip=2)["server_pid"]
    run.wait_event("slot_restored", 10, skip=len(chats) - 1, where=lambda e: e["server_pid"] == third_pid)
    for chat in chats:
        assert carried(chat.turn(run.front, "How many items are there?")), chat.messages
    names = run.names()
    assert "slot_restore_refused" not in names and "slot_restore_unused" not in names
    assert "slot_save_failed" not in names and "slot_restore_failed" not in names


def test_one_slot_keeps_its_conversation_across_a_planned_restart_and_a_kill_9(carry: Any) -> None:
    key = "lg-" + secrets.token_hex(20)  # every slot call (list, save, restore, verify) must send it
    restarts_keep_conversations(carry(1, key), [Conversation("tools", key=key)])


def test_two_slots_keep_two_conversations(carry: Any) -> None:
    restarts_keep_conversations(carry(2), [Conversation("tools"), Conversation("fruit")])


def test_a_tampered_slot_file_is_refused_and_the_server_serves(carry: Any) -> None:
    run = carry(1)
    chat = Conversation("tools", facts=5)  # small: after the refusal the whole history is evaluated again
    chat.turn(run.front, "Which item weighs the most?")
    saved = run.wait_event("slot_saved", 60, where=lambda e: e["server_pid"] == run.first)
    path = Path(saved["file"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.kill(run.first, signal.SIGKILL)
    second = run.wait_event("server_ready", 90, skip=1)["server_pid"]
    refused = run.wait_event("slot_restore_refused", 10)
    assert refused["refusal"] == "corrupt" and refused["file"] == path.name and not path.exists()
    assert not [e for e in run.events() if e["event"] == "slot_restored" and e["server_pid"] == second]
    again = chat.turn(run.front, "And which item costs the least?")
    assert again["cache_n"] < again["previous_prompt"]  # nothing carried: the history was evaluated again


def test_a_first_client_request_that_reuses_nothing_of_a_restored_slot_stops_restores(carry: Any) -> None:
    """The client's first answer from the restored slot says ``cache_n`` 0 for a prompt longer than what
    was restored (here: a client that turns llama-server's prompt cache off, ``cache_prompt`` false —
    the same figures a model whose restored cache cannot be reused gives): ``slot_restore_unused``, and
    restores stop for this model and build (remembered on disk)."""
    run = carry(1)
    chat = Conversation("tools", facts=10)
    chat.turn(run.front, "Which item weighs the most?")
    run.signal(signal.SIGUSR1)
    second = run.wait_event("server_ready", 90, skip=1)["server_pid"]
    restored = run.wait_event("slot_restored", 10, where=lambda e: e["server_pid"] == second)
    assert "slot_restore_unused" not in run.names()
    prompt = " ".join(m["content"] for m in chat.messages) * 2  # longer than the restored conversation
    resp = httpx.post(f"http://127.0.0.1:{run.front}/completion", timeout=180.0, json={
        "prompt": prompt, "id_slot": 0, "cache_prompt": False, "n_predict": 1})
    assert resp.status_code == 200 and resp.json()["timings"]["cache_n"] == 0
    assert resp.json()["timings"]["prompt_n"] >= restored["n_tokens"]
    unused = run.wait_event("slot_restore_unused", 10)
    assert unused["by"] == "client request" and unused["slot_id"] == 0 and unused["server_pid"] == second
    assert unused["n_tokens"] == restored["n_tokens"] and unused["cache_n"] == 0
    marks = Path(run.config.parent / "run" / "slots" / "unrestorable.json")
    deadline = time.monotonic() + 10
    while not marks.exists():
        assert time.monotonic() < deadline, "the model and build were not remembered"
        time.sleep(0.05)
    assert unused["build"] in marks.read_text()
