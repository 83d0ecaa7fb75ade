"""What must match for a slot file to be restored into a server: its KV layout's fingerprint.

A slot file written by llama-server (``llama_state_seq_save_file``) holds the slot's tokens and its
KV cells in the layout of one model, build, context size per slot, KV cache types and attention
settings; llama-server checks only part of this when it loads one. The fingerprint names the
configuration's part of it — the model file's identity (size, mtime, inode, a hash of its first
:data:`HEAD_BYTES`), ``ctx_size``, ``parallel``, ``cache_type_k``/``cache_type_v``, ``flash_attn`` and
the KV-layout flags of ``extra_args`` (:data:`KV_FLAGS`): its :attr:`Fingerprint.key` — and the build
that runs it (:class:`~llama_guard.host.build.Build`: content hash, ``--version``, release), which is
not part of the key: whether a slot file of another build has this build's layout is measured
(:mod:`llama_guard.slots.store`, :class:`~llama_guard.slots.store.StateFormat`). ``n_gpu_layers`` and
``--no-kv-offload`` are not in it: where the KV cache lives does not change the file (llama.cpp copies
each tensor's bytes out and in with ``ggml_backend_tensor_get``/``set``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from llama_guard.config.server import ServerConfig
from llama_guard.host.build import Build

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
    """The KV layout of one server and its build. :attr:`key` names the layout as the configuration and
    the model set it; :attr:`model_build_key` names its model and build."""

    model: ModelIdentity
    build: Build
    ctx_size: int
    parallel: int
    cache_type_k: str
    cache_type_v: str
    flash_attn: str
    kv_args: tuple[str, ...]

    def layout(self) -> dict[str, object]:
        """Every field but the build, as JSON reads them back (tuples as lists)."""
        value: dict[str, object] = json.loads(json.dumps({k: v for k, v in asdict(self).items() if k != "build"}))
        return value

    def as_dict(self) -> dict[str, object]:
        """:meth:`layout` and the build (``Build.as_dict``): what a manifest stores."""
        return {**self.layout(), "build": self.build.as_dict()}

    @property
    def key(self) -> str:
        """sha256 (hex) of the layout's fields (:meth:`layout`)."""
        return _digest(self.layout())

    @property
    def model_build_key(self) -> str:
        """sha256 (hex) of the model identity and the build's content hash."""
        return _digest({"model": asdict(self.model), "build": self.build.sha256})


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


def fingerprint_of(server: ServerConfig, build: Build) -> Fingerprint:
    """The fingerprint of a server started from ``server`` running ``build``. Blocking (reads the
    model's head); raises OSError when the model cannot be read."""
    return Fingerprint(model_identity(Path(server.model)), build, server.ctx_size, server.parallel,
                       server.cache_type_k, server.cache_type_v, server.flash_attn, kv_args(server.extra_args))
