"""Restart time: ``restart_to_ready_s`` on ``server_ready`` and ``restart_first_token`` from the pure
policy, their histograms and ``status`` row, the readiness poll's wake-up line, and the model file
in the page cache before a planned restart (a real file, the real kernel's page cache)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from harness import emitted, names
from harness import ready as policy_ready
from llama_guard.config import Config
from llama_guard.core.probes import sleep_or_wake
from llama_guard.core.server import SERVING_LINE
from llama_guard.exporter.metrics import MetricsSource
from llama_guard.model.inputs import Drained, Exited, FirstToken, HealthOk, RestartRequest, Spawned, Tick
from llama_guard.model.policy import decide
from llama_guard.model.types import Params, Phase, State
from llama_guard.model.watcher import Context
from llama_guard.restarts.page_cache import cached_bytes, mem_available_bytes, warm
from llama_guard.status.status_view import render
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

P = Params(load_timeout_s=30, backoff_initial_s=1, backoff_factor=2, backoff_max_s=5, max_restarts=3,
           restart_window_s=100, stable_after_s=10, stop_grace_s=4, kill_wait_s=2, drain_timeout_s=20)


def _next_server(s: State, pid: int, now: float) -> State:
    """From a pending start (BACKOFF or STARTING) to server ``pid`` spawned at ``now``."""
    if s.phase is Phase.BACKOFF:
        s, _ = decide(s, Tick(), max(now, s.deadline or now))
    assert s.phase is Phase.STARTING, s.phase
    s, _ = decide(s, Spawned(pid, ("llama-server",)), now)
    return s


def test_first_start_has_no_restart_time() -> None:
    s = policy_ready(P, 100, 2.0)
    assert s.restart_at is None


def test_crash_restart_is_timed_from_the_exit_to_ready_and_to_the_first_token() -> None:
    s = policy_ready(P, 100, 1.0)
    s, _ = decide(replace_stable(s), Exited(100, -9), 50.0)
    assert s.restart_at == 50.0
    s = _next_server(s, 101, 50.1)
    s, acts = decide(s, HealthOk(101), 51.25)
    assert emitted(acts, "server_ready").fields["restart_to_ready_s"] == pytest.approx(1.25)
    s, acts = decide(s, FirstToken(101), 51.5)
    assert emitted(acts, "restart_first_token").fields == {"server_pid": 101, "restart_to_first_token_s": 1.5}
    s, acts = decide(s, FirstToken(101), 52.0)  # once per restart
    assert acts == [] and s.restart_at is None


def test_planned_restart_is_timed_from_the_stop_not_the_drain() -> None:
    s = policy_ready(P, 100, 1.0)
    s, _ = decide(s, RestartRequest("SIGUSR1"), 20.0)
    assert s.phase is Phase.DRAINING and s.restart_at is None  # still serving while it drains
    s, _ = decide(s, Drained(100), 23.0)
    assert s.phase is Phase.STOPPING and s.restart_at == 23.0
    s, _ = decide(s, Exited(100, 0), 23.2)
    s = _next_server(s, 101, 23.3)
    _, acts = decide(s, HealthOk(101), 24.0)
    assert emitted(acts, "server_ready").fields["restart_to_ready_s"] == pytest.approx(1.0)


def test_first_token_of_another_pid_is_ignored() -> None:
    s = policy_ready(P, 100, 1.0)
    s, _ = decide(replace_stable(s), Exited(100, -9), 50.0)
    s = _next_server(s, 101, 50.1)
    s, _ = decide(s, HealthOk(101), 51.0)
    s, acts = decide(s, FirstToken(100), 51.5)
    assert "restart_first_token" not in names(acts) and s.restart_at == 50.0


def replace_stable(s: State) -> State:
    """``s`` after it served long enough to count as stable (a crash then restarts at once)."""
    s, _ = decide(s, Tick(), (s.ready_at or 0.0) + P.stable_after_s)
    assert s.stable
    return s


def test_serving_line_matches_both_formats_and_nothing_else() -> None:
    for text in ("0.00.454.437 I srv  llama_server: model loaded",
                 "0.00.454.465 I srv  llama_server: listening on http://127.0.0.1:18080",
                 "main: server is listening on http://127.0.0.1:8080 - starting the main loop",
                 "[1234] main: model loaded"):
        assert SERVING_LINE.search(text), text
    for text in ("0.00.009.960 I srv    load_model: loading model 'x.gguf'",
                 "llama_model_loader: loaded meta data with 33 key-value pairs"):
        assert not SERVING_LINE.search(text), text


def _metrics() -> tuple[MetricsSource, Context]:
    cfg = Config.model_validate({})
    ctx = Context(get_config=lambda: cfg, emit=lambda *a, **k: None,
                  post=lambda i: None, post_threadsafe=lambda i: None, clock=time.monotonic,
                  loop=asyncio.new_event_loop())
    return MetricsSource(serve=False), ctx


def test_histograms_and_status_row_follow_the_events() -> None:
    src, ctx = _metrics()
    try:
        assert ctx.loop.run_until_complete(src.start(ctx)) is None
        src.write({"event": "server_ready", "server_pid": 1, "load_s": 3.0})  # the first start: no figure
        for ready_s, token_s in ((0.4, 0.6), (7.0, None)):
            src.write({"event": "server_ready", "server_pid": 2, "load_s": 0.3, "restart_to_ready_s": ready_s})
            if token_s is not None:
                src.write({"event": "restart_first_token", "server_pid": 2, "restart_to_first_token_s": token_s})
        samples = {(s.name, s.labels.get("le")): s.value for fam in text_string_to_metric_families(
            generate_latest(src.registry).decode()) for s in fam.samples}
        assert samples[("llama_guard_restart_to_ready_seconds_count", None)] == 2
        assert samples[("llama_guard_restart_to_ready_seconds_sum", None)] == pytest.approx(7.4)
        assert samples[("llama_guard_restart_to_ready_seconds_bucket", "0.5")] == 1
        assert samples[("llama_guard_restart_to_ready_seconds_bucket", "10.0")] == 2
        assert samples[("llama_guard_restart_to_first_token_seconds_bucket", "1.0")] == 1
        assert samples[("llama_guard_restart_to_first_token_seconds_bucket", "+Inf")] == 1
        snap = src.snapshot()
        assert snap is not None
        # The last restart had no held request: no first-token figure of an earlier restart is shown.
        assert snap["last_restart"] == {"restart_to_ready_s": 7.0, "restart_to_first_token_s": None}
        rows = render({"metrics": {"last_restart": {"restart_to_ready_s": 0.4, "restart_to_first_token_s": 0.6}}})
        assert any("last restart" in r and "ready 0.40 s after it began" in r
                   and "first token to a held request 0.60 s" in r for r in rows), rows
    finally:
        ctx.loop.close()


def _model_file(tmp_path: Path, mib: int = 8) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + os.urandom(mib * 2**20 - 4))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages: DONTNEED can drop them
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


def _cached(path: Path) -> int | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_bytes(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def test_warm_reads_an_evicted_model_back_into_the_page_cache(tmp_path: Path) -> None:
    path = _model_file(tmp_path)
    size = path.stat().st_size
    before = _cached(path)
    if before == size:
        pytest.skip("this filesystem keeps the file in memory whatever DONTNEED says (tmpfs)")
    warmth = warm(path)
    assert warmth.size_bytes == size and warmth.fits and warmth.read_ahead
    assert warmth.cached_bytes is not None and warmth.cached_bytes < size
    deadline = time.monotonic() + 60.0
    while _cached(path) != size and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _cached(path) == size
    again = warm(path)
    assert again.cached_bytes == size and not again.read_ahead  # nothing left to read


def test_warm_reads_nothing_when_the_host_ram_cannot_hold_the_model(tmp_path: Path) -> None:
    path = _model_file(tmp_path)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1024 kB\nMemFree:         512 kB\nMemAvailable:    1024 kB\n")
    assert mem_available_bytes(meminfo) == 1024 * 1024
    warmth = warm(path, meminfo)
    assert not warmth.fits and not warmth.read_ahead
    fields = warmth.fields(path)
    assert fields["model"] == str(path) and fields["model_mib"] == pytest.approx(8.0)
    assert fields["available_mib"] == pytest.approx(1.0)
    assert mem_available_bytes(tmp_path / "absent") is None


async def test_sleep_or_wake_returns_when_woken_and_clears_the_wake() -> None:
    wake = asyncio.Event()
    waiting = asyncio.ensure_future(sleep_or_wake(600.0, wake))  # the readiness poll / drain pause
    await asyncio.sleep(0)
    assert not waiting.done()
    wake.set()  # the server's "listening on" / "stop processing" line
    await asyncio.wait_for(waiting, 30.0)
    assert not wake.is_set()  # the next wait waits again
