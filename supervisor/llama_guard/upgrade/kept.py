"""The last good builds, kept: a copy of the executable and the shared libraries beside it
(``lib*.so*``; a symbolic link to a file beside it stays a link) of each build that served well, under
``<state>/builds/<sha256 of the executable>/`` with a manifest of every file's SHA-256; at most
:data:`KEEP_MAX`, the oldest removed first. Files are read-only (0555/0444) in a read-only directory
owned by llama-guard's user, so llama-server, started as another ``[server].user``, cannot change them;
``builds/`` is 0755, so that it can run them.

A copy is used only after every file's hash is checked again (:func:`verified`). Blocking: call it
off the event loop.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from llama_guard.core.privileges import ServerIdentity, unexecutable_by
from llama_guard.host.build import Build, file_sha256

KEEP_MAX = 2
MANIFEST = "manifest.json"
COPY_TIMEOUT_S = 300.0  # copying or checking one build (its CUDA libraries may be ~1 GiB), seconds


def builds_dir(runtime_dir: Path, environ: Mapping[str, str] = os.environ) -> Path:
    """``$STATE_DIRECTORY/builds`` (the first directory systemd gives a unit with ``StateDirectory=``:
    kept across reboots), else ``<[runtime].dir>/builds``."""
    state = environ.get("STATE_DIRECTORY", "").split(":", 1)[0]
    return Path(state) / "builds" if state.startswith("/") else runtime_dir / "builds"


@dataclass(frozen=True)
class Kept:
    """One kept build: its directory, the build as it was identified (``build.path`` is the copy's
    executable), where it was copied from, when (Unix seconds) and each file's SHA-256."""

    dir: Path
    build: Build
    source: str
    kept_at: float
    files: Mapping[str, str]


def _libraries(binary: Path) -> list[Path]:
    """The shared libraries beside ``binary`` (``lib*.so``, ``lib*.so.*``), regular files or links to one."""
    return sorted(p for p in binary.parent.glob("lib*.so*") if p.is_file())


def share(root: Path) -> None:
    """Make ``root`` mode 0755, whatever made it and under whatever umask (the unit's ``UMask=0027``
    made it 0750, root's; an older llama-guard left it so): ``[server].user`` must reach a copy to run
    it at a roll-back. Raises OSError (an absent ``root`` too)."""
    root.chmod(0o755)


def keep(build: Build, root: Path) -> Kept:
    """Copy ``build`` (its executable and the libraries beside it) under ``root`` unless it is kept
    already; then remove the oldest beyond :data:`KEEP_MAX`. Raises OSError; a copy found to differ
    from ``build.sha256`` while copying (the file was replaced meanwhile) is removed and refused."""
    for kept in listing(root):
        if kept.build.sha256 == build.sha256:
            return kept
    root.mkdir(parents=True, exist_ok=True)
    share(root)
    final = root / build.sha256[:16]
    work = root / f".{build.sha256[:16]}.{os.getpid()}.tmp"
    _remove(work)
    _remove(final)
    work.mkdir(mode=0o700)
    try:
        files: dict[str, str] = {}
        exe = work / build.path.name
        shutil.copyfile(build.path, exe)
        files[exe.name] = file_sha256(exe)
        if files[exe.name] != build.sha256:
            raise OSError(f"{build.path} changed while it was copied")
        for lib in _libraries(build.path):
            target = work / lib.name
            link = os.readlink(lib) if lib.is_symlink() else ""
            if link and "/" not in link:  # libggml.so -> libggml.so.0: the same link in the copy
                target.symlink_to(link)
                continue
            shutil.copyfile(lib, target)
            files[lib.name] = file_sha256(target)
        kept_at = time.time()
        (work / MANIFEST).write_text(json.dumps({
            "executable": exe.name, "sha256": build.sha256, "version": build.version, "release": build.release,
            "source": str(build.path), "kept_at": kept_at, "files": files}, indent=1))
        for name in (*files, MANIFEST):
            (work / name).chmod(0o555 if name == exe.name else 0o444)
        work.chmod(0o555)
        work.rename(final)
    except BaseException:
        _remove(work)
        raise
    for old in listing(root)[KEEP_MAX:]:
        _remove(old.dir)
    return _read(final) or Kept(final, build, str(build.path), kept_at, files)


def discard(kept: Kept) -> None:
    """Remove ``kept`` (a copy found not to start). Raises OSError."""
    _remove(kept.dir)


def _remove(path: Path) -> None:
    """Remove a kept directory (made writable again first); nothing when absent."""
    if not path.exists():
        return
    path.chmod(0o700)
    shutil.rmtree(path)


def _read(directory: Path) -> Kept | None:
    try:
        doc = json.loads((directory / MANIFEST).read_text())
        exe = directory / str(doc["executable"])
        build = Build(exe, str(doc["sha256"]), str(doc["version"]), str(doc["release"]))
        return Kept(directory, build, str(doc["source"]), float(doc["kept_at"]),
                    {str(k): str(v) for k, v in dict(doc["files"]).items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def listing(root: Path) -> list[Kept]:
    """The kept builds under ``root``, newest first (a directory without a readable manifest is
    skipped). Raises nothing: an absent ``root`` is an empty list."""
    try:
        dirs = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    except OSError:
        return []
    found = [k for d in dirs if (k := _read(d)) is not None]
    return sorted(found, key=lambda k: k.kept_at, reverse=True)


def verified(kept: Kept, identity: ServerIdentity | None = None) -> str:
    """Why ``kept`` cannot be used ("" when every file still has its hash, none is writable by
    others than its owner, and the executable is executable — by ``identity``, llama-server's
    ``[server].user``, when it is another account: the mode bits of each directory on the way)."""
    for name, digest in kept.files.items():
        path = kept.dir / name
        try:
            mode = path.lstat().st_mode
            if not stat.S_ISREG(mode) or mode & (stat.S_IWGRP | stat.S_IWOTH):
                return f"{path} is not a read-only regular file"
            if file_sha256(path) != digest:
                return f"{path} no longer has the content that was kept"
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
    blocked = unexecutable_by(identity, kept.build.path)
    if blocked:
        return blocked
    return "" if os.access(kept.build.path, os.X_OK) else f"{kept.build.path} is not executable"
