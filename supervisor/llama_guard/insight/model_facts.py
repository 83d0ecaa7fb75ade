"""The model's numbers from its GGUF file, read with the ``gguf`` package (llama.cpp's own reader).

:func:`read_model_facts` memory-maps the file (``gguf.GGUFReader``: nothing but the header and the
tensor index is read into memory) and returns a :class:`ModelFacts`. The reader is the package's own,
except for array values (:func:`_header_reader`): the package splits an array into one numpy view per
item, which for a tokenizer (150k tokens, scores, types, merges) is seconds of CPU; here a numeric array
is one view and a string array only its length, which is all the facts need. The facts are the
architecture's hyper-parameters under the ``<arch>.`` key prefix that llama.cpp reads
(``llama-arch.cpp``: ``%s.block_count``, ``%s.attention.head_count_kv``, ``%s.attention.key_length``,
``%s.attention.sliding_window`` ...) and every tensor's name and byte size. :class:`ModelFacts` can also
be built directly (tests, a model that is not on this machine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures whose sliding-window layout llama.cpp hard-codes when the file does not declare a
# pattern (llama-model.cpp, ``hparams.set_swa_pattern(n)``: every n-th layer is dense).
DEFAULT_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4}


class ModelFactsError(ValueError):
    """The file is not a GGUF model llama-guard can read (names the file and the reason)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its GGUF name (``blk.7.attn_q.weight``) and its size in bytes."""

    name: str
    n_bytes: int


@dataclass(frozen=True)
class ModelFacts:
    """What the VRAM budget and the ceiling need from a model.

    ``n_head_kv`` has one entry per layer (GGUF allows a per-layer array); ``key_length`` and
    ``value_length`` are the per-head K and V dimensions (elements); ``swa_layers[i]`` is True when
    layer ``i`` attends to a sliding window of ``sliding_window`` tokens only; ``recurrent`` marks a
    model with recurrent (SSM) layers, whose state is not part of this estimate.
    """

    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: tuple[int, ...]
    key_length: int
    value_length: int
    n_vocab: int
    n_ff: int
    n_ctx_train: int
    tensors: tuple[TensorInfo, ...]
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    key_length_swa: int = 0
    value_length_swa: int = 0
    recurrent: bool = False
    name: str = ""
    notes: tuple[str, ...] = field(default=())

    def head_dims(self, layer: int) -> tuple[int, int]:
        """(K, V) elements per KV head of ``layer`` (``key_length_swa``/``value_length_swa`` on a
        sliding-window layer when the file declares them)."""
        if self.is_swa(layer) and self.key_length_swa:
            return self.key_length_swa, self.value_length_swa or self.key_length_swa
        return self.key_length, self.value_length

    def is_swa(self, layer: int) -> bool:
        """Whether ``layer`` uses the sliding window."""
        return self.sliding_window > 0 and layer < len(self.swa_layers) and self.swa_layers[layer]


def _header_reader(path: Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` whose array fields are cheap: a numeric array is ONE numpy view
    (``contents()`` gives the same list), a string array keeps only its item type and length
    (its last part is the length, ``contents() == []``): its strings are stepped over, not read.
    Overrides the reader's ``_get_field_parts`` (gguf-py ``gguf_reader.py``), checked against the plain
    reader on a real model by tests/insight/test_budget.py."""
    import struct

    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    class HeaderReader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item_type = self._get(orig_offs, np.uint32)
            length = self._get(orig_offs + 4, np.uint64)
            count, offs = int(length[0]), orig_offs + 12
            itype = GGUFValueType(int(item_type[0]))
            if itype == GGUFValueType.STRING:
                raw, fmt = memoryview(self.data.data), ">Q" if self.byte_order == "S" else "<Q"
                for _ in range(count):
                    offs += 8 + struct.unpack_from(fmt, raw, offs)[0]
                return offs - orig_offs, [item_type, length], [], [GGUFValueType.ARRAY, itype]
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is None:  # arrays of arrays: the package's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, count)
            return 12 + int(values.nbytes), [item_type, length, values], [2], [GGUFValueType.ARRAY, itype]

    return HeaderReader(path, "r")


def _value(reader: Any, key: str) -> Any:
    fld = reader.fields.get(key)
    if fld is None:
        return None
    value = fld.contents()
    return value


def _int(reader: Any, key: str, default: int | None = None) -> int | None:
    value = _value(reader, key)
    if value is None:
        return default
    if isinstance(value, list):
        return int(max(value)) if value else default
    return int(value)


