"""The slot saves' rules (:class:`llama_guard.slots.watcher.SlotsSource`), without a server.

A rolling save (``run`` every ``[slots].rolling_save_interval_s`` while READY) saves nothing while any
slot is processing; otherwise each idle slot whose ``(id_task, n_tokens)`` changed since its last save
is saved, and canary, empty and task-less slots never are. A failing save is tried once per change. The
save before a GPU reset (``before_reset_stop``) saves the idle slots even while others process. A model
and build marked unrestorable gets no saves.

The server is a stand-in :class:`FakeSlots` for :class:`~llama_guard.slots.client.SlotClient` (its
``GET /slots`` answer is set by the test; a save writes a slot file into the store as llama-server
does); the store, its commits and the watcher's own bookkeeping are the real ones. The real server's
saves are exercised end to end in test_slots_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from llama_guard.config import Config
from llama_guard.host.build import Build
from llama_guard.model.inputs import Tick
from llama_guard.model.transition import Transition
from llama_guard.model.types import AfterStop, State
from llama_guard.model.watcher import Context
from llama_guard.slots.client import SlotCallError, SlotInfo, Transfer
from llama_guard.slots.fingerprint import Fingerprint, fingerprint_of
from llama_guard.slots.store import UNRESTORABLE_AFTER, SlotStore
from llama_guard.slots.watcher import SlotsSource
from llama_guard.vocab.phases import Phase

TEST_BUILD = Build(Path("/opt/llama/llama-server"), "ab" * 32, "version: 11434 (abc1234)", "b11434 (abc1234)")

pytestmark = pytest.mark.usefixtures("clean_env")

PID = 4242
Events = list[tuple[str, dict[str, Any]]]


def slot_file(path: Path, tokens: list[int], state_bytes: int = 1024) -> None:
    """A slot file as llama-server writes it (state_seq_save_file with server_tokens::serialize)."""
    packed = [0xFFFFFFFF, 1, len(tokens), *tokens, 0]
    body = struct.pack("<III", 0x67677371, 4, len(packed)) + struct.pack(f"<{len(packed)}I", *packed)
    path.write_bytes(body + os.urandom(state_bytes))


def idle(slot_id: int, id_task: int | None, n_tokens: int, *, canary: bool = False) -> SlotInfo:
    return SlotInfo(slot_id, False, id_task, n_tokens, canary)


def busy(slot_id: int, id_task: int, n_tokens: int) -> SlotInfo:
    return SlotInfo(slot_id, True, id_task, n_tokens, False)


class FakeSlots:
    """A stand-in SlotClient: ``GET /slots`` answers :attr:`now`; a save of slot N writes a slot file
    of N's ``n_tokens`` tokens to the store (``broken``: not a slot file), or fails (``failing``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.now: list[SlotInfo] = []
        self.saves: list[tuple[int, str]] = []
        self.failing: set[int] = set()
        self.broken: set[int] = set()
        self.slots_calls = 0
        self.opened = 0
        self.closed = 0
        self.cache_n: int | None = None  # what a verification reuses (None: all its tokens)
        self.restores: list[tuple[int, str]] = []

    async def slots(self) -> list[SlotInfo]:
        self.slots_calls += 1
        return list(self.now)

    async def save(self, slot_id: int, filename: str) -> Transfer:
        self.saves.append((slot_id, filename))
        if slot_id in self.failing:
            raise SlotCallError(f"POST /slots/{slot_id}?action=save: HTTP 500: no space")
        path = self.root / filename
        if slot_id in self.broken:
            path.write_bytes(b"GGUF" + bytes(64))
            return Transfer(0, 68, 1.0)
        n_tokens = next(s.n_tokens for s in self.now if s.id == slot_id)
        slot_file(path, list(range(100, 100 + n_tokens)))
        return Transfer(n_tokens, path.stat().st_size, 12.5)

    async def restore(self, slot_id: int, filename: str) -> Transfer:
        self.restores.append((slot_id, filename))
        return Transfer(10, 1024, 3.0)

    async def reuse(self, slot_id: int, tokens: list[int]) -> int:
        return len(tokens) - 1 if self.cache_n is None else self.cache_n

    async def aclose(self) -> None:
        self.closed += 1


@dataclasses.dataclass
class Rig:
    src: SlotsSource
    ctx: Context
    fake: FakeSlots
    store: SlotStore
    fp: Fingerprint
    events: Events
    holder: Policy

    def saved_ids(self) -> list[int]:
        return [slot_id for slot_id, _ in self.fake.saves]

    def named(self, name: str) -> list[dict[str, Any]]:
        return [fields for n, fields in self.events if n == name]


