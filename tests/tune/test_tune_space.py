"""The tuner's pure parts: the alternatives within the [tune] floors, the pricing by the VRAM model,
the rule that a challenger wins only by more than the spread, and --apply's edit of the file."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from llama_guard.config import load_config
from llama_guard.insight.model_facts import read_model_facts
from llama_guard.tune.apply import ApplyError, apply_changes
from llama_guard.tune.price import most_layers, price
from llama_guard.tune.search import beats
from llama_guard.tune.space import Knob, Knobs, Space, alternatives, thread_counts

BASE = Knobs(binary="llama-server", n_gpu_layers=99, ctx_size=32768, parallel=4, batch_size=1024, ubatch_size=512,
             cache_type_k="f16", cache_type_v="f16", flash_attn="on", threads=1, threads_batch=None)
SPACE = Space(binaries=("/opt/b2/llama-server",), cache_types=("f16", "q8_0"), min_ctx_size=8192, min_parallel=1,
              max_parallel=4, cpu_threads=6, cpu_layers=True)


def test_alternatives_keep_the_floors() -> None:
    ctx = [k.ctx_size for k in alternatives(Knob.CTX_SIZE, BASE, SPACE)]
    assert ctx == [32768, 16384, 8192]  # halvings down to min_ctx_size, never above the configured context
    caches = {(k.cache_type_k, k.cache_type_v) for k in alternatives(Knob.CACHE_TYPE, BASE, SPACE)}
    assert caches == {("f16", "f16"), ("q8_0", "q8_0")}  # q4_0 only when listed
    wider = replace(SPACE, cache_types=("f16", "q8_0", "q4_0"))
    assert ("q4_0", "q4_0") in {(k.cache_type_k, k.cache_type_v) for k in alternatives(Knob.CACHE_TYPE, BASE, wider)}
    assert {k.parallel for k in alternatives(Knob.PARALLEL, BASE, replace(SPACE, max_parallel=2))} <= {1, 2, 4}
    assert max(k.parallel for k in alternatives(Knob.PARALLEL, BASE, replace(SPACE, max_parallel=2))[1:]) <= 2
    assert min(k.parallel for k in alternatives(Knob.PARALLEL, BASE, replace(SPACE, min_parallel=2))[1:]) >= 2
    assert [k.binary for k in alternatives(Knob.BINARY, BASE, SPACE)] == ["llama-server", "/opt/b2/llama-server"]


def test_alternatives_are_flag_sets_llama_server_accepts() -> None:
    for knob in Knob:
        for k in alternatives(knob, BASE, SPACE):
            assert k.problem() is None, (knob, k)
    # a quantized V cache brings flash attention with it instead of being dropped
    off = replace(BASE, flash_attn="off")
    q8 = [k for k in alternatives(Knob.CACHE_TYPE, off, SPACE) if k.cache_type_v == "q8_0"]
    assert q8 and q8[0].flash_attn == "on"
    assert replace(BASE, ubatch_size=2048).problem() is not None


def test_threads_explored_only_when_layers_run_on_the_cpu() -> None:
    assert thread_counts(6) == [1, 2, 4, 6]
    assert thread_counts(1) == [1]
    assert alternatives(Knob.THREADS, BASE, replace(SPACE, cpu_layers=False)) == [BASE]
    assert {k.threads for k in alternatives(Knob.THREADS, BASE, SPACE)} == {1, 2, 4, 6}


def test_a_challenger_wins_only_by_more_than_the_spread() -> None:
    assert beats([12.0, 12.5, 13.0], [10.0, 10.5, 11.0])
    assert not beats([11.5, 12.0, 12.5], [10.0, 10.5, 12.2])  # median under the incumbent's fastest run
    assert not beats([10.4, 12.0, 12.5], [10.0, 10.5, 11.0])  # slowest run under the incumbent's median
    assert not beats([], [1.0])
    assert not beats([10.0, 10.0], [10.0, 10.0])  # a tie is no win


@pytest.fixture(scope="module")
def facts():  # type: ignore[no-untyped-def]
    return read_model_facts(os.environ["LLAMA_GUARD_TEST_MODEL"])


def test_pricing_uses_the_vram_model_with_the_margin(facts) -> None:  # type: ignore[no-untyped-def]
    k = replace(BASE, ctx_size=4096, parallel=2)
    need = price(facts, k, available_mib=None, margin_mib=0, gpu_build=True).predicted_mib
    assert price(facts, k, available_mib=None, margin_mib=0, gpu_build=True).fits  # no figure: nothing priced out
    assert price(facts, k, available_mib=need + 1, margin_mib=0, gpu_build=True).fits
    tight = price(facts, k, available_mib=need + 1, margin_mib=2, gpu_build=True)
    assert not tight.fits and "vram_margin_mib" in tight.why_not()
    q8 = replace(k, cache_type_k="q8_0", cache_type_v="q8_0")
    assert price(facts, q8, available_mib=need + 1, margin_mib=2, gpu_build=True).fits  # a smaller cache fits


def test_most_layers_that_fit(facts) -> None:  # type: ignore[no-untyped-def]
    k = replace(BASE, ctx_size=4096, parallel=1, n_gpu_layers=10)
    full = replace(k, n_gpu_layers=facts.n_layer + 1)
    need_full = price(facts, full, available_mib=None, margin_mib=0, gpu_build=True).predicted_mib
    assert most_layers(facts, k, available_mib=need_full + 1, margin_mib=0, gpu_build=True) == full
    fewer = most_layers(facts, k, available_mib=need_full - 20, margin_mib=0, gpu_build=True)
    assert 0 < fewer.n_gpu_layers < facts.n_layer + 1
    assert price(facts, fewer, available_mib=need_full - 20, margin_mib=0, gpu_build=True).fits
    assert most_layers(facts, k, available_mib=None, margin_mib=0, gpu_build=True) == k  # nothing to fit in


def test_apply_keeps_comments_and_other_keys(tmp_path: Path) -> None:
    path = tmp_path / "lg.toml"
    text = ('# my box\n[server]\nmodel = "/m.gguf"  # the 27B\nthreads = 1\nctx_size = 32768\n\n'
            '[health]\n# probes\ninterval_s = 7.0\n')
    path.write_text(text)
    apply_changes(path, {"threads": 6, "ctx_size": 8192, "cache_type_k": "q8_0"})
    out = path.read_text()
    assert "# my box" in out and "# the 27B" in out and "# probes" in out
    cfg = load_config(path)
    assert (cfg.server.threads, cfg.server.ctx_size, cfg.server.cache_type_k) == (6, 8192, "q8_0")
    assert cfg.health.interval_s == 7.0


def test_apply_that_would_not_load_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "lg.toml"
    text = '[server]\nmodel = "/m.gguf"\nbatch_size = 512\n'
    path.write_text(text)
    with pytest.raises(ApplyError, match="ubatch_size"):
        apply_changes(path, {"ubatch_size": 1024})  # ubatch above batch: the config refuses it
    assert path.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lg.toml"]  # no temporary left behind
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\n")
    with pytest.raises(ApplyError, match="not valid TOML"):
        apply_changes(broken, {"threads": 2})
    assert broken.read_text() == "[server\n"
