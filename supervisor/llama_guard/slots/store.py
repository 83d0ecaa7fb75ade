"""The slot files llama-guard keeps: one file per slot id, written by llama-server, committed
with a sidecar manifest, refused before they reach llama-server when they do not check out.

In the store directory (llama-server's ``--slot-save-path``), for slot ``N``:
``llama-guard-slot-N.incoming`` is what llama-server writes on a save; :meth:`SlotStore.commit`
checks it, hashes it and renames it to ``llama-guard-slot-N.bin``, then writes
``llama-guard-slot-N.json`` (the :class:`Manifest`) by rename, so a crash at any point leaves either
the previous pair, or a pair whose hash does not match (refused). Other files (the user's own, in a
directory given by ``--slot-save-path``) are never touched.

A file is refused (:class:`Refusal`) when it has no readable manifest, is shorter or longer than its
manifest says (truncated), its sha256 or llama.cpp's header (``ggsq`` magic, version
:data:`SEQ_VERSION`, the token list, llama.cpp ``src/llama-context.cpp`` ``state_seq_save_file``
and ``tools/server/server-common.cpp`` ``server_tokens::serialize``) do not check out (corrupt), or
it was written by a server with another :class:`~.fingerprint.Fingerprint` (foreign). A refused
file is removed. Models whose restores reused nothing are remembered in ``unrestorable.json``.
All methods block (file I/O): call them off the event loop.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import json
import os
import stat
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from llama_guard.slots.fingerprint import Fingerprint

PREFIX = "llama-guard-slot-"
UNRESTORABLE = "unrestorable.json"
SEQ_MAGIC = 0x67677371  # 'ggsq', LLAMA_STATE_SEQ_MAGIC
SEQ_VERSION = 4  # LLAMA_STATE_SEQ_VERSION of the builds this reader knows
TOKENS_STATE_MARK = 0xFFFFFFFF  # server_tokens::serialize starts with LLAMA_TOKEN_NULL, then its version
TOKENS_STATE_VERSION = 1
HASH_CHUNK = 1 << 22


class Refusal(enum.Enum):
    """Why a slot file is not restored."""

    NO_MANIFEST = "no_manifest"  # no sidecar manifest, or one that does not parse
    TRUNCATED = "truncated"      # its size is not the manifest's (or the file is gone)
    CORRUPT = "corrupt"          # its sha256 or its llama.cpp header does not check out
    FOREIGN = "foreign"          # written by a server with another fingerprint


class StoreError(Exception):
    """A file llama-server wrote that cannot be committed (the reason is the message)."""


@dataclass(frozen=True)
class Manifest:
    """What llama-guard knows of one committed slot file: the fingerprint (``fingerprint_key``, and the
    fields for reports), ``slot_id``, ``n_tokens`` (the slot's tokens), ``bytes``, ``sha256`` (hex) and
    ``saved_at`` (Unix seconds: the oldest is dropped first)."""

    fingerprint_key: str
    fingerprint: dict[str, object]
    slot_id: int
    n_tokens: int
    bytes: int
    sha256: str
    saved_at: float

    @property
    def file(self) -> str:
        """The slot file's name in the store (what llama-server is told)."""
        return f"{PREFIX}{self.slot_id}.bin"


@dataclass(frozen=True)
class Refused:
    """A file that did not check out (``file`` its name in the store), removed."""

    file: str
    refusal: Refusal
    detail: str


def read_tokens(path: Path) -> list[int]:
    """The token ids of slot file ``path`` (its header). Raises StoreError when the header is not
    one this reader knows or the file ends inside it, OSError when it cannot be read."""
    with path.open("rb") as handle:
        head = handle.read(12)
        if len(head) < 12:
            raise StoreError("shorter than a slot file's header")
        magic, version, n_packed = struct.unpack("<III", head)
        if magic != SEQ_MAGIC or version != SEQ_VERSION:
            raise StoreError(f"not a slot file of a known version (magic {magic:#x}, version {version})")
        raw = handle.read(4 * n_packed)
        if len(raw) < 4 * n_packed:
            raise StoreError("ends inside its token list")
    packed = list(struct.unpack(f"<{n_packed}I", raw))
    if packed[:2] != [TOKENS_STATE_MARK, TOKENS_STATE_VERSION]:
        return [t for t in struct.unpack(f"<{n_packed}i", raw)]  # builds before server_tokens' own state
    if len(packed) < 3 or len(packed) < 3 + packed[2] + 1:
        raise StoreError("its token list is cut short")
    n = packed[2]
    if packed[3 + n] != 0:
        raise StoreError("it holds media chunks (a multimodal prompt): not restored")
    return packed[3:3 + n]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class SlotStore:
    """The slot files under ``root`` (created 0700 by :meth:`prepare`), at most ``budget_bytes`` in all."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes

    def prepare(self, owner_uid: int | None = None, owner_gids: tuple[int, ...] = ()) -> None:
        """Create the directory (0700; owned by ``owner_uid`` when given: llama-server writes the files)
        and remove files a crash left half-done. Raises OSError, also when llama-server's user
        (``owner_uid`` with the groups ``owner_gids``) could not reach it through its parents."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if owner_uid is not None:
            blocked = unsearchable_parent(self.root, owner_uid, owner_gids)
            if blocked is not None:
                mode = blocked.stat().st_mode & 0o777
                raise OSError(errno.EACCES, f"uid {owner_uid} cannot enter {blocked} (mode {mode:o})")
            if self.root.stat().st_uid != owner_uid:
                os.chown(self.root, owner_uid, -1)
        for path in self.root.glob(f"{PREFIX}*"):
            if path.name.endswith((".incoming", ".tmp")):
                path.unlink(missing_ok=True)

    @staticmethod
    def incoming(slot_id: int) -> str:
        """The name llama-server saves slot ``slot_id`` under, before :meth:`commit`."""
        return f"{PREFIX}{slot_id}.incoming"

    def commit(self, slot_id: int, fingerprint: Fingerprint) -> Manifest:
        """Check, hash and rename the file llama-server just saved for ``slot_id``; write its
        manifest. Raises StoreError (the file is removed) or OSError."""
        src = self.root / self.incoming(slot_id)
        try:
            tokens = read_tokens(src)
        except StoreError:
            src.unlink(missing_ok=True)
            raise
        manifest = Manifest(fingerprint.key, fingerprint.as_dict(), slot_id, len(tokens), src.stat().st_size,
                            _sha256(src), time.time())
        os.replace(src, self.root / manifest.file)
        _write_atomic(self._manifest_path(slot_id), json.dumps(asdict(manifest), sort_keys=True))
        return manifest

    def _manifest_path(self, slot_id: int) -> Path:
        return self.root / f"{PREFIX}{slot_id}.json"

    def _read_manifest(self, path: Path) -> Manifest | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            manifest = Manifest(**data)
        except (OSError, ValueError, TypeError):
            return None
        ints = (manifest.slot_id, manifest.n_tokens, manifest.bytes)
        if not all(isinstance(v, int) for v in ints) or not isinstance(manifest.sha256, str):
            return None
        return manifest

    def _remove(self, slot_id: int) -> None:
        for path in (self.root / f"{PREFIX}{slot_id}.bin", self._manifest_path(slot_id)):
            with contextlib.suppress(OSError):
                path.unlink()

    def committed(self) -> list[Manifest]:
        """The manifests that parse, oldest first (nothing is checked or removed)."""
        found = [m for p in self.root.glob(f"{PREFIX}*.json") if (m := self._read_manifest(p)) is not None]
        return sorted(found, key=lambda m: m.saved_at)

    def check(self, fingerprint: Fingerprint) -> tuple[list[Manifest], list[Refused]]:
        """The files that may be restored into a server of ``fingerprint``, and those refused (removed)."""
        good: list[Manifest] = []
        refused: list[Refused] = []
        ids = {int(p.name[len(PREFIX):].split(".")[0]) for p in self.root.glob(f"{PREFIX}*")
               if p.name[len(PREFIX):].split(".")[0].isdigit()}
        for slot_id in sorted(ids):
            verdict = self._check_one(slot_id, fingerprint)
            if isinstance(verdict, Refused):
                self._remove(slot_id)
                refused.append(verdict)
            else:
                good.append(verdict)
        return good, refused

    def _check_one(self, slot_id: int, fingerprint: Fingerprint) -> Manifest | Refused:
        name = f"{PREFIX}{slot_id}.bin"
        manifest = self._read_manifest(self._manifest_path(slot_id))
        if manifest is None or manifest.slot_id != slot_id:
            return Refused(name, Refusal.NO_MANIFEST, "no readable manifest beside it")
        if manifest.fingerprint_key != fingerprint.key:
            theirs, ours = manifest.fingerprint, fingerprint.as_dict()
            differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            return Refused(name, Refusal.FOREIGN, f"written by a server with another {', '.join(differ) or 'layout'}")
        path = self.root / name
        try:
            size = path.stat().st_size
        except OSError:
            return Refused(name, Refusal.TRUNCATED, "the file is missing")
        if size != manifest.bytes:
            return Refused(name, Refusal.TRUNCATED, f"{size} bytes, its manifest says {manifest.bytes}")
        try:
            if _sha256(path) != manifest.sha256:
                return Refused(name, Refusal.CORRUPT, "its sha256 is not its manifest's")
            if len(read_tokens(path)) != manifest.n_tokens:
                return Refused(name, Refusal.CORRUPT, "its token count is not its manifest's")
        except (StoreError, OSError) as exc:
            return Refused(name, Refusal.CORRUPT, str(exc))
        return manifest

    def prune(self) -> list[Manifest]:
        """Drop the oldest committed files until the rest fit the budget; the dropped ones."""
        kept = self.committed()
        dropped: list[Manifest] = []
        while kept and sum(m.bytes for m in kept) > self.budget_bytes:
            oldest = kept.pop(0)
            self._remove(oldest.slot_id)
            dropped.append(oldest)
        return dropped

    def unrestorable(self, fingerprint: Fingerprint) -> bool:
        """Whether a restore with this model and build reused nothing before (remembered on disk)."""
        return fingerprint.model_build_key in self._marks()

    def mark_unrestorable(self, fingerprint: Fingerprint) -> None:
        """Remember that restores with this model and build reuse nothing."""
        marks = self._marks()
        marks[fingerprint.model_build_key] = {"model": fingerprint.model.path, "build": fingerprint.build}
        _write_atomic(self.root / UNRESTORABLE, json.dumps(marks, sort_keys=True))

    def _marks(self) -> dict[str, object]:
        try:
            data = json.loads((self.root / UNRESTORABLE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def unsearchable_parent(path: Path, uid: int, gids: tuple[int, ...]) -> Path | None:
    """The first parent of ``path`` that ``uid`` (with the groups ``gids``) may not search (no x bit
    for it by owner, group or other; ACLs not read), or None when every parent lets it through."""
    for parent in reversed(path.parents):
        st = parent.stat()
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid in gids else stat.S_IXOTH
        if uid != 0 and not st.st_mode & bit:
            return parent
    return None
