"""The metrics a balancer or scheduler acts on, against the real llama-server on the real model: which
llama-guard runs, free and busy slots (read from the server at the scrape), and the conversations whose KV
cache is held in the server's slots and in slot files. The GPU figures (VRAM headroom, throttling) are
tested on NVML samples in tests/exporter/test_metrics.py: this host has no GPU."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import RunPool, free_port
from llama_guard import __version__
from llama_guard.host.build import commit_of, release_of
from prometheus_client.parser import text_string_to_metric_families

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def pool() -> Any:
    runs = RunPool()
    yield runs
    leftovers = runs.finish()
    if leftovers:
        pytest.fail(f"llama-server pids {leftovers} outlived their daemon")


def scrape(port: int) -> Scrape:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def slots(m: Scrape) -> tuple[float | None, float | None]:
    return m.get(("llama_guard_server_slots", (("state", "busy"),))), \
        m.get(("llama_guard_server_slots", (("state", "free"),)))


def held(m: Scrape, place: str) -> float | None:
    return m.get(("llama_guard_kv_cache_conversations", (("place", place),)))


def read_slots(port: int, timeout_s: float = 60.0) -> Scrape:
    """A scrape that carries the server's slots: a scrape whose /slots read found llama-server between two
    decode steps too late (0.5 s) leaves them out, so a busy host may need a few."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(port)
        if slots(m) != (None, None) or time.monotonic() > deadline:
            return m


def test_slots_conversations_and_build_info_from_the_real_server(pool: RunPool, tmp_path: Path,
                                                                  llama_server_bin: Path, real_model: Path) -> None:
    # llama-server is held back until the test has scraped a daemon whose server is not ready yet.
    go = tmp_path / "go"
    held_back = tmp_path / "held-back-llama-server"
    held_back.write_text(f"#!/bin/sh\nwhile [ ! -e {go} ]; do sleep 0.05; done\nexec {llama_server_bin} \"$@\"\n")
    held_back.chmod(0o755)
    metrics_port = free_port()
    run = pool.new(tmp_path, str(held_back), str(real_model), {
        "server": {"parallel": 2},
        "health": {"canary": False},  # no canary task in a slot: every conversation counted is the test's
        "metrics": {"listen": str(metrics_port)},
        "slots": {"rolling_save_interval_s": 0.5},
    }).start()
    run.wait_event("server_starting", 60)
    m = scrape(metrics_port)
    assert m[("llama_guard_build_info", (("version", __version__),))] == 1
    # Not ready: no slot figures (no server to read), the slot files counted (none yet).
    assert slots(m) == (None, None) and held(m, "server") is None and held(m, "slot_files") == 0
    go.touch()
    run.wait_event("server_ready", 90)
    m = read_slots(metrics_port)
    # The serving build, as the real llama-server's --version names it ("0.6.0-dev (build 0, commit unknown)").
    (build,) = [dict(k[1]) for k in m if k[0] == "llama_guard_server_build_info"]
    version = subprocess.run([str(llama_server_bin), "--version"], capture_output=True, text=True, timeout=60)
    assert build["release"] == release_of(version.stdout + version.stderr)
    assert build["commit"] == commit_of(version.stdout + version.stderr)
    assert build["binary"] == str(held_back)
    assert slots(m) == (0, 2)
    assert held(m, "server") == 0 and held(m, "slot_files") == 0

    # A conversation: its slot then holds its KV cache, and the rolling save puts it in a slot file.
    base = f"http://127.0.0.1:{run.port}"  # type: ignore[attr-defined]
    answer = httpx.post(f"{base}/completion", json={"prompt": "The capital of France is", "n_predict": 4},
                        timeout=120)
    assert answer.status_code == 200
    assert held(read_slots(metrics_port), "server") == 1
    run.wait_event("slot_saved", 60)
    m = read_slots(metrics_port)
    assert held(m, "slot_files") == 1 and slots(m) == (0, 2)

    # A long generation in flight: its slot is busy while the scrape reads the server.
    streaming = threading.Event()
    stop = threading.Event()

    def stream() -> None:
        body = {"prompt": "Count from one to one thousand:", "n_predict": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/completion", json=body, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and "content" in json.loads(line[6:]):
                    streaming.set()
                if stop.is_set():
                    return

    worker = threading.Thread(target=stream, daemon=True)
    worker.start()
    assert streaming.wait(120), "the stream sent no token"
    m = read_slots(metrics_port)
    stop.set()
    worker.join(300)
    assert slots(m) == (1, 1)
    assert held(m, "server") == 2  # the first conversation's slot and the one generating

