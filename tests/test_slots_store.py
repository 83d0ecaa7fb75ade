"""The slot store: a committed file is restorable only into a server of the same fingerprint, and a
truncated, corrupt, foreign or manifest-less file is refused (and removed) before any server sees it;
the budget drops the oldest; a model+build whose restore reused nothing is remembered on disk.

The files are written in llama.cpp's slot-file layout (``ggsq`` header, the server's token list,
then the KV state), as llama-server writes them; the real server's own files are exercised end to
end in test_slots_e2e.py.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import pytest
from llama_guard.argv import build_argv, slot_save_dir
from llama_guard.config.sections import RuntimeConfig, SlotsConfig
from llama_guard.config.server import ServerConfig
from llama_guard.slots.fingerprint import Fingerprint, fingerprint_of, kv_args
from llama_guard.slots.store import UNRESTORABLE_AFTER, Manifest, Refusal, SlotStore, StoreError


def slot_file(path: Path, tokens: list[int], state_bytes: int = 4096) -> None:
    """A slot file as llama-server writes it (state_seq_save_file with server_tokens::serialize)."""
    packed = [0xFFFFFFFF, 1, len(tokens), *tokens, 0]
    body = struct.pack("<III", 0x67677371, 4, len(packed)) + struct.pack(f"<{len(packed)}I", *packed)
    path.write_bytes(body + os.urandom(state_bytes))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + os.urandom(5000))
    return path


@pytest.fixture
def fp(model: Path) -> Fingerprint:
    return fingerprint_of(ServerConfig(model=model, ctx_size=2048, parallel=2), "version: 11434 (abc)")


@pytest.fixture
def store(tmp_path: Path) -> SlotStore:
    s = SlotStore(tmp_path / "slots", 1 << 30)
    s.prepare()
    return s


def save(store: SlotStore, fp: Fingerprint, slot_id: int, tokens: list[int], state_bytes: int = 4096) -> Manifest:
    name = store.new_name(slot_id)
    slot_file(store.root / name, tokens, state_bytes)
    return store.commit(slot_id, name, fp)


def test_a_committed_file_checks_out_with_its_tokens(store: SlotStore, fp: Fingerprint) -> None:
    manifest = save(store, fp, 1, [5, 6, 7, 8])
    good, refused = store.check(fp)
    assert (good, refused) == ([manifest], [])
    assert manifest.n_tokens == 4 and manifest.bytes == (store.root / manifest.file).stat().st_size
    assert store.tokens(manifest) == [5, 6, 7, 8]
    assert sorted(p.name for p in store.root.iterdir()) == [manifest.file, "llama-guard-slot-1.json"]


@pytest.mark.parametrize("kind", list(Refusal))
def test_each_bad_file_kind_is_refused_and_removed(store: SlotStore, fp: Fingerprint, kind: Refusal) -> None:
    manifest = save(store, fp, 0, list(range(100)))
    path = store.root / manifest.file
    check_fp = fp
    if kind is Refusal.TRUNCATED:
        path.write_bytes(path.read_bytes()[:-100])
    elif kind is Refusal.CORRUPT:
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    elif kind is Refusal.FOREIGN:
        check_fp = dataclasses.replace(fp, ctx_size=4096)
    elif kind is Refusal.NO_MANIFEST:
        (store.root / f"llama-guard-slot-{manifest.slot_id}.json").write_text("{not json")
    elif kind is Refusal.UNSAFE:  # llama-server's user swaps the file for a link (more kinds: test_slots_files)
        path.unlink()
        path.symlink_to("/dev/zero")
    good, refused = store.check(check_fp)
    assert good == []
    assert [(r.file, r.refusal) for r in refused] == [(manifest.file, kind)]
    assert not os.path.lexists(path)
    if kind is Refusal.FOREIGN:
        assert "ctx_size" in refused[0].detail


def test_a_file_with_a_foreign_header_is_never_committed(store: SlotStore, fp: Fingerprint) -> None:
    name = store.new_name(0)
    (store.root / name).write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(StoreError, match="not a slot file"):
        store.commit(0, name, fp)
    assert list(store.root.iterdir()) == []


def test_a_changed_model_file_is_another_fingerprint(model: Path, fp: Fingerprint) -> None:
    model.write_bytes(b"GGUF" + os.urandom(5000))
    again = fingerprint_of(ServerConfig(model=model, ctx_size=2048, parallel=2), fp.build)
    assert again.key != fp.key and again.model_build_key != fp.model_build_key


def test_the_budget_drops_the_oldest(tmp_path: Path, fp: Fingerprint) -> None:
    store = SlotStore(tmp_path / "slots", 10_000)
    store.prepare()
    first = save(store, fp, 0, [1, 2], 6000)
    second = save(store, fp, 1, [3, 4], 6000)
    assert store.prune() == [first]
    assert store.committed() == [second]


def test_unrestorable_is_remembered_on_disk(tmp_path: Path, store: SlotStore, fp: Fingerprint) -> None:
    assert not store.unrestorable(fp)
    for _ in range(UNRESTORABLE_AFTER):
        store.note_unused(fp)
    again = SlotStore(store.root, store.budget_bytes)
    assert again.unrestorable(fp)
    assert not again.unrestorable(dataclasses.replace(fp, build="version: 11435 (def)"))
    assert again.unrestorable(dataclasses.replace(fp, ctx_size=4096))  # same model and build


def test_slot_save_path_is_added_unless_the_user_gave_one(tmp_path: Path) -> None:
    runtime = RuntimeConfig(dir=tmp_path / "run")
    # Not yet made (no slots watcher ran): llama-server would refuse a path that is not a directory.
    assert "--slot-save-path" not in build_argv(ServerConfig(), None, SlotsConfig(), runtime)
    (tmp_path / "run" / "slots").mkdir(parents=True)
    argv = build_argv(ServerConfig(), None, SlotsConfig(), runtime)
    assert argv[argv.index("--slot-save-path") + 1] == str(tmp_path / "run" / "slots")
    own = ServerConfig(extra_args=["--slot-save-path", str(tmp_path / "mine")])
    argv = build_argv(own, None, SlotsConfig(), runtime)
    assert argv.count("--slot-save-path") == 1 and argv[-1] == str(tmp_path / "mine")
    assert slot_save_dir(own, SlotsConfig(), runtime) == tmp_path / "mine"
    assert "--slot-save-path" not in build_argv(ServerConfig(), None, SlotsConfig(enabled=False), runtime)


def test_the_default_slot_directory_is_the_units_state_directory_kept_across_restarts(tmp_path: Path) -> None:
    runtime = RuntimeConfig(dir=tmp_path / "run")
    state = {"STATE_DIRECTORY": f"{tmp_path}/state:{tmp_path}/other"}
    assert slot_save_dir(ServerConfig(), SlotsConfig(), runtime, state) == tmp_path / "state" / "slots"
    assert slot_save_dir(ServerConfig(), SlotsConfig(), runtime, {}) == tmp_path / "run" / "slots"
    assert slot_save_dir(ServerConfig(), SlotsConfig(), runtime, {"STATE_DIRECTORY": "relative"}) == \
        tmp_path / "run" / "slots"
    chosen = SlotsConfig(dir=str(tmp_path / "chosen"))
    assert slot_save_dir(ServerConfig(), chosen, runtime, state) == tmp_path / "chosen"


def test_only_kv_layout_flags_enter_the_fingerprint() -> None:
    assert kv_args(["--swa-full", "--threads-http", "4", "--rope-freq-base", "10000", "--lora=a.gguf"]) == (
        "--swa-full", "--rope-freq-base", "10000", "--lora=a.gguf")


def test_a_slot_directory_llama_servers_user_cannot_reach_is_refused(tmp_path: Path) -> None:
    """llama-server refuses to start on a --slot-save-path it cannot enter: the store says so first
    (the slots watcher then turns the carry-over off and gives llama-server no such path)."""
    import errno

    tmp_path.chmod(0o700)  # root's: uid 65534 may not search it
    store = SlotStore(tmp_path / "slots", 1 << 20)
    with pytest.raises(PermissionError, match="uid 65534 cannot enter") as refused:
        store.prepare(65534, (65534,))
    assert refused.value.errno == errno.EACCES and "uid 65534 cannot enter" in str(refused.value)
    assert (tmp_path / "slots").stat().st_uid == 0  # not handed over
