"""Small GGUF files written with the gguf package's own writer (the format llama.cpp reads), and
ModelFacts for models too big to write (a 27B-class model's metadata with its tensor sizes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter
from llama_guard.insight.model_facts import ModelFacts, TensorInfo, swa_layout


def write_gguf(path: Path, *, arch: str = "llama", n_layer: int = 4, n_embd: int = 64, n_head: int = 4,
               n_head_kv: int | list[int] = 2, head_dim: int | None = None, n_ff: int = 128, n_vocab: int = 256,
               sliding_window: int = 0, swa_pattern: int | list[bool] | None = None, tied: bool = False) -> Path:
    """A tiny model: f32 tensors named as llama.cpp names them (token_embd, blk.N.*, output_norm, output)."""
    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    hd = head_dim or n_embd // n_head
    if head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if sliding_window:
        w.add_sliding_window(sliding_window)
        if swa_pattern is not None:
            w.add_sliding_window_pattern(swa_pattern)
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    f32 = np.float32
    w.add_tensor("token_embd.weight", np.zeros((n_vocab, n_embd), f32))
    for il in range(n_layer):
        kvh = n_head_kv[il] if isinstance(n_head_kv, list) else n_head_kv
        for name, shape in (("attn_norm", (n_embd,)), ("attn_q", (n_head * hd, n_embd)),
                            ("attn_k", (kvh * hd, n_embd)), ("attn_v", (kvh * hd, n_embd)),
                            ("attn_output", (n_embd, n_head * hd)), ("ffn_norm", (n_embd,)),
                            ("ffn_gate", (n_ff, n_embd)), ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))):
            w.add_tensor(f"blk.{il}.{name}.weight", np.zeros(shape, f32))
    w.add_tensor("output_norm.weight", np.zeros((n_embd,), f32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((n_vocab, n_embd), f32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Q4_K_M averages ~4.85 bits per weight over a 27B model (16.5 GB files are typical); Q6_K output.
Q4_K_M_BYTES_PER_WEIGHT = 4.85 / 8
Q6_K_BYTES_PER_WEIGHT = 6.5625 / 8


def facts_27b(*, arch: str = "qwen2", n_layer: int = 64, n_embd: int = 5120, n_head: int = 40, n_head_kv: int = 8,
              head_dim: int = 128, n_ff: int = 21504, n_vocab: int = 152064, sliding_window: int = 0,
              swa_pattern: int | None = None) -> ModelFacts:
    """A 27B-class model's facts with tensor sizes at Q4_K_M (no file: 16 GB is not written in a test)."""
    per_layer = int((n_embd * (n_head + 2 * n_head_kv) * head_dim + n_head * head_dim * n_embd
                     + 3 * n_embd * n_ff) * Q4_K_M_BYTES_PER_WEIGHT)
    tensors = [TensorInfo("token_embd.weight", int(n_vocab * n_embd * Q4_K_M_BYTES_PER_WEIGHT))]
    tensors += [TensorInfo(f"blk.{il}.all.weight", per_layer) for il in range(n_layer)]
    tensors += [TensorInfo("output.weight", int(n_vocab * n_embd * Q6_K_BYTES_PER_WEIGHT)),
                TensorInfo("output_norm.weight", n_embd * 4)]
    swa: tuple[bool, ...] = ()
    if sliding_window:
        swa, _ = swa_layout(n_layer, swa_pattern, arch)
    return ModelFacts(architecture=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                      n_head_kv=(n_head_kv,) * n_layer, key_length=head_dim, value_length=head_dim,
                      n_vocab=n_vocab, n_ff=n_ff, n_ctx_train=32768, tensors=tuple(tensors),
                      sliding_window=sliding_window, swa_layers=swa)


def _q4_k_m_type(name: str, layer: int, n_layer: int) -> Any:
    """The type llama.cpp's Q4_K_M recipe gives a tensor (``llama-quant.cpp``: Q6_K for the output and, in
    the "more bits" layers — the first and last eighth and every third in between — for attn_v and
    ffn_down; Q4_K for the other matrices; F32 norms)."""
    from gguf import GGMLQuantizationType as T

    if name.endswith("_norm"):
        return T.F32
    if name == "output":
        return T.Q6_K
    more_bits = layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2
    if name in ("attn_v", "ffn_down") and more_bits:
        return T.Q6_K
    return T.Q4_K


def write_gguf_27b(path: Path, *, n_layer: int = 64, n_embd: int = 5120, n_head: int = 40, n_head_kv: int = 8,
                   head_dim: int = 128, n_ff: int = 21504, n_vocab: int = 152064) -> Path:
    """A 27B-class qwen2-shaped model at Q4_K_M as a real GGUF header and tensor index, its ~16 GB of tensor
    data a hole (a sparse file: the size is right, no block is written). Enough for everything that reads
    only the header (``llama-guard check``'s VRAM budget), never for llama-server."""
    from gguf import GGML_QUANT_SIZES

    w = GGUFWriter(str(path), "qwen2")
    w.add_block_count(n_layer)
    w.add_context_length(32768)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(n_vocab)

    def tensor(name: str, shape: tuple[int, ...], layer: int = 0) -> None:
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        qtype = _q4_k_m_type(kind, layer, n_layer)
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(shape))
        # shape in numpy order (rows, row length), as add_tensor takes it
        w.add_tensor_info(name, shape, np.dtype(np.float32), n_elems // block * type_size, raw_dtype=qtype)

    tensor("token_embd.weight", (n_vocab, n_embd))
    for il in range(n_layer):
        for name, shape in (("attn_norm", (n_embd,)), ("attn_q", (n_head * head_dim, n_embd)),
                            ("attn_k", (n_head_kv * head_dim, n_embd)), ("attn_v", (n_head_kv * head_dim, n_embd)),
                            ("attn_output", (n_embd, n_head * head_dim)), ("ffn_norm", (n_embd,)),
                            ("ffn_gate", (n_ff, n_embd)), ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))):
            tensor(f"blk.{il}.{name}.weight", shape, il)
    tensor("output_norm.weight", (n_embd,))
    tensor("output.weight", (n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    out = w.fout[0]
    header_end = out.tell()
    data_start = GGUFWriter.ggml_pad(header_end, w.data_alignment)
    data = sum(GGUFWriter.ggml_pad(ti.nbytes, w.data_alignment) for ti in w.tensors[0].values())
    w.close()
    with path.open("r+b") as f:
        f.truncate(data_start + data)
    return path
