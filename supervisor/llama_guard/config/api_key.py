"""Reading ``[server].api_key_file``: the key llama-guard's probes send (the file is llama-server's
``--api-key-file``)."""

from __future__ import annotations

from pathlib import Path

from llama_guard.config import ConfigError
from llama_guard.config.server import ServerConfig
from llama_guard.host.paths import read_regular


def read_api_key(server: ServerConfig) -> str:
    """The API key llama-guard's probes send: the first key line of ``[server].api_key_file``
    ("" when none is configured). llama-server reads the same file (``--api-key-file``: one key per
    line). Raises :class:`ConfigError` naming the file for a missing, unreadable or empty one; the
    key itself is never part of an error.
    """
    if not server.api_key_file:
        return ""
    path = Path(server.api_key_file)
    try:
        text = read_regular(path).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise ConfigError([f"server.api_key_file: {path}: cannot read: {reason}"]) from None
    # As llama-server reads it: one key per line, empty lines skipped, "#" lines are comments.
    keys = [line for line in text.splitlines() if line and not line.startswith("#")]
    if not keys:
        raise ConfigError([f"server.api_key_file: {path}: holds no key"])
    for number, key in enumerate(keys, 1):
        if key != key.strip() or any(ord(c) < 0x21 or ord(c) > 0x7E for c in key):
            raise ConfigError([f"server.api_key_file: {path}: key {number} has spaces or characters that "
                               "cannot be sent in an HTTP header (printable ASCII only, no spaces)"])
    return keys[0]
