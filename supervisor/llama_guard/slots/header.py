"""What a slot file's header says (llama.cpp ``src/llama-context.cpp`` ``state_seq_save_file``: the
magic, the state version, the token list — llama-server's ``server_tokens::serialize``,
``tools/server/server-common.cpp`` — then the KV state, ``llama_kv_cache::state_write``, which starts
with its stream count). Reads through an open file descriptor with ``os.pread``; never the KV cells.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

SEQ_MAGIC = 0x67677371  # 'ggsq', LLAMA_STATE_SEQ_MAGIC
SEQ_VERSION = 4  # LLAMA_STATE_SEQ_VERSION of the builds this reader knows
TOKENS_STATE_MARK = 0xFFFFFFFF  # server_tokens::serialize starts with LLAMA_TOKEN_NULL, then its version
TOKENS_STATE_VERSION = 1
MAX_TOKENS = 1 << 24  # a header claiming more tokens than any context holds is not read (its list: 64 MiB)


class HeaderError(Exception):
    """The header is not one this reader knows, or the file ends inside it (the reason is the message)."""


def tokens_of(fd: int, size: int) -> list[int]:
    """The token ids in the header of the slot file open as ``fd`` (``size`` bytes). Raises HeaderError
    when the header is not one this reader knows or the file ends inside it."""
    head = os.pread(fd, 12, 0)
    if len(head) < 12:
        raise HeaderError("shorter than a slot file's header")
    magic, version, n_packed = struct.unpack("<III", head)
    if magic != SEQ_MAGIC or version != SEQ_VERSION:
        raise HeaderError(f"not a slot file of a known version (magic {magic:#x}, version {version})")
    if n_packed > MAX_TOKENS:
        raise HeaderError(f"its header claims {n_packed} tokens, more than any context holds")
    if 12 + 4 * n_packed > size:
        raise HeaderError("ends inside its token list")
    raw = os.pread(fd, 4 * n_packed, 12)
    if len(raw) < 4 * n_packed:
        raise HeaderError("ends inside its token list")
    packed = list(struct.unpack(f"<{n_packed}I", raw))
    if packed[:2] != [TOKENS_STATE_MARK, TOKENS_STATE_VERSION]:
        return [t for t in struct.unpack(f"<{n_packed}i", raw)]  # builds before server_tokens' own state
    if len(packed) < 3 or len(packed) < 3 + packed[2] + 1:
        raise HeaderError("its token list is cut short")
    n = packed[2]
    if packed[3 + n] != 0:
        raise HeaderError("it holds media chunks (a multimodal prompt): not restored")
    return packed[3:3 + n]


@dataclass(frozen=True)
class StateFormat:
    """The format of a slot file as its header shows it: llama.cpp's ``magic`` and state ``version``
    (``LLAMA_STATE_SEQ_MAGIC``/``LLAMA_STATE_SEQ_VERSION``), the version of llama-server's token list
    (``server_tokens::serialize``; 0: a plain list of token ids, as builds before it wrote) and
    ``n_stream``, the first word of the KV state after the token list (``llama_kv_cache::state_write``:
    the KV cache's streams, one per slot or one when unified; None when the file ends before it)."""

    magic: int
    version: int
    tokens_format: int
    n_stream: int | None

    def __str__(self) -> str:
        magic = struct.pack("<I", self.magic)[::-1].decode("latin-1")
        streams = "no KV state" if self.n_stream is None else f"{self.n_stream} KV stream(s)"
        tokens = f"token list v{self.tokens_format}" if self.tokens_format else "plain token list"
        return f"{magic!r} v{self.version}, {tokens}, {streams}"


def state_format_of(fd: int, size: int) -> StateFormat:
    """The :class:`StateFormat` of the slot file open as ``fd`` (``size`` bytes). Raises HeaderError
    when it is not a slot file (no ``ggsq`` magic) or ends inside its header."""
    head = os.pread(fd, 20, 0)
    if len(head) < 12:
        raise HeaderError("shorter than a slot file's header")
    magic, version, n_packed = struct.unpack("<III", head[:12])
    if magic != SEQ_MAGIC:
        raise HeaderError(f"not a slot file (magic {magic:#x})")
    tokens_format = 0
    if n_packed >= 2 and len(head) >= 20:
        mark, tokens_version = struct.unpack("<II", head[12:20])
        tokens_format = tokens_version if mark == TOKENS_STATE_MARK else 0
    after = 12 + 4 * min(n_packed, MAX_TOKENS)
    word = os.pread(fd, 4, after) if n_packed <= MAX_TOKENS and after + 4 <= size else b""
    return StateFormat(magic, version, tokens_format, struct.unpack("<I", word)[0] if len(word) == 4 else None)
