"""The slot files llama-guard keeps: written by llama-server, committed with a sidecar manifest,
refused before they reach llama-server when they do not check out.

In the store directory (llama-server's ``--slot-save-path``, which belongs to llama-server's user),
for slot ``N``: each save gets a new name, ``llama-guard-slot-N-<hex>.bin`` (:meth:`SlotStore.new_name`),
which llama-server writes; :meth:`SlotStore.commit` checks and hashes it, then writes the manifest
``llama-guard-slot-N.json`` (the :class:`Manifest`, naming its ``.bin``) by an atomic rename, and only
then removes the previous ``.bin``. A crash at any point leaves the last good pair whole: before the
manifest's rename, the old manifest still names the old file (the new one is an orphan, removed by
:meth:`SlotStore.prepare`); after it, the new pair. Other files (the user's own, in a directory given
by ``--slot-save-path``) are never touched.

Nothing llama-server's user plants there steers llama-guard (see docs/slots.md, "What llama-guard
touches"): every file is handled through :mod:`llama_guard.host.safe_files` (no link followed, a slot
file only when it is a regular file of llama-server's user of at most ``budget_bytes``, a manifest
only when it is llama-guard's own of at most :data:`SMALL_FILE_BYTES`, every read bounded by the
store's deadline ``io_timeout_s``, temporaries created exclusively), and a manifest names only a
slot file of its own slot.

A file is refused (:class:`Refusal`) when it has no readable manifest, is shorter or longer than its
manifest says (truncated), its sha256 or llama.cpp's header (``ggsq`` magic, version
:data:`SEQ_VERSION`, the token list, llama.cpp ``src/llama-context.cpp`` ``state_seq_save_file``
and ``tools/server/server-common.cpp`` ``server_tokens::serialize``) do not check out (corrupt), it
was written by a server with another :class:`~.fingerprint.Fingerprint` key (foreign), it was saved
by another llama-server build and its :class:`StateFormat` is not the one this build writes, as
measured from a save of this build's own (build), or it is not a file llama-guard may read (unsafe).
A refused file is removed. Verifications that reused nothing
are counted per model and build in ``unrestorable.json``: :data:`UNRESTORABLE_AFTER` in a row stop
the carry-over for them. All methods block (file I/O): call them off the event loop.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from llama_guard.host.paths import unsearchable_parent
from llama_guard.host.safe_files import FileRefused, SafeDir, read_through
from llama_guard.slots.fingerprint import Fingerprint
from llama_guard.slots.header import HeaderError, StateFormat, state_format_of, tokens_of

PREFIX = "llama-guard-slot-"
UNRESTORABLE = "unrestorable.json"
UNRESTORABLE_AFTER = 2  # verifications in a row that reused nothing before restores stop for good
SMALL_FILE_BYTES = 1 << 16  # a manifest or unrestorable.json: anything larger is not llama-guard's
IO_TIMEOUT_S = 50.0  # one store call's reads end by then (seconds): hashing a few GiB of slot files
_BIN = re.compile(rf"{PREFIX}(\d+)(?:-[0-9a-f]+)?\.bin\Z")  # -<hex>: this version's names; none: older ones
_MANIFEST = re.compile(rf"{PREFIX}(\d+)\.json\Z")
_LEFTOVER = re.compile(rf"({PREFIX}\d+.*|{re.escape(UNRESTORABLE)})\.(incoming|tmp)\Z")


class Refusal(enum.Enum):
    """Why a slot file is not restored."""

    NO_MANIFEST = "no_manifest"  # no sidecar manifest, or one that does not parse
    TRUNCATED = "truncated"      # its size is not the manifest's (or the file is gone)
    CORRUPT = "corrupt"          # its sha256 or its llama.cpp header does not check out
    FOREIGN = "foreign"          # written by a server with another fingerprint
    BUILD = "build"              # saved by another build, its state format not known to be this build's
    UNSAFE = "unsafe"            # a link, FIFO, device, another user's file, larger than the budget: never read


class StoreError(Exception):
    """A file llama-server wrote that cannot be committed (the reason is the message)."""


@dataclass(frozen=True)
class Manifest:
    """What llama-guard knows of one committed slot file: the fingerprint (``fingerprint_key``, and the
    fields, the build that saved it among them: ``Fingerprint.as_dict``), ``slot_id``, ``n_tokens``
    (the slot's tokens), ``bytes``, ``sha256`` (hex), ``saved_at`` (Unix seconds: the oldest is dropped
    first), ``file``, the slot file's name in the store (what llama-server is told), and
    ``state_format``, its :class:`StateFormat` as committed (None in manifests of older versions)."""

    fingerprint_key: str
    fingerprint: dict[str, object]
    slot_id: int
    n_tokens: int
    bytes: int
    sha256: str
    saved_at: float
    file: str
    state_format: dict[str, int | None] | None = None

    @property
    def build(self) -> dict[str, object]:
        """The build that saved the file (``Build.as_dict``), {} when the manifest does not say."""
        build = self.fingerprint.get("build") if isinstance(self.fingerprint, dict) else None
        return build if isinstance(build, dict) else {}

    @property
    def build_shown(self) -> str:
        """That build as events name it: ``v1.0.0 (abc1234) sha256:0123abcd``, or ``an unknown build``."""
        release, sha = self.build.get("release"), self.build.get("sha256")
        if not isinstance(release, str) or not isinstance(sha, str):
            return "an unknown build"
        return f"{release} sha256:{sha[:8]}"


@dataclass(frozen=True)
class Refused:
    """A file that did not check out (``file`` its name in the store), removed."""

    file: str
    refusal: Refusal
    detail: str


def _slot_of(name: str, pattern: re.Pattern[str]) -> int | None:
    match = pattern.match(name)
    return int(match.group(1)) if match else None


class SlotStore:
    """The slot files under ``root`` (created 0700 by :meth:`prepare`), at most ``budget_bytes`` in all;
    each store call's reads end within ``io_timeout_s`` seconds. ``file_owner``: the uid whose slot
    files are accepted (llama-server's user; set by :meth:`prepare`, llama-guard's own until then)."""

    def __init__(self, root: Path, budget_bytes: int, io_timeout_s: float = IO_TIMEOUT_S) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.io_timeout_s = io_timeout_s
        self.file_owner = os.geteuid()
        self._set_aside: list[Refused] = []

    def take_set_aside(self) -> list[Refused]:
        """What stood in place of ``unrestorable.json`` and was removed since the last call (to report)."""
        out, self._set_aside = self._set_aside, []
        return out

    def _dir(self) -> SafeDir:
        return SafeDir(self.root)

    def _deadline(self) -> float:
        return time.monotonic() + self.io_timeout_s

    def prepare(self, owner_uid: int | None = None, owner_gids: tuple[int, ...] = ()) -> None:
        """Create the directory (0700; owned by ``owner_uid`` when given: llama-server writes the files)
        and remove what a crash left half-done (temporaries, a slot file no manifest names). Raises
        OSError: FileRefused when the directory is a link or not a directory, EACCES when
        llama-server's user (``owner_uid`` with the groups ``owner_gids``) could not reach it."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._dir() as d:
            if owner_uid is not None:
                blocked = unsearchable_parent(self.root, owner_uid, owner_gids)
                if blocked is not None:
                    mode = blocked.stat().st_mode & 0o777
                    raise OSError(errno.EACCES, f"uid {owner_uid} cannot enter {blocked} (mode {mode:o})")
                if os.fstat(d.fd).st_uid != owner_uid:
                    os.fchown(d.fd, owner_uid, -1)
                self.file_owner = owner_uid
            deadline = self._deadline()
            named = {m.file for m in self._manifests(d, deadline)}
            for name in d.names():
                orphan = _slot_of(name, _BIN) is not None and "-" in name[len(PREFIX):] and name not in named
                if orphan or _LEFTOVER.match(name):
                    self._remove_quietly(d, name)

    def new_name(self, slot_id: int) -> str:
        """A name llama-server saves slot ``slot_id`` under, new to the store (before :meth:`commit`)."""
        return f"{PREFIX}{slot_id}-{time.time_ns():x}.bin"

    def commit(self, slot_id: int, name: str, fingerprint: Fingerprint) -> Manifest:
        """Check and hash ``name``, which llama-server just saved for ``slot_id``, and make it the slot's
        file: its manifest replaces the previous one by rename, then the previous file is removed.
        Raises StoreError (the file is removed; the previous pair stays) or OSError."""
        if _slot_of(name, _BIN) != slot_id:
            raise StoreError(f"{name!r} is not a slot file name of slot {slot_id}")
        deadline = self._deadline()
        with self._dir() as d:
            try:
                with self._servers_file(d, name, remove_refused=True) as (fd, size):
                    tokens = tokens_of(fd, size)
                    state_format = state_format_of(fd, size)
                    sha256 = self._sha256(fd, size, deadline, name)
            except StoreError:
                self._remove_quietly(d, name)
                raise
            previous = self._read_manifest(d, slot_id, deadline, quiet=True)
            manifest = Manifest(fingerprint.key, fingerprint.as_dict(), slot_id, len(tokens), size, sha256,
                                time.time(), name, asdict(state_format))
            d.write_new(self._manifest_name(slot_id), json.dumps(asdict(manifest), sort_keys=True).encode())
            if isinstance(previous, Manifest) and previous.file != name:
                self._remove_quietly(d, previous.file)  # an orphan otherwise: prepare removes it
        return manifest

    @contextlib.contextmanager
    def _servers_file(self, d: SafeDir, name: str, *, remove_refused: bool) -> Iterator[tuple[int, int]]:
        """``name``, a file llama-server wrote, opened safely: (fd, size), closed on exit. Raises
        StoreError when it is missing or refused (not a regular file of llama-server's user, over the
        budget: then removed where ``remove_refused``); a HeaderError or FileRefused while it is read is a
        StoreError naming the file too."""
        try:
            fd, size = d.open_regular(name, owners={self.file_owner}, max_bytes=self.budget_bytes)
        except FileNotFoundError:
            raise StoreError(f"llama-server's file {name} is missing") from None
        except FileRefused as exc:
            if remove_refused:
                self._remove_quietly(d, name)
            raise StoreError(str(exc)) from None
        try:
            yield fd, size
        except HeaderError as exc:
            raise StoreError(f"{d.path / name}: {exc}") from None
        except FileRefused as exc:
            raise StoreError(str(exc)) from None
        finally:
            os.close(fd)

    @staticmethod
    def _remove_quietly(d: SafeDir, name: str) -> None:
        with contextlib.suppress(OSError):
            d.remove(name)

    @staticmethod
    def _sha256(fd: int, size: int, deadline: float, name: str) -> str:
        digest = hashlib.sha256()
        read_through(fd, size, deadline, digest.update, name)
        return digest.hexdigest()

    @staticmethod
    def _manifest_name(slot_id: int) -> str:
        return f"{PREFIX}{slot_id}.json"

    def _read_manifest(self, d: SafeDir, slot_id: int, deadline: float, quiet: bool = False) -> Manifest | str | None:
        """Slot ``slot_id``'s manifest; None when there is none; else why it cannot be used (a
        FileRefused is raised instead unless ``quiet``)."""
        try:
            raw = d.read_bytes(self._manifest_name(slot_id), owners={os.geteuid()}, max_bytes=SMALL_FILE_BYTES,
                               deadline=deadline)
        except FileNotFoundError:
            return None
        except FileRefused as exc:
            if quiet:
                return str(exc)
            raise
        try:
            data = json.loads(raw)
            data.setdefault("file", f"{PREFIX}{slot_id}.bin")  # written before names had a generation
            manifest = Manifest(**data)
        except (ValueError, TypeError):
            return "its manifest does not parse"
        ints = (manifest.slot_id, manifest.n_tokens, manifest.bytes)
        if (not all(isinstance(v, int) for v in ints) or not isinstance(manifest.sha256, str)
                or not isinstance(manifest.fingerprint, dict)
                or not isinstance(manifest.state_format, dict | None)):
            return "its manifest does not parse"
        named = _slot_of(manifest.file, _BIN) if isinstance(manifest.file, str) else None
        if manifest.slot_id != slot_id or named != slot_id:
            return f"its manifest names {manifest.file!r}, not a slot file of slot {slot_id}"
        return manifest

    def _manifests(self, d: SafeDir, deadline: float) -> list[Manifest]:
        found: list[Manifest] = []
        for name in d.names():
            slot_id = _slot_of(name, _MANIFEST)
            if slot_id is not None and isinstance(m := self._read_manifest(d, slot_id, deadline, quiet=True), Manifest):
                found.append(m)
        return sorted(found, key=lambda m: m.saved_at)

    def committed(self) -> list[Manifest]:
        """The manifests that parse, oldest first (nothing is checked or removed)."""
        with self._dir() as d:
            return self._manifests(d, self._deadline())

    def from_other_builds(self, fingerprint: Fingerprint) -> list[Manifest]:
        """The committed manifests of ``fingerprint``'s layout saved by another build than its own
        (another content hash, or none recorded): those :meth:`check` needs ``written`` for."""
        return [m for m in self.committed()
                if m.fingerprint_key == fingerprint.key and m.build.get("sha256") != fingerprint.build.sha256]

    def written_format(self, name: str) -> StateFormat:
        """The :class:`StateFormat` of ``name``, a save llama-server just made to learn what its build
        writes; the file is removed. Raises StoreError (not a slot file, not a regular file of
        llama-server's user) or OSError."""
        if _slot_of(name, _BIN) is None:
            raise StoreError(f"{name!r} is not a slot file name")
        with self._dir() as d:
            try:
                with self._servers_file(d, name, remove_refused=False) as (fd, size):
                    return state_format_of(fd, size)
            finally:
                self._remove_quietly(d, name)

    def check(self, fingerprint: Fingerprint,
              written: StateFormat | str | None = None) -> tuple[list[Manifest], list[Refused]]:
        """The files that may be restored into a server of ``fingerprint``, and those refused (removed
        with their manifest). A file saved by another build is restored only when its
        :class:`StateFormat` is ``written``, the format ``fingerprint``'s build writes as measured
        (:meth:`written_format`); a str says why it could not be measured, None that it was not.
        Raises FileRefused (``errno.ETIMEDOUT``) when the reads did not end within ``io_timeout_s``:
        nothing is removed then."""
        good: list[Manifest] = []
        refused: list[Refused] = []
        deadline = self._deadline()
        with self._dir() as d:
            names = d.names()
            bins: dict[int, list[str]] = {}
            for name in names:
                if (slot_id := _slot_of(name, _BIN)) is not None:
                    bins.setdefault(slot_id, []).append(name)
            ids = set(bins) | {s for name in names if (s := _slot_of(name, _MANIFEST)) is not None}
            for slot_id in sorted(ids):
                verdict = self._check_one(d, slot_id, bins.get(slot_id, []), fingerprint, written, deadline)
                keep = verdict.file if isinstance(verdict, Manifest) else None
                for name in bins.get(slot_id, []):
                    if name != keep:
                        self._remove_quietly(d, name)
                if isinstance(verdict, Refused):
                    self._remove_quietly(d, self._manifest_name(slot_id))
                    refused.append(verdict)
                else:
                    good.append(verdict)
        return good, refused

    def _check_one(self, d: SafeDir, slot_id: int, bins: list[str], fingerprint: Fingerprint,
                   written: StateFormat | str | None, deadline: float) -> Manifest | Refused:
        name = ", ".join(bins) or self._manifest_name(slot_id)
        try:
            manifest = self._read_manifest(d, slot_id, deadline)
        except FileRefused as exc:
            return Refused(name, Refusal.UNSAFE, f"its manifest {exc.reason}")
        if manifest is None:
            return Refused(name, Refusal.NO_MANIFEST, "no manifest beside it")
        if isinstance(manifest, str):
            return Refused(name, Refusal.NO_MANIFEST, manifest)
        name = manifest.file
        if manifest.fingerprint_key != fingerprint.key:
            theirs, ours = manifest.fingerprint, fingerprint.layout()
            differ = sorted(k for k in ours if theirs.get(k) != ours[k])
            return Refused(name, Refusal.FOREIGN, f"written by a server with another {', '.join(differ) or 'layout'}")
        try:
            fd, size = d.open_regular(name, owners={self.file_owner}, max_bytes=self.budget_bytes)
        except FileNotFoundError:
            return Refused(name, Refusal.TRUNCATED, "the file is missing")
        except FileRefused as exc:
            return Refused(name, Refusal.UNSAFE, exc.reason)
        try:
            if size != manifest.bytes:
                return Refused(name, Refusal.TRUNCATED, f"{size} bytes, its manifest says {manifest.bytes}")
            if self._sha256(fd, size, deadline, name) != manifest.sha256:
                return Refused(name, Refusal.CORRUPT, "its sha256 is not its manifest's")
            if manifest.build.get("sha256") != fingerprint.build.sha256:
                refused = _other_build(name, manifest, fingerprint, state_format_of(fd, size), written)
                if refused is not None:
                    return refused
            if len(tokens_of(fd, size)) != manifest.n_tokens:
                return Refused(name, Refusal.CORRUPT, "its token count is not its manifest's")
        except FileRefused as exc:
            if exc.errno == errno.ETIMEDOUT:
                raise  # a slow disk, not a bad file: nothing is removed, the next start checks again
            return Refused(name, Refusal.UNSAFE, exc.reason)
        except (HeaderError, OSError) as exc:
            return Refused(name, Refusal.CORRUPT, str(exc) or type(exc).__name__)
        finally:
            os.close(fd)
        return manifest

    def tokens(self, manifest: Manifest) -> list[int]:
        """The token ids of committed ``manifest``'s file (its header), read safely. Raises StoreError or
        OSError (FileRefused: the file is no longer a regular file of llama-server's user)."""
        with self._dir() as d, self._servers_file(d, manifest.file, remove_refused=False) as (fd, size):
            return tokens_of(fd, size)

    def prune(self) -> list[Manifest]:
        """Drop the oldest committed files until the rest fit the budget; the dropped ones."""
        with self._dir() as d:
            kept = self._manifests(d, self._deadline())
            dropped: list[Manifest] = []
            while kept and sum(m.bytes for m in kept) > self.budget_bytes:
                oldest = kept.pop(0)
                self._remove_quietly(d, self._manifest_name(oldest.slot_id))
                self._remove_quietly(d, oldest.file)
                dropped.append(oldest)
        return dropped

    def unrestorable(self, fingerprint: Fingerprint) -> bool:
        """Whether :data:`UNRESTORABLE_AFTER` verifications in a row with this model and build reused
        nothing (remembered on disk)."""
        with self._dir() as d:
            mark = self._marks(d).get(fingerprint.model_build_key)
        return isinstance(mark, dict) and _count(mark) >= UNRESTORABLE_AFTER

    def note_unused(self, fingerprint: Fingerprint) -> int:
        """Count one more verification with this model and build that reused nothing; the count in a row
        (:data:`UNRESTORABLE_AFTER` or more: restores stop for them)."""
        with self._dir() as d:
            marks = self._marks(d)
            mark = marks.get(fingerprint.model_build_key)
            count = (_count(mark) if isinstance(mark, dict) else 0) + 1
            marks[fingerprint.model_build_key] = {"model": fingerprint.model.path,
                                                  "build": fingerprint.build.short, "unused": count}
            d.write_new(UNRESTORABLE, json.dumps(marks, sort_keys=True).encode())
        return count

    def note_reused(self, fingerprint: Fingerprint) -> None:
        """A verification with this model and build reused its tokens: the count starts again."""
        with self._dir() as d:
            marks = self._marks(d)
            if marks.pop(fingerprint.model_build_key, None) is not None:
                d.write_new(UNRESTORABLE, json.dumps(marks, sort_keys=True).encode())

    def _marks(self, d: SafeDir) -> dict[str, object]:
        """unrestorable.json's entries; {} when it is absent or does not parse. Something else in its
        place (a link, a FIFO, another user's file) is removed (the name itself) and kept for
        :meth:`take_set_aside`; {} then too."""
        try:
            raw = d.read_bytes(UNRESTORABLE, owners={os.geteuid()}, max_bytes=SMALL_FILE_BYTES,
                               deadline=self._deadline())
        except FileNotFoundError:
            return {}
        except FileRefused as exc:
            self._remove_quietly(d, UNRESTORABLE)  # the next note writes a file of llama-guard's own
            self._set_aside.append(Refused(UNRESTORABLE, Refusal.UNSAFE, exc.reason))
            return {}
        try:
            data = json.loads(raw)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}


def _other_build(name: str, manifest: Manifest, fingerprint: Fingerprint, theirs: StateFormat,
                 written: StateFormat | str | None) -> Refused | None:
    """Why file ``name``, saved by another build than ``fingerprint``'s and of format ``theirs``, is
    not restored into it (None: ``written``, what this build writes, is its format)."""
    ours = fingerprint.build
    both = f"saved by llama-server {manifest.build_shown}, this server runs {ours.release} sha256:{ours.sha256[:8]}"
    if written is None or isinstance(written, str):
        return Refused(name, Refusal.BUILD, f"{both}; the slot file format this build writes is not known: "
                                            f"{written or 'not measured'}")
    if theirs != written:
        return Refused(name, Refusal.BUILD, f"{both}; the file is {theirs}, this build writes {written}")
    return None


def _count(mark: dict[object, object]) -> int:
    """The verifications in a row that reused nothing, of one unrestorable.json entry (1 for one an
    older version wrote after a single observation)."""
    count = mark.get("unused", 1)
    return count if isinstance(count, int) else 1
