"""End to end with the REAL llama-server and SmolLM2: `check` (VRAM budget, --json), `bench` (its
figures are the server's own, --compare), `status` (human, --json, exit codes) and the Prometheus
endpoint of a running daemon, parsed with prometheus_client.parser."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import ROOT, SERVER_THREADS, DaemonRun, RunPool, config_text, free_port, server_pids_of
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.real


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")}
    return subprocess.run([sys.executable, "-m", "llama_guard", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, cwd=str(ROOT), env=env)


@pytest.fixture
def real(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> Any:
    pool = RunPool()

    def make(extra: dict[str, dict[str, object]] | None = None, sub: str = "a") -> DaemonRun:
        where = tmp_path / sub
        where.mkdir()
        return pool.new(where, str(llama_server_bin), str(real_model), extra)

    yield make
    leftovers = pool.finish()
    if leftovers:
        pytest.fail(f"llama-server pids {leftovers} outlived their daemon")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# ---------------------------------------------------------------------------------------------- check

def test_check_on_the_demo_config_and_a_context_too_large_for_a_stated_vram(tmp_path: Path, llama_server_bin: Path,
                                                                           real_model: Path) -> None:
    demo = tmp_path / "demo.toml"  # as scripts/demo.sh writes it: the CPU, no offload
    demo.write_text(config_text({"server": {"binary": str(llama_server_bin), "model": str(real_model),
                                            "port": free_port(), "n_gpu_layers": 0, "ctx_size": 2048},
                                 "gpu": {"enabled": "auto", "require_server_on_gpu": False},
                                 "runtime": {"dir": str(tmp_path / "run")}}))
    out = cli("check", "--config", str(demo))
    assert out.returncode == 0, out.stdout + out.stderr
    vram = next(line for line in out.stdout.splitlines() if " vram budget " in line)
    assert vram.startswith("OK") and "n_gpu_layers = 0: nothing on the GPU" in vram

    big = tmp_path / "big.toml"  # all layers offloaded, 65536 tokens of f16 KV cache, a stated 1 GiB card
    big.write_text(config_text({"server": {"binary": str(llama_server_bin), "model": str(real_model),
                                           "port": free_port(), "n_gpu_layers": 99, "ctx_size": 65536,
                                           "cache_type_k": "f16", "cache_type_v": "f16"},
                                "gpu": {"enabled": "auto", "vram_total_mib": 1024},
                                "runtime": {"dir": str(tmp_path / "run")}}))
    out = cli("check", "--config", str(big))
    assert out.returncode == 78, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    verdict = next(line for line in lines if " vram budget " in line)
    assert verdict.startswith("FAIL") and "does not fit" in verdict and "[gpu].vram_total_mib = 1024" in verdict
    ladder = [line for line in lines if line.startswith("HINT")]
    assert any("ctx_size = " in line and "→ fits" in line for line in ladder), ladder
    assert any('"q4_0"' in line and "quality" in line for line in ladder), ladder
    doc = json.loads(cli("check", "--json", "--config", str(big)).stdout)
    data = next(c for c in doc["checks"] if c["name"] == "vram budget")["data"]
    assert doc["ok"] is False and data["budget"]["fits"] is False and data["budget"]["available_mib"] == 1024
    # f16 KV cache of 30 layers × 65536 cells × 3 heads × (64 + 64) × 2 B = 1440 MiB (docs/insight.md's formula).
    assert data["budget"]["kv_cache_mib"] == pytest.approx(2 * 30 * 65536 * 3 * 64 * 2 / 2**20, rel=1e-6)
    ctx_step = next(s for s in data["ladder"] if s["change"].startswith("ctx_size"))
    assert ctx_step["fits_after"] is True and ctx_step["total_after_mib"] <= 1024


# ---------------------------------------------------------------------- a running daemon: status, metrics, bench

def eval_lines(run: DaemonRun, tokens: int) -> list[float]:
    """tokens/s of the server's own `eval time = ... / N tokens (... tokens per second)` lines for N = tokens."""
    out = []
    for e in run.events():
        if e["event"] == "server_line" and "prompt eval time" not in e["line"]:
            m = re.search(r"eval time =.*/\s*(\d+) tokens .*?([\d.]+) tokens per second", e["line"])
            if m and int(m.group(1)) == tokens:
                out.append(float(m.group(2)))
    return out


