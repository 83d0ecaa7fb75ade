"""What must match for a slot file to be restored into a server: its KV layout's fingerprint.

A slot file written by llama-server (``llama_state_seq_save_file``) holds the slot's tokens and its
KV cells in the layout of one model, build, context size per slot, KV cache types and attention
settings; llama-server checks only part of this when it loads one. The fingerprint names all of it:
the model file's identity (size, mtime, inode, a hash of its first :data:`HEAD_BYTES`), the build
(``llama-server --version``), ``ctx_size``, ``parallel``, ``cache_type_k``/``cache_type_v``,
``flash_attn`` and the KV-layout flags of ``extra_args`` (:data:`KV_FLAGS`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from llama_guard.config.server import ServerConfig

HEAD_BYTES = 1 << 20  # the model file's first MiB (GGUF header and metadata) is hashed
# extra_args flags that change the KV cache's layout or content for the same tokens (llama.cpp common/arg.cpp).
KV_FLAGS = frozenset({
    "--swa-full", "-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified", "--lora", "--lora-scaled",
    "--control-vector", "--control-vector-scaled", "--override-kv", "--rope-scaling", "--rope-scale",
    "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx", "--yarn-ext-factor", "--yarn-attn-factor",
    "--yarn-beta-slow", "--yarn-beta-fast", "-md", "--model-draft", "--mmproj", "-mm",
})


@dataclass(frozen=True)
class ModelIdentity:
    """One model file as it is now: ``size`` bytes, ``mtime_ns``, ``inode`` and the sha256 of its
    first :data:`HEAD_BYTES` (hex)."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    head_sha256: str


@dataclass(frozen=True)
class Fingerprint:
    """The KV layout of one server. :attr:`key` names it; :attr:`model_build_key` names its model and build."""

    model: ModelIdentity
    build: str
    ctx_size: int
    parallel: int
    cache_type_k: str
    cache_type_v: str
    flash_attn: str
    kv_args: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        """The fields as JSON reads them back (tuples as lists): what a manifest stores."""
        value: dict[str, object] = json.loads(json.dumps(asdict(self)))
        return value

    @property
    def key(self) -> str:
        """sha256 (hex) of every field."""
        return _digest(self.as_dict())

    @property
    def model_build_key(self) -> str:
        """sha256 (hex) of the model identity and the build only."""
        return _digest({"model": asdict(self.model), "build": self.build})


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def model_identity(path: Path) -> ModelIdentity:
    """The identity of model file ``path``. Blocking (reads :data:`HEAD_BYTES`); raises OSError."""
    with path.open("rb") as handle:
        st = path.stat()
        head = hashlib.sha256(handle.read(HEAD_BYTES)).hexdigest()
    return ModelIdentity(str(path), st.st_size, st.st_mtime_ns, st.st_ino, head)


def kv_args(extra_args: list[str]) -> tuple[str, ...]:
    """The :data:`KV_FLAGS` of ``extra_args`` with their values (``--flag V`` or ``--flag=V``), in order."""
    out: list[str] = []
    for i, arg in enumerate(extra_args):
        flag = arg.split("=", 1)[0]
        if flag not in KV_FLAGS:
            continue
        out.append(arg)
        if "=" not in arg and i + 1 < len(extra_args) and not extra_args[i + 1].startswith("-"):
            out.append(extra_args[i + 1])
    return tuple(out)


def fingerprint_of(server: ServerConfig, build: str) -> Fingerprint:
    """The fingerprint of a server started from ``server`` with the binary whose ``--version`` is
    ``build``. Blocking (reads the model's head); raises OSError when the model cannot be read."""
    return Fingerprint(model_identity(Path(server.model)), build, server.ctx_size, server.parallel,
                       server.cache_type_k, server.cache_type_v, server.flash_attn, kv_args(server.extra_args))
