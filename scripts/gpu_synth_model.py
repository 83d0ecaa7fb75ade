#!/usr/bin/env python3
"""Write a large random-weight GGUF that llama-server loads: a Qwen2-architecture model at a chosen shape
(default: 27B-class, 64 layers × 5120, 40 query / 8 KV heads of 128, feed-forward 21504, vocabulary 152064),
Q4_K block tensors, written with the ``gguf`` package's own writer (llama.cpp's ``gguf-py``).

What it is for: ``check``'s VRAM budget and ``bench``'s bandwidth ceiling at the scale where decode reads the
whole model per token (a 27B at Q4_K is ~15 GiB), on a GPU machine with nothing to download. The weights
are random bytes in Q4_K's block layout (``ggml-common.h``: ``block_q4_K`` = f16 ``d``, f16 ``dmin``, 12
bytes of 6-bit scales, 128 bytes of 4-bit quants; 256 weights in 144 bytes) with the two f16 scales set to
a small finite value, so matrix products stay finite; the text it generates is noise, its speed is a real
model's (the kernels and the bytes read per token do not depend on the values).

The tokenizer is a SentencePiece-style ("llama") vocabulary of the chosen size: ``<unk>``, ``<s>``,
``</s>``, the 256 byte tokens ``<0x00>``…``<0xFF>`` (any text tokenizes through them) and filler pieces,
with a ChatML chat template so ``/v1/chat/completions`` works.

    python3 scripts/gpu_synth_model.py --out /tmp/qwen27b-q4k.gguf            # ~14.2 GiB
    python3 scripts/gpu_synth_model.py --out m.gguf --layers 2 --embd 512 --heads 4 --kv-heads 2 --ff 1536 --vocab 4096
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
Q4_K = GGMLQuantizationType.Q4_K
Q6_K = GGMLQuantizationType.Q6_K


def random_blocks(qtype: GGMLQuantizationType, n_bytes: int, seed: int = 0) -> np.ndarray:
    """``n_bytes`` of random ``qtype`` blocks whose f16 scale fields hold 2**-10 (finite, small)."""
    _, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=n_bytes, dtype=np.uint8).reshape(-1, size)
    scale = np.frombuffer(np.float16(2.0**-10).tobytes(), dtype=np.uint8)
    if qtype == Q4_K:  # d, dmin first (2 + 2 bytes)
        data[:, 0:2] = scale
        data[:, 2:4] = scale
    elif qtype == Q6_K:  # ql[128] qh[64] scales[16] d (last 2 bytes)
        data[:, -2:] = scale
    return data.reshape(-1)


class Pool:
    """One random buffer per quant type; each tensor is a view of its first bytes (no copy, the same
    random blocks reused: speed does not depend on the values)."""

    def __init__(self, largest: dict[GGMLQuantizationType, int]) -> None:
        self.buffers = {q: random_blocks(q, n, seed=i) for i, (q, n) in enumerate(largest.items())}

    def tensor(self, qtype: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
        """A ``rows × cols`` weight (``cols`` the fast dimension, a multiple of the block size) as raw blocks."""
        return self.buffers[qtype][: rows * row_bytes(qtype, cols)].reshape(rows, row_bytes(qtype, cols))


def row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{cols} columns is not a multiple of {qtype.name}'s block of {block}")
    return cols // block * size


Plan = list[tuple[str, GGMLQuantizationType | None, tuple[int, ...]]]


def tensor_plan(*, layers: int, embd: int, kv: int, ff: int, vocab: int) -> Plan:
    """``(name, quant type or None for f32, shape (rows, cols) or (n,))`` of every tensor, as llama.cpp's
    qwen2 loader names them (``src/models/qwen2.cpp``): Q4_K matrices, a Q6_K output, f32 norms and biases."""
    plan: Plan = [("token_embd.weight", Q4_K, (vocab, embd))]
    for il in range(layers):
        b = f"blk.{il}."
        plan.append((b + "attn_norm.weight", None, (embd,)))
        for part, rows in (("attn_q", embd), ("attn_k", kv), ("attn_v", kv)):
            plan += [(b + part + ".weight", Q4_K, (rows, embd)), (b + part + ".bias", None, (rows,))]
        plan += [(b + "attn_output.weight", Q4_K, (embd, embd)), (b + "ffn_norm.weight", None, (embd,)),
                 (b + "ffn_gate.weight", Q4_K, (ff, embd)), (b + "ffn_up.weight", Q4_K, (ff, embd)),
                 (b + "ffn_down.weight", Q4_K, (embd, ff))]
    return [*plan, ("output_norm.weight", None, (embd,)), ("output.weight", Q6_K, (vocab, embd))]


def write(path: Path, *, layers: int, embd: int, heads: int, kv_heads: int, head_dim: int, ff: int,
          vocab: int, ctx_train: int, name: str, sparse: bool = False) -> int:
    """Write the model; returns the file's size in bytes. ``sparse``: the header, metadata and tensor
    index only, the data left as a hole of the right size (a file of the full size that takes ~no disk:
    what a test needs to read the model's facts)."""
    if heads * head_dim != embd or heads % kv_heads:
        raise ValueError("qwen2 needs heads × head_dim == embedding length and heads a multiple of KV heads")
    w = GGUFWriter(str(path), "qwen2")
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(ctx_train)
    w.add_embedding_length(embd)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_tokenizer_model("llama")
    special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tokens = special + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(vocab - len(tokens))]
    types = ([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL]
             + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * (vocab - len(special) - 256))
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    plan = tensor_plan(layers=layers, embd=embd, kv=kv_heads * head_dim, ff=ff, vocab=vocab)
    if sparse:
        data = 0
        for tname, qtype, shape in plan:
            if qtype is None:
                w.add_tensor_info(tname, shape, np.dtype(np.float32), 4 * shape[0])
            else:
                nbytes = shape[0] * row_bytes(qtype, shape[1])
                w.add_tensor_info(tname, (shape[0], row_bytes(qtype, shape[1])), np.dtype(np.uint8), nbytes,
                                  raw_dtype=qtype)
            data += GGUFWriter.ggml_pad(w.tensors[-1][tname].nbytes, w.data_alignment)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        with open(path, "r+b") as handle:
            handle.truncate(GGUFWriter.ggml_pad(handle.seek(0, 2), w.data_alignment) + data)
        return path.stat().st_size
    pool = Pool({Q4_K: max(ff, vocab) * row_bytes(Q4_K, embd), Q6_K: vocab * row_bytes(Q6_K, embd)})
    ones = np.ones(max(embd, kv_heads * head_dim), np.float32)
    zeros = np.zeros_like(ones)
    for tname, qtype, shape in plan:
        if qtype is None:
            w.add_tensor(tname, (zeros if tname.endswith(".bias") else ones)[: shape[0]])
        else:
            w.add_tensor(tname, pool.tensor(qtype, *shape), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.stat().st_size


SHAPE_27B = {"layers": 64, "embd": 5120, "heads": 40, "kv_heads": 8, "head_dim": 128, "ff": 21504, "vocab": 152064,
             "ctx_train": 32768}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=SHAPE_27B["layers"])
    ap.add_argument("--embd", type=int, default=SHAPE_27B["embd"])
    ap.add_argument("--heads", type=int, default=SHAPE_27B["heads"])
    ap.add_argument("--kv-heads", type=int, default=SHAPE_27B["kv_heads"])
    ap.add_argument("--head-dim", type=int, default=SHAPE_27B["head_dim"])
    ap.add_argument("--ff", type=int, default=SHAPE_27B["ff"])
    ap.add_argument("--vocab", type=int, default=SHAPE_27B["vocab"])
    ap.add_argument("--ctx-train", type=int, default=SHAPE_27B["ctx_train"])
    ap.add_argument("--name", default="random Qwen2 27B-class Q4_K")
    ap.add_argument("--sparse", action="store_true", help="header and tensor index only, the data a hole")
    args = ap.parse_args()
    start = time.monotonic()
    size = write(args.out, layers=args.layers, embd=args.embd, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, ff=args.ff, vocab=args.vocab, ctx_train=args.ctx_train, name=args.name,
                 sparse=args.sparse)
    print(f"wrote {args.out}: {size / 2**30:.2f} GiB in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