class Policy(dict[str, State]):
    """The policy's state in these tests: each state set is handed to the source as the daemon hands it
    the record of a step (``on_transition``), once the source exists."""

    src: SlotsSource | None = None
    ctx: Context | None = None

    def __setitem__(self, key: str, new: State) -> None:
        old = self.get(key, new)
        super().__setitem__(key, new)
        if self.src is not None and self.ctx is not None:
            self.src.on_transition(self.ctx, Transition(old, new, Tick(), (), 0.0))


@pytest.fixture
async def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Rig:
    """A SlotsSource prepared (``start``) and restored (``restore``, an empty store: nothing to
    restore) for server :data:`PID`, as the daemon does; its client is a :class:`FakeSlots`."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + os.urandom(5000))
    cfg = Config.model_validate({"server": {"model": str(model), "parallel": 4},
                                 "runtime": {"dir": str(tmp_path / "run")},
                                 "slots": {"dir": str(tmp_path / "slots"), "rolling_save_interval_s": 7.0}})
    events: Events = []

    def emit(name: str, /, **fields: Any) -> None:
        events.append((name, fields))

    holder = Policy()
    ctx = Context(get_config=lambda: cfg,
                  emit=emit, post=lambda e: None,
                  post_threadsafe=lambda e: None, clock=lambda: 0.0, loop=asyncio.get_running_loop())
    fp = fingerprint_of(cfg.server, TEST_BUILD)
    src = SlotsSource()
    holder.src, holder.ctx = src, ctx
    holder["state"] = State(phase=Phase.READY, pid=PID)
    assert await src.start(ctx) is None
    assert src.store is not None and src.store.root == tmp_path / "slots"
    fake = FakeSlots(src.store.root)

    def client(_ctx: Context) -> Any:
        fake.opened += 1
        return fake

    async def fingerprint(_ctx: Context, _server: object) -> Fingerprint:
        return fp

    monkeypatch.setattr(src, "_client", client)
    monkeypatch.setattr(src, "_fingerprint", fingerprint)
    await src.before_spawn(ctx, TEST_BUILD.path, {})
    await src.restore(ctx, PID)
    assert events == [] and fake.saves == []
    return Rig(src, ctx, fake, src.store, fp, events, holder)


async def rolling(rig: Rig) -> None:
    await rig.src._save_changed(rig.ctx, PID, "rolling")


async def test_a_rolling_save_saves_nothing_while_any_slot_processes(rig: Rig) -> None:
    rig.fake.now = [idle(0, 5, 10), busy(1, 6, 20)]
    await rolling(rig)
    assert rig.fake.slots_calls == 1  # it did look
    assert rig.fake.saves == [] and rig.events == [] and rig.store.committed() == []
    # Once nothing processes, the slot skipped before is saved (the skip did not count as its save).
    rig.fake.now = [idle(0, 5, 10), idle(1, 6, 20)]
    await rolling(rig)
    assert sorted(rig.saved_ids()) == [0, 1]
    assert sorted(m.slot_id for m in rig.store.committed()) == [0, 1]
    assert rig.fake.opened == rig.fake.closed == 2


async def test_an_unchanged_slot_is_saved_once_and_a_changed_one_again(rig: Rig) -> None:
    rig.fake.now = [idle(0, 5, 10)]
    await rolling(rig)
    [saved] = rig.named("slot_saved")
    manifest = rig.store.committed()[0]
    assert rig.fake.saves == [(0, manifest.file)]
    assert saved == {"slot_id": 0, "n_tokens": 10, "bytes": manifest.bytes, "save_ms": 12.5, "reason": "rolling",
                     "server_pid": PID, "file": str(rig.store.root / manifest.file)}
    assert rig.store.tokens(manifest) == list(range(100, 110))

    await rolling(rig)  # nothing changed
    await rolling(rig)
    assert len(rig.fake.saves) == 1 and len(rig.named("slot_saved")) == 1

    rig.fake.now = [idle(0, 5, 14)]  # more tokens, same task
    await rolling(rig)
    rig.fake.now = [idle(0, 9, 14)]  # another task, same count
    await rolling(rig)
    assert rig.saved_ids() == [0, 0, 0]
    assert [e["n_tokens"] for e in rig.named("slot_saved")] == [10, 14, 14]
    [last] = rig.store.committed()
    assert last.n_tokens == 14
    assert sorted(p.name for p in rig.store.root.iterdir()) == [last.file, "llama-guard-slot-0.json"]  # old .bin gone


async def test_canary_empty_and_taskless_slots_are_not_saved(rig: Rig) -> None:
    rig.fake.now = [idle(0, 5, 3, canary=True), idle(1, 6, 0), idle(2, None, 30), idle(3, 7, 12)]
    await rolling(rig)
    assert rig.saved_ids() == [3]
    assert [e["slot_id"] for e in rig.named("slot_saved")] == [3]
    assert [m.slot_id for m in rig.store.committed()] == [3]
    # Nor by the saves before a planned restart or a GPU reset.
    await rig.src.after_drain(rig.ctx, PID)
    await rig.src.before_reset_stop(rig.ctx, PID)
    assert rig.saved_ids() == [3]


@pytest.mark.parametrize("how", ["call", "file"])
async def test_a_failing_save_is_reported_once_and_retried_only_after_a_change(rig: Rig, how: str) -> None:
    (rig.fake.failing if how == "call" else rig.fake.broken).add(0)
    rig.fake.now = [idle(0, 5, 10), idle(1, 6, 20)]
    await rolling(rig)
    assert sorted(rig.saved_ids()) == [0, 1]
    [failed] = rig.named("slot_save_failed")
    assert failed["slot_id"] == 0 and failed["server_pid"] == PID
    assert ("HTTP 500: no space" if how == "call" else "not a slot file") in failed["error"]
    assert [e["slot_id"] for e in rig.named("slot_saved")] == [1]  # the other slot is saved all the same
    [kept] = rig.store.committed()
    assert kept.slot_id == 1
    assert not [p for p in rig.store.root.iterdir() if p.name.startswith("llama-guard-slot-0")]

    for _ in range(3):  # intervals later, nothing changed: not tried again, not reported again
        await rolling(rig)
    assert sorted(rig.saved_ids()) == [0, 1] and len(rig.named("slot_save_failed")) == 1

    rig.fake.failing.clear()
    rig.fake.broken.clear()
    rig.fake.now = [idle(0, 8, 11), idle(1, 6, 20)]  # slot 0 changed
    await rolling(rig)
    assert sorted(rig.saved_ids()) == [0, 0, 1]
    assert len(rig.named("slot_save_failed")) == 1
    assert sorted(m.slot_id for m in rig.store.committed()) == [0, 1]


async def test_the_save_before_a_reset_saves_idle_slots_while_another_processes(rig: Rig) -> None:
    rig.fake.now = [idle(0, 5, 10), busy(1, 6, 20), idle(2, 7, 0)]
    await rig.src.before_reset_stop(rig.ctx, PID)
    assert rig.saved_ids() == [0]
    [saved] = rig.named("slot_saved")
    assert saved["slot_id"] == 0 and saved["reason"] == "GPU reset" and saved["server_pid"] == PID
    assert [m.slot_id for m in rig.store.committed()] == [0]
    assert rig.named("slot_save_failed") == []
    # The busy slot was not marked as saved: once idle, a rolling save takes it (and not slot 0 again).
    rig.fake.now = [idle(0, 5, 10), idle(1, 6, 25), idle(2, 7, 0)]
    await rolling(rig)
    assert rig.saved_ids() == [0, 1]


async def test_the_save_after_a_drain_saves_every_changed_slot(rig: Rig) -> None:
    rig.fake.now = [idle(0, 5, 10), idle(1, 6, 20)]
    await rolling(rig)
    rig.fake.now = [idle(0, 5, 10), idle(1, 8, 33), idle(2, 9, 4)]
    await rig.src.after_drain(rig.ctx, PID)
    assert rig.saved_ids() == [0, 1, 1, 2]
    assert [(e["slot_id"], e["reason"]) for e in rig.named("slot_saved")][2:] == \
        [(1, "planned restart"), (2, "planned restart")]


async def test_the_save_after_the_drain_of_a_stop_of_llama_guard_says_so(rig: Rig) -> None:
    """SIGTERM drains the server too: its saves said "planned restart" although the daemon was stopping."""
    rig.holder["state"] = State(phase=Phase.DRAINING, pid=PID, after_stop=AfterStop.EXIT)
    rig.fake.now = [idle(0, 5, 10)]
    await rig.src.after_drain(rig.ctx, PID)
    assert [(e["slot_id"], e["reason"]) for e in rig.named("slot_saved")] == [(0, "llama-guard stopping")]


@pytest.mark.parametrize("save", ["rolling", "after_drain", "before_reset_stop"])
async def test_a_model_and_build_marked_unrestorable_get_no_saves(rig: Rig, save: str) -> None:
    for _ in range(UNRESTORABLE_AFTER):
        rig.store.note_unused(rig.fp)
    rig.fake.now = [idle(0, 5, 10), idle(1, 6, 20)]
    if save == "rolling":
        await rolling(rig)
    else:
        await getattr(rig.src, save)(rig.ctx, PID)
    assert rig.fake.saves == [] and rig.fake.slots_calls == 0 and rig.events == []
    assert rig.store.committed() == []
    # Another build of the same model is not marked: its slots are saved.
    rig.src._fp = dataclasses.replace(rig.fp, build=dataclasses.replace(TEST_BUILD, sha256="cd" * 32))
    await rolling(rig)
    assert sorted(rig.saved_ids()) == [0, 1]


async def test_a_server_other_than_the_restored_one_gets_no_saves(rig: Rig) -> None:
    rig.fake.now = [idle(0, 5, 10)]
    await rig.src._save_changed(rig.ctx, PID + 1, "rolling")
    await rig.src.after_drain(rig.ctx, PID + 1)
    assert rig.fake.saves == [] and rig.fake.slots_calls == 0 and rig.events == []


async def test_the_rolling_loop_saves_only_while_the_server_is_ready(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` with its interval's sleep replaced: each "interval" moves the server to the next phase
    and changes slot 0, so only the READY intervals may save."""
    phases = [Phase.READY, Phase.DRAINING, Phase.STARTING, Phase.READY, Phase.STOPPING]
    slept: list[float] = []
    tick = iter(range(len(phases)))

    class Done(Exception):
        pass

    async def interval(seconds: float) -> None:
        slept.append(seconds)
        i = next(tick, None)
        if i is None:
            raise Done
        rig.holder["state"] = State(phase=phases[i], pid=PID)
        rig.fake.now = [idle(0, 100 + i, 10 + i)]

    monkeypatch.setattr(asyncio, "sleep", interval)  # the loop's interval; nothing else here sleeps
    with pytest.raises(Done):
        await rig.src.run(rig.ctx)
    assert slept == [7.0] * (len(phases) + 1)
    assert [e["n_tokens"] for e in rig.named("slot_saved")] == [10, 13]
    assert {e["reason"] for e in rig.named("slot_saved")} == {"rolling"}


