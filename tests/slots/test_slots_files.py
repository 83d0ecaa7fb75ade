"""Nothing llama-server's user plants in the slot directory steers llama-guard (root): for every path
the store opens, creates, renames, hashes or removes there (docs/slots.md, "What llama-guard touches"),
each plant — a symbolic link to a root-only file, a hard link to it, a FIFO, a link to a device
(/dev/zero, /dev/urandom), a huge sparse file, a directory — must: leave the root-only file as it
was, end (never block or hash forever), be refused with a message that says what it is, be removed
(the name itself) or set aside, and leave later saves working.

Regression: a link ``llama-guard-slot-0.json.tmp`` -> a root-only file was truncated and
overwritten at the next save; a ``.bin`` linked to /dev/zero (or a FIFO) was hashed forever, the link
never removed, the error message empty, and every later save off.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from llama_guard.config.server import ServerConfig
from llama_guard.host.build import Build
from llama_guard.host.safe_files import FileRefused
from llama_guard.slots.fingerprint import Fingerprint, fingerprint_of
from llama_guard.slots.store import UNRESTORABLE, UNRESTORABLE_AFTER, Manifest, Refusal, SlotStore, StoreError

TEST_BUILD = Build(Path("/opt/llama/llama-server"), "ab" * 32, "version: 11434 (abc1234)", "b11434 (abc1234)")

SECRET = b"root:only:this file must never change\n"
PLANTS = ["link to a root-only file", "hard link to a root-only file", "FIFO", "link to /dev/zero",
          "link to /dev/urandom", "huge sparse file", "directory"]
T = TypeVar("T")


def ends(fn: Callable[[], T]) -> T:
    """``fn()``, which must end (a FIFO opened for reading without a writer would block forever)."""
    out: list[T] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed back to the test's thread
            errors.append(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the call blocked (FIFO, device or an endless read)"
    if errors:
        raise errors[0]
    return out[0]


def slot_file(path: Path, tokens: list[int], state_bytes: int = 4096) -> None:
    packed = [0xFFFFFFFF, 1, len(tokens), *tokens, 0]
    body = struct.pack("<III", 0x67677371, 4, len(packed)) + struct.pack(f"<{len(packed)}I", *packed)
    path.write_bytes(body + os.urandom(state_bytes))


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A root-only file (mode 0600) outside the slot directory."""
    home = tmp_path / "root-only"
    home.mkdir(mode=0o700)
    path = home / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


@pytest.fixture
def fp(tmp_path: Path) -> Fingerprint:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + os.urandom(5000))
    return fingerprint_of(ServerConfig(model=model, ctx_size=2048, parallel=2), TEST_BUILD)


@pytest.fixture
def store(tmp_path: Path) -> SlotStore:
    s = SlotStore(tmp_path / "slots", 64 << 20)
    s.prepare()
    return s


def plant(path: Path, kind: str, secret: Path) -> None:
    if kind == "link to a root-only file":
        path.symlink_to(secret)
    elif kind == "hard link to a root-only file":
        os.link(secret, path)
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "link to /dev/urandom":
        path.symlink_to("/dev/urandom")
    elif kind == "huge sparse file":
        with path.open("wb") as handle:
            handle.truncate(1 << 40)  # 1 TiB, no block written
    else:
        path.mkdir()
        (path / "inside").write_bytes(b"x")  # not empty: rmdir cannot take it


def save(store: SlotStore, fp: Fingerprint, slot_id: int, tokens: list[int]) -> Manifest:
    name = store.new_name(slot_id)
    slot_file(store.root / name, tokens)
    return store.commit(slot_id, name, fp)


def untouched(secret: Path) -> None:
    assert secret.read_bytes() == SECRET and secret.stat().st_mode & 0o777 == 0o600


def saves_still_work(store: SlotStore, fp: Fingerprint) -> None:
    manifest = save(store, fp, 0, [7, 8, 9])
    good, refused = store.check(fp)
    assert (good, refused) == ([manifest], [])


