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
        block, size = GGML_QUANT_SIZES[qtype]
        if cols % block:
            raise ValueError(f"{cols} columns is not a multiple of {qtype.name}'s block of {block}")
        return self.buffers[qtype][: rows * cols // block * size].reshape(rows, cols // block * size)


def write(path: Path, *, layers: int, embd: int, heads: int, kv_heads: int, head_dim: int, ff: int,
          vocab: int, ctx_train: int, name: str) -> int:
    """Write the model; returns the file's size in bytes."""
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
    kv = kv_heads * head_dim
    biggest = max(ff * embd, vocab * embd)
    pool = Pool({Q4_K: biggest // 256 * 144, Q6_K: vocab * embd // 256 * 210})
    f32 = np.float32
    ones = np.ones(max(embd, kv), f32)
    zeros = np.zeros(max(embd, kv), f32)
    w.add_tensor("token_embd.weight", pool.tensor(Q4_K, vocab, embd), raw_dtype=Q4_K)
    for il in range(layers):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", ones[:embd])
        for part, rows in (("attn_q", embd), ("attn_k", kv), ("attn_v", kv)):
            w.add_tensor(b + part + ".weight", pool.tensor(Q4_K, rows, embd), raw_dtype=Q4_K)
            w.add_tensor(b + part + ".bias", zeros[:rows])
        w.add_tensor(b + "attn_output.weight", pool.tensor(Q4_K, embd, embd), raw_dtype=Q4_K)
        w.add_tensor(b + "ffn_norm.weight", ones[:embd])
        w.add_tensor(b + "ffn_gate.weight", pool.tensor(Q4_K, ff, embd), raw_dtype=Q4_K)
        w.add_tensor(b + "ffn_up.weight", pool.tensor(Q4_K, ff, embd), raw_dtype=Q4_K)
        w.add_tensor(b + "ffn_down.weight", pool.tensor(Q4_K, embd, ff), raw_dtype=Q4_K)
    w.add_tensor("output_norm.weight", ones[:embd])
    w.add_tensor("output.weight", pool.tensor(Q6_K, vocab, embd), raw_dtype=Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--embd", type=int, default=5120)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ff", type=int, default=21504)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--ctx-train", type=int, default=32768)
    ap.add_argument("--name", default="random Qwen2 27B-class Q4_K")
    args = ap.parse_args()
    start = time.monotonic()
    size = write(args.out, layers=args.layers, embd=args.embd, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, ff=args.ff, vocab=args.vocab, ctx_train=args.ctx_train, name=args.name)
    print(f"wrote {args.out}: {size / 2**30:.2f} GiB in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
