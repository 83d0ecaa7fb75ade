"""A save never destroys the last good pair (slot file + manifest) before the new pair is whole: a
daemon SIGKILLed at any point of a commit leaves the old conversation restorable, or the new one.

Deterministic injection, no sleep: in a forked child the store commits a new save with the file
system calls it makes (open, write, fsync, rename, unlink, close) counted, and the child SIGKILLs
itself just before call number ``k``; ``k`` runs over every call of the commit, then one past the
last (no kill). After each, a new store (the next daemon's) prepares and checks the directory.

Regression: the old commit renamed the new file over the old one before it wrote the
manifest: a kill between the two (120 ms into a save on the attacker's host) left a new file beside
the old manifest, both refused: both conversations lost.
"""

from __future__ import annotations

import os
import signal
import struct
from pathlib import Path

import pytest
from llama_guard.config.server import ServerConfig
from llama_guard.host.build import Build
from llama_guard.slots.fingerprint import Fingerprint, fingerprint_of
from llama_guard.slots.store import SlotStore

TEST_BUILD = Build(Path("/opt/llama/llama-server"), "ab" * 32, "version: 11434 (abc1234)", "b11434 (abc1234)")

OLD, NEW = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7]
COUNTED = ("open", "write", "fsync", "replace", "rename", "unlink", "rmdir", "close")


def slot_file(path: Path, tokens: list[int]) -> None:
    packed = [0xFFFFFFFF, 1, len(tokens), *tokens, 0]
    body = struct.pack("<III", 0x67677371, 4, len(packed)) + struct.pack(f"<{len(packed)}I", *packed)
    path.write_bytes(body + os.urandom(1 << 16))


def commit_killed_at(store: SlotStore, fp: Fingerprint, name: str, k: int) -> bool:
    """Commit ``name`` in a child killed before its ``k``-th counted call; whether it was killed."""
    pid = os.fork()
    if pid == 0:  # the child: count, and die where told
        try:
            calls = [0]
            for fn_name in COUNTED:
                real = getattr(os, fn_name)

                def counted(*args: object, _real: object = real, **kwargs: object) -> object:
                    if calls[0] == k:
                        os.kill(os.getpid(), signal.SIGKILL)
                    calls[0] += 1
                    return _real(*args, **kwargs)  # type: ignore[operator]

                setattr(os, fn_name, counted)
            store.commit(0, name, fp)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_kill_at_any_point_of_a_save_leaves_the_old_pair_or_the_new_one(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + os.urandom(5000))
    fp = fingerprint_of(ServerConfig(model=model), TEST_BUILD)
    outcomes: list[list[int]] = []
    for k in range(200):
        root = tmp_path / f"slots-{k}"
        store = SlotStore(root, 1 << 30)
        store.prepare()
        first = store.new_name(0)
        slot_file(root / first, OLD)
        store.commit(0, first, fp)
        second = store.new_name(0)
        slot_file(root / second, NEW)  # llama-server's save is whole; the commit is what is killed
        killed = commit_killed_at(store, fp, second, k)
        after = SlotStore(root, 1 << 30)  # the next daemon
        after.prepare()
        good, refused = after.check(fp)
        assert refused == [], f"killed before call {k}: {refused}"
        assert len(good) == 1, f"killed before call {k}: nothing restorable"
        tokens = after.tokens(good[0])
        outcomes.append(tokens)
        assert sorted(p.name for p in root.iterdir()) == sorted([good[0].file, "llama-guard-slot-0.json"])
        if not killed:
            assert tokens == NEW
            break
    else:
        pytest.fail("the commit never finished in 200 calls")
    assert outcomes[0] == OLD and outcomes[-1] == NEW and len(outcomes) > 5
