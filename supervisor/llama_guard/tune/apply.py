"""``tune --apply``: the winning ``[server]`` values written into the configuration file with its
comments, order and every other key kept (tomlkit), validated as a whole before the file is replaced
(atomically, same mode). With a daemon serving the configuration, the file is written inside the window
it lent; it reloads the file before its server starts again, so that server runs the tuned flags.

Raises :class:`ApplyError` with the reason; the file is unchanged then."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import tomlkit

from llama_guard.config import ConfigError, load_config


class ApplyError(RuntimeError):
    """The file could not be read, parsed, written, or the result is not a valid configuration."""


def apply_changes(path: Path, changes: dict[str, Any]) -> None:
    """Set ``[server].KEY = value`` for each of ``changes`` in ``path``. A value of None removes the key
    (the default applies). Raises :class:`ApplyError`; ``path`` is untouched unless the new text loads."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ApplyError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        doc = tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        raise ApplyError(f"{path} is not valid TOML: {exc}") from None
    server = doc.get("server")
    if server is None:
        server = tomlkit.table()
        doc["server"] = server
    for key, value in changes.items():
        if value is None:
            server.pop(key, None)
        else:
            server[key] = value
    directory = path.resolve().parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tune", dir=directory)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(tomlkit.dumps(doc))
        try:
            load_config(tmp)
        except ConfigError as exc:
            raise ApplyError("the tuned file would not load: " + "; ".join(exc.lines)) from None
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path.resolve())
    except OSError as exc:
        raise ApplyError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)