def test_status_metrics_and_bench_on_a_running_daemon(real: Any, tmp_path: Path, llama_server_bin: Path) -> None:
    # The server binary is the real one behind a 3 s delay, so that "starting" lasts long enough to be seen.
    slow = tmp_path / "slow-llama-server"
    slow.write_text(f"#!/bin/sh\nsleep 3\nexec {llama_server_bin} \"$@\"\n")
    slow.chmod(0o755)
    metrics_port = free_port()
    run = real({"server": {"binary": str(slow)}, "metrics": {"listen": str(metrics_port)},
                "health": {"interval_s": 1.0, "canary": False}}).start()
    cfg = str(run.config)

    run.wait_event("server_starting", 30)
    starting = cli("status", "--json", "--config", cfg)
    doc = json.loads(starting.stdout)
    assert starting.returncode == 1 and doc["schema"] == 1 and doc["ready"] is False, starting.stdout
    assert doc["phase"] == "starting"

    ready = run.wait_event("server_ready", 60)
    deadline = time.monotonic() + 10
    while (out := cli("status", "--json", "--config", cfg)).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["ready"] is True and doc["server_pid"] == ready["server_pid"]
    assert doc["server_uptime_s"] is not None and doc["metrics"]["listen"] == f"127.0.0.1:{metrics_port}"
    human = cli("status", "--config", cfg)
    assert human.returncode == 0
    assert "{" not in human.stdout and f"pid {ready['server_pid']}, up" in human.stdout
    assert "server_ready" in human.stdout and "restarts" in human.stdout

    # check beside the running daemon: the ports it holds are its own, not a warning.
    lines = cli("check", "--config", cfg).stdout.splitlines()
    port = next(line for line in lines if line.split()[1:2] == ["port"])
    exporter = next(line for line in lines if line.split()[1:2] == ["metrics"])
    assert port.startswith("OK") and f"held by the running llama-guard (pid {run.proc.pid})" in port, lines
    assert exporter.startswith("OK") and f"served now by the running llama-guard (pid {run.proc.pid})" in exporter

    m = scrape(metrics_port)
    assert m[("llama_guard_phase", (("phase", "ready"),))] == 1 and m[("llama_guard_server_ready", ())] == 1
    assert m[("llama_guard_events_total", (("event", "server_ready"),))] == 1
    assert m[("llama_guard_ready_duration_seconds", ())] >= 0
    assert m[("llama_guard_phase_seconds_count", (("phase", "starting"),))] == 1
    assert m[("llama_guard_phase_seconds_sum", (("phase", "starting"),))] >= 3.0  # the wrapper's delay

    # bench against the daemon's server: its per-run figures are the server's own timings.
    bench = cli("bench", "--json", "--runs", "3", "--tokens", "24", "--config", cfg)
    assert bench.returncode == 0, bench.stderr
    result = json.loads(bench.stdout)["results"][0]
    speeds = [r["predicted_per_second"] for r in result["runs"]]
    own = eval_lines(run, 24)
    assert len(own) == 4  # warm-up + 3 runs, as the server logged them
    assert sorted(round(s, 2) for s in speeds) == sorted(round(s, 2) for s in own[1:])
    # the server's log prints tokens/s with 2 decimals
    assert result["eval_tokens_per_s"]["median"] == pytest.approx(statistics.median(own[1:]), rel=1e-3, abs=0.006)
    assert result["ceiling"]["ceiling_tokens_per_s"] is None  # no GPU, no [gpu].memory_bandwidth_gbs
    assert "ceiling unknown" in result["ceiling"]["verdict"]
    m = scrape(metrics_port)
    assert m[("llama_guard_bench_eval_tokens_per_second", ())] == pytest.approx(result["eval_tokens_per_s"]["median"])

    # A crash is counted by its cause; status shows it.
    os.kill(ready["server_pid"], signal.SIGKILL)
    run.wait_event("server_ready", 60, skip=1)
    m = scrape(metrics_port)
    assert m[("llama_guard_restarts_total", (("cause", "crash"),))] == 1
    human = cli("status", "--config", cfg).stdout
    assert "restarts  1 (crash 1)" in human or "(crash 1)" in human, human

    run.signal(signal.SIGTERM)
    assert run.wait_exit(30) == 0
    gone = cli("status", "--json", "--config", cfg)
    assert gone.returncode == 3 and json.loads(gone.stdout)["running"] is False


def test_bench_compare_flash_attention_on_and_off(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    configs = []
    for fa in ("on", "off"):
        path = tmp_path / f"fa-{fa}.toml"
        path.write_text(config_text({"server": {"binary": str(llama_server_bin), "model": str(real_model),
                                                "port": free_port(), "n_gpu_layers": 0, "ctx_size": 1024,
                                                "threads": SERVER_THREADS, "flash_attn": fa, "cache_type_k": "f16",
                                                "cache_type_v": "f16"},
                                     "gpu": {"enabled": "off", "memory_bandwidth_gbs": 20.0},
                                     "runtime": {"dir": str(tmp_path / f"run-{fa}")}}))
        configs.append(path)
    out = cli("bench", "--json", "--runs", "2", "--tokens", "16", "--config", str(configs[0]),
              "--compare", str(configs[1]))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    a, b = doc["results"]
    assert (a["label"], b["label"]) == ("fa-on.toml", "fa-off.toml")
    assert doc["ratio_eval"] == pytest.approx(b["eval_tokens_per_s"]["median"] / a["eval_tokens_per_s"]["median"])
    # A stated bandwidth gives a CPU ceiling: all weights but token_embd read per token.
    assert a["ceiling"]["ceiling_tokens_per_s"] == pytest.approx(20e9 / a["ceiling"]["bytes_per_token"])
    assert 0 < a["ceiling"]["efficiency"] < 1.5
    for path in configs:  # each server was stopped after its bench
        port = int(re.search(r"port = (\d+)", path.read_text()).group(1))  # type: ignore[union-attr]
        assert server_pids_of(port) == []