WHAT = {"link to a root-only file": "symbolic link", "hard link to a root-only file": "2 hard links",
        "FIFO": "a FIFO", "link to /dev/zero": "symbolic link", "link to /dev/urandom": "symbolic link",
        "huge sparse file": "more than the bound", "directory": "a directory"}


@pytest.mark.parametrize("kind", PLANTS)
def test_a_plant_in_place_of_the_file_llama_server_saved_is_refused_removed_and_the_old_pair_stays(
        store: SlotStore, fp: Fingerprint, secret: Path, kind: str) -> None:
    old = save(store, fp, 0, [1, 2, 3])
    name = store.new_name(0)
    plant(store.root / name, kind, secret)
    with pytest.raises(StoreError) as refused:
        ends(lambda: store.commit(0, name, fp))
    assert name in str(refused.value) and WHAT[kind] in str(refused.value)
    untouched(secret)
    assert not os.path.lexists(store.root / name)
    assert store.check(fp) == ([old], [])  # the last good pair is whole
    saves_still_work(store, fp)


@pytest.mark.parametrize("kind", PLANTS)
def test_a_plant_in_place_of_a_committed_slot_file_is_refused_before_any_read_and_removed(
        store: SlotStore, fp: Fingerprint, secret: Path, kind: str) -> None:
    old = save(store, fp, 0, [1, 2, 3])
    (store.root / old.file).unlink()
    plant(store.root / old.file, kind, secret)
    good, refused = ends(lambda: store.check(fp))
    assert good == [] and len(refused) == 1
    assert refused[0].file == old.file and refused[0].detail
    assert refused[0].refusal is Refusal.UNSAFE
    assert WHAT[kind] in refused[0].detail
    untouched(secret)
    assert not os.path.lexists(store.root / old.file)
    saves_still_work(store, fp)


@pytest.mark.parametrize("kind", PLANTS)
def test_a_plant_in_place_of_a_manifest_is_refused_removed_and_never_written_through(
        store: SlotStore, fp: Fingerprint, secret: Path, kind: str) -> None:
    old = save(store, fp, 0, [1, 2, 3])
    manifest = store.root / "llama-guard-slot-0.json"
    manifest.unlink()
    plant(manifest, kind, secret)
    assert ends(store.committed) == []
    # The next save replaces the name (rename), never writes through it.
    again = ends(lambda: save(store, fp, 0, [4, 5]))
    untouched(secret)
    assert store.check(fp) == ([again], [])
    assert not os.path.lexists(store.root / old.file)
    # And a plant found by the check before a restore: refused, removed.
    manifest.unlink()
    plant(manifest, kind, secret)
    good, refused = ends(lambda: store.check(fp))
    assert good == [] and [r.file for r in refused] == [again.file] and refused[0].detail
    untouched(secret)
    assert not os.path.lexists(manifest) and not os.path.lexists(store.root / again.file)
    saves_still_work(store, fp)


@pytest.mark.parametrize("name", ["llama-guard-slot-0.json.tmp", "unrestorable.json.tmp",
                                  "llama-guard-slot-1.incoming"])
@pytest.mark.parametrize("kind", PLANTS)
def test_a_plant_at_a_temporary_name_is_never_written_through_and_removed_at_the_next_start(
        store: SlotStore, fp: Fingerprint, secret: Path, kind: str, name: str) -> None:
    """The issue's attack: ``llama-guard-slot-0.json.tmp`` -> a root-only file, then a save."""
    plant(store.root / name, kind, secret)
    ends(lambda: save(store, fp, 0, [1, 2, 3]))
    ends(lambda: store.note_unused(fp))
    untouched(secret)
    ends(store.prepare)  # every start: what a crash left half-done goes, the name itself
    untouched(secret)
    assert not os.path.lexists(store.root / name)
    saves_still_work(store, fp)


