"""Where llama-guard finds its configuration and runtime directory, without importing the
configuration model (pydantic): ``llama-guard status`` and ``restart`` need only these and must
answer fast."""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG_PATH = Path("/etc/llama-guard/llama-guard.toml")
ENV_CONFIG_PATH = "LLAMA_GUARD_CONFIG"
ENV_PREFIX = "LLAMA_GUARD_"
DEFAULT_RUNTIME_DIR = Path("/run/llama-guard")


def resolve_config_path(cli_path: str | os.PathLike[str] | None,
                        environ: Mapping[str, str] | None = None) -> Path:
    """The config path: ``--config``, else ``$LLAMA_GUARD_CONFIG``, else the default under /etc."""
    env = os.environ if environ is None else environ
    if cli_path:
        return Path(cli_path)
    if env.get(ENV_CONFIG_PATH):
        return Path(env[ENV_CONFIG_PATH])
    return DEFAULT_CONFIG_PATH


def os_reason(exc: OSError) -> str:
    """Why a path could not be reached, in the operator's words: ``no such file``, ``symlink loop
    (too many levels of symbolic links)``, else the system's own text (``Permission denied`` …)."""
    if exc.errno == errno.ENOENT:
        return "no such file"
    if exc.errno == errno.ELOOP:
        return "symlink loop (too many levels of symbolic links)"
    return exc.strerror or str(exc)


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file at ``path`` (symlinks followed). Opens without blocking, so a
    FIFO or device in its place never hangs the caller; raises OSError (``strerror`` "not a
    regular file" for anything else but a regular file, or the open's own error)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with open(fd, "rb", closefd=False) as handle:
            return handle.read()
    finally:
        os.close(fd)


def runtime_dir_of(config_path: Path, environ: Mapping[str, str] | None = None) -> Path | None:
    """``[runtime].dir`` as the daemon would see it (``$LLAMA_GUARD_RUNTIME__DIR`` wins over the
    file; the default when neither sets it), read with tomllib only; None when the file cannot
    be read or parsed (the caller then uses the full loader)."""
    env = os.environ if environ is None else environ
    override = env.get(f"{ENV_PREFIX}RUNTIME__DIR")
    if override:
        return Path(override)
    try:
        data = tomllib.loads(read_regular(config_path).decode())
    except (OSError, ValueError):
        return None
    runtime = data.get("runtime", {})
    value = runtime.get("dir") if isinstance(runtime, dict) else None
    if value is None:
        return DEFAULT_RUNTIME_DIR
    return Path(value) if isinstance(value, str) and value not in ("", ".") else None


def unsearchable_parent(path: Path, uid: int, gids: tuple[int, ...]) -> Path | None:
    """The first parent of ``path`` that ``uid`` (with the groups ``gids``) may not search (no x bit
    for it by owner, group or other; ACLs not read), or None when every parent lets it through."""
    for parent in reversed(path.parents):
        st = parent.stat()
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid in gids else stat.S_IXOTH
        if uid != 0 and not st.st_mode & bit:
            return parent
    return None
