"""The VRAM budget from GGUF metadata: synthetic files written with the gguf package's writer, a
27B-class model's metadata at the settings of a 16 GB Q4_K_M model on a V100, and the operators' ladder."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_synth import facts_27b, write_gguf
from llama_guard.insight.budget import (
    MIB,
    Settings,
    cache_type_bytes,
    estimate,
    kv_cache_bytes,
    kv_read_bytes,
    ladder,
    layers_on_gpu,
)
from llama_guard.insight.model_facts import ModelFactsError, read_model_facts

MOTIVATING = Settings(n_gpu_layers=999, ctx_size=8192, parallel=1, batch_size=512, ubatch_size=256,
                      cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on")


def facts_formula(n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int, bpe: float, slots: int = 1) -> float:
    """docs/insight.md: 2 (K and V) × n_layer × n_ctx × n_head_kv × head_dim × bytes per element."""
    return 2 * n_layer * n_ctx * n_head_kv * head_dim * bpe * slots


def test_cache_type_sizes_are_ggmls() -> None:
    assert cache_type_bytes("f16") == 2.0
    assert cache_type_bytes("q8_0") == pytest.approx(1.0625)
    assert cache_type_bytes("q4_0") == pytest.approx(0.5625)
    assert cache_type_bytes("f32") == 4.0
    with pytest.raises(ValueError, match="unknown KV cache type"):
        cache_type_bytes("q3_z")


def test_metadata_read_from_a_written_gguf(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", n_layer=3, n_embd=64, n_head=4, n_head_kv=[2, 1, 2], n_vocab=300)
    f = read_model_facts(path)
    assert (f.architecture, f.n_layer, f.n_embd, f.n_head) == ("llama", 3, 64, 4)
    assert f.n_head_kv == (2, 1, 2)
    assert (f.key_length, f.value_length) == (16, 16)  # n_embd / n_head when the file does not say
    assert f.n_vocab == 300 and f.n_ff == 128
    blk1 = sum(t.n_bytes for t in f.tensors if t.name.startswith("blk.1."))
    # f32: norms 64 + q 64×64 + k,v 16×64 each + o 64×64 + norm 64 + gate/up/down 128×64 each
    assert blk1 == 4 * (64 + 64 * 64 + 2 * 16 * 64 + 64 * 64 + 64 + 3 * 128 * 64)


def test_kv_cache_per_layer_heads_and_the_facts_formula(tmp_path: Path) -> None:
    f = read_model_facts(write_gguf(tmp_path / "m.gguf", n_layer=3, n_head_kv=[2, 1, 2]))
    s = Settings(ctx_size=1000, cache_type_k="f16", cache_type_v="q8_0")
    cells = 1024  # padded to 256
    per_head = 16 * 2.0 + 16 * 1.0625
    assert kv_cache_bytes(f, s) == int(cells * (2 + 1 + 2) * per_head)


def test_sliding_window_layers_hold_the_window_only(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "swa.gguf", arch="gemma3", n_layer=6, n_head_kv=2, sliding_window=512,
                      swa_pattern=3)
    f = read_model_facts(path)
    assert f.swa_layers == (True, True, False, True, True, False)  # every 3rd layer dense
    s = Settings(ctx_size=8192, ubatch_size=256, cache_type_k="f16", cache_type_v="f16")
    per_cell = 2 * 16 * 2.0 * 2  # heads × (K + V) × f16
    swa_cells = 768  # pad(512 + 256, 256)
    assert kv_cache_bytes(f, s) == int((4 * swa_cells + 2 * 8192) * per_cell)
    explicit = read_model_facts(write_gguf(tmp_path / "arr.gguf", n_layer=4, sliding_window=128,
                                           swa_pattern=[True, False, False, True]))
    assert explicit.swa_layers == (True, False, False, True)


def test_sliding_window_without_pattern_follows_the_architecture(tmp_path: Path) -> None:
    f = read_model_facts(write_gguf(tmp_path / "g.gguf", arch="gemma3", n_layer=12, sliding_window=1024))
    assert f.swa_layers.count(False) == 2 and not f.swa_layers[5] and not f.swa_layers[11]
    assert any("assumed from the architecture" in n for n in f.notes)


def test_layer_placement_follows_llama_cpp() -> None:
    # llama-model.cpp: i_gpu_start = n_layer + 1 - ngl; the output layer is on the GPU from ngl >= 1.
    assert layers_on_gpu(30, 0) == (range(30, 30), False)
    assert layers_on_gpu(30, 1) == (range(30, 30), True)
    assert layers_on_gpu(30, 30) == (range(1, 30), True)
    assert layers_on_gpu(30, 99) == (range(0, 30), True)


def test_weights_on_gpu_token_embd_stays_on_cpu_and_tied_output_is_copied(tmp_path: Path) -> None:
    untied = read_model_facts(write_gguf(tmp_path / "u.gguf", n_layer=2, n_vocab=1000))
    tied = read_model_facts(write_gguf(tmp_path / "t.gguf", n_layer=2, n_vocab=1000, tied=True))
    embd = 1000 * 64 * 4
    b_untied = estimate(untied, Settings(n_gpu_layers=99), overhead_mib=0)
    b_tied = estimate(tied, Settings(n_gpu_layers=99), overhead_mib=0)
    blocks = sum(t.n_bytes for t in untied.tensors if t.name.startswith("blk."))
    assert b_untied.weights_gpu == blocks + embd + 64 * 4  # blocks + output + output_norm
    assert b_untied.weights_cpu == embd  # token_embd
    assert b_tied.weights_gpu == b_untied.weights_gpu  # the tied output is a GPU copy of token_embd
    assert estimate(untied, Settings(n_gpu_layers=0)).total == 0


def test_27b_at_the_motivating_settings_matches_the_facts_formula() -> None:
    f = facts_27b()
    b = estimate(f, MOTIVATING, overhead_mib=0)
    expected = facts_formula(n_layer=64, n_ctx=8192, n_head_kv=8, head_dim=128, bpe=1.0625)
    assert b.kv_cache == pytest.approx(expected, rel=1e-9)
    assert b.kv_cache / MIB == pytest.approx(1088.0)
    # Parallel slots share ctx_size (n_ctx_seq = ctx / parallel) unless the cache is unified.
    assert kv_cache_bytes(f, Settings(ctx_size=8192, parallel=4, cache_type_k="q8_0", cache_type_v="q8_0")) \
        == pytest.approx(expected)
    # Weights ~16 GB at Q4_K_M; the compute buffer (one micro-batch of activations) is ~100 MB and
    # halves with the micro-batch, less the attention mask's share.
    assert 15e9 < b.weights_gpu < 18e9
    assert 50 * MIB < b.compute < 200 * MIB
    half = estimate(f, Settings(**{**MOTIVATING.__dict__, "ubatch_size": 128}), overhead_mib=0).compute
    assert half == pytest.approx(b.compute / 2, rel=0.01)


def test_27b_does_not_fit_a_16_gb_v100_and_the_ladder_says_what_helps() -> None:
    f = facts_27b()
    available = 16 * 1024 * MIB
    b = estimate(f, MOTIVATING, available=available)
    assert b.fits is False
    steps = {s.change.split(" ")[0]: s for s in ladder(f, MOTIVATING, b)}
    kv_q8 = b.kv_cache
    q4 = steps["cache_type_k"]
    assert q4.saves == pytest.approx(kv_q8 * (1 - 0.5625 / 1.0625), rel=1e-6)
    assert "quality" in q4.caveat
    ngl = steps["n_gpu_layers"]
    assert ngl.fits_after is True and "CPU" in ngl.caveat
    assert all(s.saves > 0 for s in steps.values())


def test_an_f16_cache_gets_both_quantized_rungs_with_caveats() -> None:
    f = facts_27b()
    s = Settings(ctx_size=32768, cache_type_k="f16", cache_type_v="f16", flash_attn="on")
    b = estimate(f, s, available=20 * 1024 * MIB)
    assert b.fits is False
    changes = [st.change for st in ladder(f, s, b)]
    assert 'cache_type_k = cache_type_v = "q8_0"' in changes and 'cache_type_k = cache_type_v = "q4_0"' in changes
    ctx = next(st for st in ladder(f, s, b) if st.change.startswith("ctx_size"))
    assert ctx.fits_after is True
    # The largest context that fits: one more 256-cell step would not.
    largest = int(ctx.change.split()[2])
    assert estimate(f, Settings(**{**s.__dict__, "ctx_size": largest + 256}), available=b.available).fits is False


def test_kv_read_per_token_counts_the_window_of_swa_layers() -> None:
    f = facts_27b(arch="gemma3", n_layer=62, n_embd=5376, n_head=32, n_head_kv=16, sliding_window=1024)
    s = Settings(cache_type_k="f16", cache_type_v="f16")
    dense = sum(1 for il in range(62) if not f.is_swa(il))
    per_cell = 16 * 128 * 2 * 2.0
    assert kv_read_bytes(f, s, 4000) == int((dense * 4000 + (62 - dense) * 1024) * per_cell)


def test_not_a_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" * 100)
    with pytest.raises(ModelFactsError, match=str(bad)):
        read_model_facts(bad)
    with pytest.raises(ModelFactsError, match="No such file"):
        read_model_facts(tmp_path / "missing.gguf")