@pytest.mark.parametrize("kind", PLANTS)
def test_a_plant_in_place_of_unrestorable_json_is_set_aside_and_counts_start_again(
        store: SlotStore, fp: Fingerprint, secret: Path, kind: str) -> None:
    for _ in range(UNRESTORABLE_AFTER):
        store.note_unused(fp)
    assert store.unrestorable(fp)
    (store.root / UNRESTORABLE).unlink()
    plant(store.root / UNRESTORABLE, kind, secret)
    assert not ends(lambda: store.unrestorable(fp))
    [aside] = store.take_set_aside()
    assert aside.file == UNRESTORABLE and aside.refusal is Refusal.UNSAFE and aside.detail
    untouched(secret)
    assert not os.path.lexists(store.root / UNRESTORABLE)
    assert store.note_unused(fp) == 1  # a file of llama-guard's own again
    untouched(secret)
    saves_still_work(store, fp)


def test_a_slot_file_of_another_user_than_llama_servers_is_refused(store: SlotStore, fp: Fingerprint) -> None:
    store.file_owner = 65534  # llama-server's user; the file below is root's
    name = store.new_name(0)
    slot_file(store.root / name, [1, 2])
    with pytest.raises(StoreError, match="belongs to uid 0, not to uid 65534"):
        store.commit(0, name, fp)
    assert not os.path.lexists(store.root / name)


def test_hashing_ends_at_its_deadline_however_long_the_file(tmp_path: Path, fp: Fingerprint) -> None:
    """The deadline ends the read itself (not only the wait for it): a store whose deadline is already
    past reads one chunk of a file of several, then stops — a slow disk, not a bad file: nothing is
    removed, the next check (with time) restores it. A commit past its deadline keeps the old pair."""
    store = SlotStore(tmp_path / "slots", 1 << 30)
    store.prepare()
    name = store.new_name(0)
    slot_file(store.root / name, [1, 2], state_bytes=3 << 22)  # three chunks and more
    manifest = store.commit(0, name, fp)
    store.io_timeout_s = -1.0
    with pytest.raises(FileRefused, match=f"did not end in time .* of {manifest.bytes} bytes"):
        store.check(fp)
    newer = store.new_name(0)
    slot_file(store.root / newer, [1, 2, 3], state_bytes=3 << 22)
    with pytest.raises(StoreError, match="did not end in time"):
        store.commit(0, newer, fp)
    assert not os.path.lexists(store.root / newer)
    store.io_timeout_s = 60.0
    assert store.check(fp) == ([manifest], [])


def test_a_header_claiming_more_tokens_than_any_context_is_not_read(store: SlotStore, fp: Fingerprint) -> None:
    name = store.new_name(0)
    with (store.root / name).open("wb") as handle:
        handle.write(struct.pack("<III", 0x67677371, 4, 1 << 30))
        handle.truncate(8 << 30)  # 8 GiB, sparse: within a budget of that size
    store.budget_bytes = 8 << 30
    with pytest.raises(StoreError, match="claims 1073741824 tokens"):
        ends(lambda: store.commit(0, name, fp))


def test_a_manifest_naming_a_file_outside_its_slot_is_refused(store: SlotStore, fp: Fingerprint,
                                                              secret: Path) -> None:
    """The manifest is in llama-server's user's directory too: it may name only a slot file of its slot."""
    good = save(store, fp, 0, [1, 2, 3])
    path = store.root / "llama-guard-slot-0.json"
    for named in ("../root-only/secret", str(secret), "llama-guard-slot-1.bin"):
        path.write_text(path.read_text().replace(good.file, named))
        [refused] = store.check(fp)[1]
        assert refused.refusal is Refusal.NO_MANIFEST and "not a slot file of slot 0" in refused.detail
        untouched(secret)
        good = save(store, fp, 0, [1, 2, 3])


def test_a_slot_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "slots").symlink_to(elsewhere)
    store = SlotStore(tmp_path / "slots", 1 << 20)
    with pytest.raises(FileRefused, match="is a symbolic link, not a directory"):
        store.prepare(65534)
    assert elsewhere.stat().st_uid == 0  # not handed to llama-server's user
