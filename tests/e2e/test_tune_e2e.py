"""``llama-guard tune`` against the real llama-server on this CPU host: the write-up's slow baseline with a
bad thread count is tuned, ``--apply`` writes flags that keep the floors, and those flags decode clearly
faster when measured independently afterwards (``bench --compare``); a stop mid-trial leaves nothing
running and the file unchanged; flag sets that do not fit a stated VRAM size are never started.

The speed comparison needs the host's two cores to itself: it runs in the serial lane (tests/lanes.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from harness import ROOT, config_text, free_port
from llama_guard.config import load_config
from llama_guard.insight.model_facts import read_model_facts
from llama_guard.tune.price import price
from llama_guard.tune.space import Knobs

pytestmark = pytest.mark.usefixtures("clean_env")


def baseline(tmp: Path, binary: Path, model: Path, **tune: object) -> Path:
    """The write-up's slow baseline (scaled to the test model: 4096 tokens over 2 slots, batch 1024/512,
    f16 KV cache, flash attention on) with one thread on a host of two cores."""
    path = tmp / "lg.toml"
    path.write_text("# tuned by the test; this comment must survive --apply\n" + config_text({
        "server": {"binary": str(binary), "model": str(model), "port": free_port(), "n_gpu_layers": 0,
                   "ctx_size": 4096, "parallel": 2, "batch_size": 1024, "ubatch_size": 512, "cache_type_k": "f16",
                   "cache_type_v": "f16", "flash_attn": "on", "threads": 1},
        "gpu": {"enabled": "off"},
        "runtime": {"dir": str(tmp / "run")},
        "tune": {"min_ctx_size": 2048, "max_parallel": 2, "runs": 4, "tokens": 32, **tune},
    }))
    return path


def tune(config: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llama_guard", "tune", "--config", str(config), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.serial
def test_tune_finds_faster_flags_within_the_floors_and_applies_them(tmp_path: Path, llama_server_bin: Path,
                                                                     real_model: Path) -> None:
    config = baseline(tmp_path, llama_server_bin, real_model)
    before = config.read_text()
    (tmp_path / "baseline.toml").write_text(before)
    done = tune(config, "--minutes", "4", "--apply", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    tuned = load_config(config).server
    assert "this comment must survive --apply" in config.read_text()
    # the floors: never below min_ctx_size, only the listed KV cache types, at most max_parallel slots
    assert tuned.ctx_size >= 2048 and tuned.cache_type_k in ("f16", "q8_0") and tuned.parallel <= 2
    assert result["tuned"]["threads"] == tuned.threads and tuned.threads != 1, done.stderr[-3000:]
    # every trial: the VRAM prediction recorded beside it; the chosen one took a full-context prefill
    chosen = [c for c in result["candidates"] if c["flags"] == result["tuned"]]
    assert chosen and chosen[0]["prefill_ok"] is True
    assert all(c["predicted_vram_mib"] is not None for c in result["candidates"])
    # measured independently afterwards: bench on a server of each config, one after the other
    bench = subprocess.run([sys.executable, "-m", "llama_guard", "bench", "--config", str(tmp_path / "baseline.toml"),
                            "--compare", str(config), "--runs", "5", "--tokens", "48", "--json"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert bench.returncode == 0, bench.stderr[-2000:]
    ratio = json.loads(bench.stdout)["ratio_eval"]
    assert ratio > 1.2, f"tuned ÷ baseline decode tokens/s = {ratio:.2f}"


def test_a_stop_mid_trial_leaves_nothing_running_and_the_file_unchanged(tmp_path: Path, llama_server_bin: Path,
                                                                         real_model: Path) -> None:
    config = baseline(tmp_path, llama_server_bin, real_model, runs=50, tokens=512)
    before = config.read_bytes()
    proc = subprocess.Popen([sys.executable, "-m", "llama_guard", "tune", "--config", str(config), "--apply"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        servers: list[psutil.Process] = []
        deadline = time.monotonic() + 120
        while not servers and time.monotonic() < deadline and proc.poll() is None:  # a trial server runs
            servers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "llama-server" in p.name()]
            time.sleep(0.05)
        assert servers, "no trial server started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "unchanged" in err
    _, alive = psutil.wait_procs(servers, timeout=10)
    assert not alive, f"trial servers left running: {alive}"
    assert config.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".lg.toml")) == []


def test_candidates_that_do_not_fit_the_stated_vram_are_never_started(tmp_path: Path, llama_server_bin: Path,
                                                                       real_model: Path) -> None:
    facts = read_model_facts(real_model)
    base = Knobs(str(llama_server_bin), 99, 4096, 2, 1024, 512, "f16", "f16", "on", 1, None)
    need = price(facts, base, available_mib=None, margin_mib=0, gpu_build=False).predicted_mib
    config = baseline(tmp_path, llama_server_bin, real_model, vram_margin_mib=0, runs=2, tokens=16)
    text = config.read_text().replace("n_gpu_layers = 0", "n_gpu_layers = 99")
    text = text.replace('[gpu]\nenabled = "off"', f'[gpu]\nenabled = "off"\nvram_total_mib = {int(need) + 2}')
    config.write_text(text)
    done = tune(config, "--minutes", "0.5", "--json")  # priced out at every knob, measured or skipped for time
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    budget = result["available_vram_mib"]
    over = [c for c in result["candidates"] if c["predicted_vram_mib"] > budget]
    assert over, "no candidate was priced out: the test's VRAM figure is too generous"
    for c in over:  # priced out: no server, no run, no failure
        assert c["runs"] == 0 and c["failure"] is None and c["prefill_ok"] is None, c
    for c in result["candidates"]:
        if c["runs"]:
            assert c["predicted_vram_mib"] <= budget, c
    assert "priced out" in done.stderr
    assert os.path.exists(config)