@pytest.mark.parametrize("save", ["after_drain", "before_reset_stop"])
async def test_a_slot_whose_rolling_save_failed_is_still_saved_before_a_stop(rig: Rig, save: str) -> None:
    """"Tried once per change" spares the rolling save's intervals; the save before a planned restart
    or a GPU reset is the conversation's last chance and tries each slot not saved since it changed."""
    rig.fake.failing.add(0)
    rig.fake.now = [idle(0, 5, 10)]
    await rolling(rig)
    await rolling(rig)
    assert rig.saved_ids() == [0] and len(rig.named("slot_save_failed")) == 1
    rig.fake.failing.clear()  # the failure passed (a slow disk, a timeout)
    await getattr(rig.src, save)(rig.ctx, PID)
    assert rig.saved_ids() == [0, 0]
    assert [m.slot_id for m in rig.store.committed()] == [0]
    await getattr(rig.src, save)(rig.ctx, PID)  # saved now: not again
    assert rig.saved_ids() == [0, 0]


async def test_one_verification_that_reused_nothing_stops_only_this_servers_restores(rig: Rig) -> None:
    """One observation stopped the carry-over for good. Now one verification that reused
    nothing stops this start's restores; only a second in a row stops them for good."""
    rig.fake.now = [idle(0, 5, 10), idle(1, 6, 20)]
    await rolling(rig)
    rig.fake.cache_n = 0
    await rig.src.restore(rig.ctx, PID)
    [unused] = rig.named("slot_restore_unused")
    assert unused["by"] == "verification" and unused["cache_n"] == 0 and unused["until"].startswith("for this server")
    assert len(rig.fake.restores) == 1  # the other slot is not tried on this server
    assert not rig.store.unrestorable(rig.fp)
    await rolling(rig)  # saves go on
    rig.fake.now = [idle(0, 7, 12), idle(1, 8, 22)]
    await rolling(rig)
    assert [e["n_tokens"] for e in rig.named("slot_saved")][-2:] == [12, 22]
    await rig.src.restore(rig.ctx, PID)  # the next start: a second verification that reused nothing
    assert [e["until"] for e in rig.named("slot_restore_unused")][1].startswith("for good")
    assert rig.store.unrestorable(rig.fp)


async def test_a_verification_that_reused_its_tokens_starts_the_count_again(rig: Rig) -> None:
    rig.fake.now = [idle(0, 5, 10)]
    await rolling(rig)
    for cache_n in (0, None, 0):
        rig.fake.cache_n = cache_n
        await rig.src.restore(rig.ctx, PID)
    assert len(rig.named("slot_restore_unused")) == 2 and len(rig.named("slot_restored")) == 1
    assert not rig.store.unrestorable(rig.fp)


async def test_a_verification_that_reused_part_of_its_tokens_is_a_failed_restore_not_a_verdict(rig: Rig) -> None:
    rig.fake.now = [idle(0, 5, 10)]
    await rolling(rig)
    for _ in range(UNRESTORABLE_AFTER + 1):
        rig.fake.cache_n = 4
        await rig.src.restore(rig.ctx, PID)
    assert rig.named("slot_restore_unused") == []
    assert [e["error"] for e in rig.named("slot_restore_failed")] == \
        ["its verification reused only 4 of its 10 tokens"] * (UNRESTORABLE_AFTER + 1)
    assert not rig.store.unrestorable(rig.fp)