def swa_layout(n_layer: int, pattern: Any, architecture: str) -> tuple[tuple[bool, ...], str | None]:
    """Which layers are sliding-window: from ``<arch>.attention.sliding_window_pattern`` (an array of
    booleans, one per layer, or an integer n = "every n-th layer is dense", as llama.cpp's
    ``set_swa_pattern``), else the architecture's hard-coded pattern, else every layer. The second
    item is a note when the layout was assumed rather than read."""
    if isinstance(pattern, list) and len(pattern) >= n_layer:
        return tuple(bool(p) for p in pattern[:n_layer]), None
    note = None
    if isinstance(pattern, (int, float)) and not isinstance(pattern, bool):
        n = int(pattern)
    elif architecture in DEFAULT_SWA_PATTERN:
        n = DEFAULT_SWA_PATTERN[architecture]
        note = f"sliding-window layout assumed from the architecture ({architecture}: every {n}th layer dense)"
    else:
        n = 0
        note = "sliding window declared without a pattern: every layer assumed sliding-window"
    # llama.cpp: is_swa(il) = n == 0 || il % n < n - 1
    return tuple(n == 0 or (il % n) < (n - 1) for il in range(n_layer)), note


def read_model_facts(path: Path | str) -> ModelFacts:
    """Read ``path``'s GGUF header and tensor index.

    Raises :class:`ModelFactsError` for a missing/unreadable file, a file that is not GGUF, or one
    without the ``general.architecture`` / ``<arch>.block_count`` / ``<arch>.embedding_length`` /
    ``<arch>.attention.head_count`` keys every llama.cpp transformer has.
    """
    path = Path(path)
    try:
        reader = _header_reader(path)
    except OSError as exc:
        raise ModelFactsError(f"{path}: {exc.strerror or exc}") from exc
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ModelFactsError(f"{path}: not a readable GGUF file ({exc})") from exc
    arch = _value(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFactsError(f"{path}: no general.architecture in the GGUF metadata")
    missing = [k for k in ("block_count", "embedding_length", "attention.head_count")
               if f"{arch}.{k}" not in reader.fields]
    if missing:
        raise ModelFactsError(f"{path}: GGUF metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
    n_layer = int(_value(reader, f"{arch}.block_count"))
    n_embd = int(_value(reader, f"{arch}.embedding_length"))
    n_head = _int(reader, f"{arch}.attention.head_count") or 1
    kv = _value(reader, f"{arch}.attention.head_count_kv")
    if isinstance(kv, list):
        n_head_kv = tuple(int(x) for x in kv[:n_layer]) + (int(kv[-1]) if kv else n_head,) * max(0, n_layer - len(kv))
    else:
        n_head_kv = (int(kv) if kv is not None else n_head,) * n_layer
    head_dim = n_embd // n_head if n_head else 0
    key_length = _int(reader, f"{arch}.attention.key_length", head_dim) or head_dim
    value_length = _int(reader, f"{arch}.attention.value_length", head_dim) or head_dim
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = _int(reader, f"{arch}.vocab_size", None) or (int(tokens.parts[-1][0]) if tokens is not None else 0)
    tensors = tuple(TensorInfo(str(t.name), int(t.n_bytes)) for t in reader.tensors)
    notes: list[str] = []
    sliding_window = _int(reader, f"{arch}.attention.sliding_window", 0) or 0
    swa: tuple[bool, ...] = ()
    if sliding_window:
        swa, note = swa_layout(n_layer, _value(reader, f"{arch}.attention.sliding_window_pattern"), arch)
        if note:
            notes.append(note)
    recurrent = any(k.startswith(f"{arch}.ssm.") for k in reader.fields)
    if recurrent:
        notes.append("recurrent (SSM) layers: their state is not in this estimate")
    name = _value(reader, "general.name")
    return ModelFacts(
        architecture=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        key_length=key_length, value_length=value_length, n_vocab=n_vocab,
        n_ff=_int(reader, f"{arch}.feed_forward_length", 4 * n_embd) or 4 * n_embd,
        n_ctx_train=_int(reader, f"{arch}.context_length", 0) or 0, tensors=tensors,
        sliding_window=sliding_window, swa_layers=swa, recurrent=recurrent,
        key_length_swa=_int(reader, f"{arch}.attention.key_length_swa", 0) or 0,
        value_length_swa=_int(reader, f"{arch}.attention.value_length_swa", 0) or 0,
        name=name if isinstance(name, str) else "", notes=tuple(notes))


def layer_of(tensor_name: str) -> int | None:
    """The block index of ``blk.N.*`` tensors, else None (token_embd, output, output_norm ...)."""
    parts = tensor_name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1])
    return None


def split_tensors(tensors: Sequence[TensorInfo]) -> tuple[dict[int, int], int, int, int]:
    """Bytes per block, then input-layer bytes (``token_embd*`` and the other non-block tensors that
    llama.cpp keeps with the input), output-layer bytes (``output.*``, ``output_norm.*``) and the
    size of ``token_embd.weight`` (the tied-embedding fallback for a file without ``output.weight``)."""
    per_layer: dict[int, int] = {}
    input_bytes = output_bytes = embd = 0
    for t in tensors:
        layer = layer_of(t.name)
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0) + t.n_bytes
        elif t.name.startswith(("output.", "output_norm.")):
            output_bytes += t.n_bytes
        else:
            input_bytes += t.n_bytes
            if t.name == "token_embd.weight":
                embd = t.n_bytes
    return per_layer, input_bytes, output_bytes, embd
