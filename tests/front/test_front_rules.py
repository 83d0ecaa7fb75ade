"""The front door's own rules, in process: the gate and holding queue, the traffic rules of the policy,
the hop-by-hop filter, the SSE error ending, /livez from another thread, the [front] config checks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from llama_guard.config import ConfigError, load_config
from llama_guard.front.admission import Admission, Episode, FailReason, Gate, Refused, gate_of
from llama_guard.front.headers import REQUEST_DROP, end_to_end
from llama_guard.front.sse import error_event, is_sse
from llama_guard.model.actions import Emit, Terminate
from llama_guard.model.inputs import Probe, RequestCompleted, StreamStalled, UpstreamError
from llama_guard.model.policy import decide
from llama_guard.model.types import AfterStop, Params, State
from llama_guard.status.health import liveness, readiness
from llama_guard.vocab.phases import Phase
from multidict import CIMultiDict, CIMultiDictProxy

READY = State(params=Params(hang_strikes=3), phase=Phase.READY, pid=42, ready_at=0.0)


async def hold(admission: Admission, seq: int, hold_s: float, max_held: int = 10,
               clock: Callable[[], float] = time.monotonic) -> tuple[int, float]:
    """``admission.admit`` for a request that arrives now (by ``clock``)."""
    now = clock()
    return await admission.admit(seq, arrived=now, since=now, hold_s=hold_s, max_held=max_held)


def test_gate_follows_the_policy_phase() -> None:
    assert gate_of(READY) is Gate.OPEN
    for phase in (Phase.STARTING, Phase.STOPPING, Phase.BACKOFF, Phase.DRAINING, Phase.RESETTING,
                  Phase.WAITING_VRAM, Phase.STOPPED):
        assert gate_of(replace(READY, phase=phase)) is Gate.HOLD, phase
    assert gate_of(replace(READY, phase=Phase.EXITED)) is Gate.CLOSED
    for phase in (Phase.STOPPING, Phase.DRAINING, Phase.RESETTING):  # a pending exit: 503 at once
        assert gate_of(replace(READY, phase=phase, after_stop=AfterStop.EXIT)) is Gate.CLOSED, phase


class Clock:
    """The daemon's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Let the loop run until ``condition()`` holds (bounded: fails after ``timeout_s`` seconds)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0)


async def test_held_requests_are_released_in_arrival_order() -> None:
    episodes: list[Episode] = []
    clock = Clock()
    admission = Admission(clock, episodes.append)
    admission.update(replace(READY, phase=Phase.BACKOFF))
    order: list[int] = []

    async def one(seq: int) -> None:
        pid, held_s = await hold(admission, seq, 10, clock=clock)
        assert (pid, held_s) == (7, 2.5)
        order.append(seq)

    tasks = [asyncio.create_task(one(seq)) for seq in (5, 2, 9, 3)]
    await until(lambda: admission.waiting == 4)
    clock.now += 1.0
    admission.update(replace(READY, phase=Phase.STARTING))
    clock.now += 1.5
    admission.update(replace(READY, pid=7))
    await asyncio.gather(*tasks)
    assert order == [2, 3, 5, 9]
    [episode] = episodes
    assert episode.fields()["phase"] == "backoff, starting"
    assert (episode.held, episode.forwarded, episode.failed, episode.longest_s) == (4, 4, 0, 2.5)
    assert await hold(admission, 10, 0, max_held=1, clock=clock) == (7, 0.0)  # open: no wait at all


async def test_holding_is_bounded_by_max_held_and_the_deadline() -> None:
    admission = Admission(time.monotonic, lambda e: None)
    waiter = asyncio.create_task(hold(admission, 1, 0.2, max_held=1))
    await until(lambda: admission.waiting == 1)
    with pytest.raises(Refused) as full:
        await hold(admission, 2, 10, max_held=1)
    assert full.value.reason is FailReason.QUEUE_FULL
    with pytest.raises(Refused) as late:
        await waiter
    assert late.value.reason is FailReason.HOLD_TIMEOUT  # its deadline ended the hold, not the queue
    assert admission.waiting == 0


async def test_a_verdict_ending_the_daemon_refuses_held_and_new_requests_at_once() -> None:
    episodes: list[Episode] = []
    admission = Admission(time.monotonic, episodes.append)
    waiters = [asyncio.create_task(hold(admission, i, 60)) for i in range(3)]
    await until(lambda: admission.waiting == 3)
    admission.update(replace(READY, phase=Phase.EXITED))
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, Refused) and r.reason is FailReason.DAEMON_EXITING for r in results)
    with pytest.raises(Refused):
        await hold(admission, 9, 60)
    assert episodes[0].failed == 3


def test_a_completed_request_is_progress_and_skips_the_next_canary() -> None:
    state = replace(READY, strikes=2, stalls=1, http_errors=3)
    new, actions = decide(state, RequestCompleted(42), 100.0)
    assert (new.strikes, new.stalls, new.http_errors, new.last_request_at) == (0, 0, 0, 100.0) and not actions
    assert new.request_completed_since(99.0) and not new.request_completed_since(100.5)
    assert decide(state, RequestCompleted(41), 100.0)[0] == state  # another server's


def test_stalled_streams_without_progress_are_a_hang() -> None:
    state = READY
    for n in (1, 2):
        state, actions = decide(state, StreamStalled(42, 120.0), float(n))
        assert state.phase is Phase.READY and state.stalls == n
        assert [a.name for a in actions if isinstance(a, Emit)] == ["server_stream_stalled"]
    state, actions = decide(state, StreamStalled(42, 120.0), 3.0)
    assert state.phase is Phase.STOPPING and state.after_stop is AfterStop.FAILURE
    assert [a.name for a in actions if isinstance(a, Emit)] == ["server_stream_stalled", "server_hang"]
    assert Terminate(42) in actions


def test_token_progress_or_a_completion_clears_the_stalls() -> None:
    state, _ = decide(READY, StreamStalled(42, 120.0), 1.0)
    state, _ = decide(state, StreamStalled(42, 120.0), 2.0)
    cpu_only = Probe(42, True, True, busy=True, progressed=False, cpu_s=5.0)
    assert decide(state, cpu_only, 3.0)[0].stalls == 2  # a spinning CPU is no decode progress
    moved = Probe(42, True, True, busy=True, progressed=True)
    assert decide(state, moved, 3.0)[0].stalls == 0
    assert decide(state, RequestCompleted(42), 3.0)[0].stalls == 0


def test_5xx_answers_are_reported_once_and_never_restart() -> None:
    state = replace(READY, params=replace(READY.params, canary=False))  # no confirming round (test_policy_error_run)
    names: list[str] = []
    for i in range(2 * state.params.hold_after_errors):
        state, actions = decide(state, UpstreamError(42, 500), float(i))
        names += [a.name for a in actions if isinstance(a, Emit)]
        assert state.phase is Phase.READY
    assert names == ["server_http_errors"]


def test_hop_by_hop_headers_are_dropped_the_rest_untouched() -> None:
    raw = CIMultiDict([("Authorization", "Bearer k"), ("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"),
                       ("Keep-Alive", "timeout=5"), ("Content-Length", "12"), ("Expect", "100-continue"),
                       ("X-Custom", "a"), ("X-Custom", "b"), ("Transfer-Encoding", "chunked")])
    out = end_to_end(CIMultiDictProxy(raw), REQUEST_DROP)
    assert list(out.items()) == [("Authorization", "Bearer k"), ("X-Custom", "a"), ("X-Custom", "b")]


def test_the_sse_error_event_is_well_formed() -> None:
    assert is_sse("text/event-stream; charset=utf-8") and not is_sse("application/json")
    raw = error_event("cut", 502).decode()
    assert raw.startswith("\n\n") and raw.endswith("\n\n")
    lines = raw.strip("\n").split("\n")
    assert lines[0] == "event: error" and lines[1].startswith("data: ") and len(lines) == 2
    assert json.loads(lines[1][6:]) == {"type": "error", "error": {
        "code": 502, "message": "llama-guard front door: cut", "type": "server_error"}}


def test_readyz_answers_503_unless_the_server_is_ready() -> None:
    assert readiness(READY, 0.0)[0] == 200 and readiness(READY, 0.0)[1]["ready"] is True
    assert readiness(replace(READY, phase=Phase.DRAINING), 0.0)[0] == 503
    assert liveness(replace(READY, phase=Phase.EXITED)) == (503, {"live": False, "phase": "exited"})


def test_a_front_port_equal_to_the_server_port_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 8080\n[front]\nlisten = "0.0.0.0:8080"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "front.listen" in err.value.lines[0] and "[server].port" in err.value.lines[0]
    path.write_text('[server]\nport = 8081\n[front]\nlisten = "0.0.0.0:8080"\n')
    assert load_config(path).front.address == ("0.0.0.0", 8080)
    path.write_text('[front]\nlisten = "nope:port"\n')
    with pytest.raises(ConfigError):
        load_config(path)


def test_check_names_both_addresses_and_refuses_a_shared_port(tmp_path: Path) -> None:
    import subprocess
    import sys

    from llama_guard.front.check import check_front
    from llama_guard.vocab.verdicts import Verdict

    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 18551\n[front]\nlisten = "127.0.0.1:18550"\n')
    line = check_front(load_config(path))
    assert line.verdict is Verdict.OK
    assert line.detail == "clients connect to 127.0.0.1:18550; llama-server listens privately on 127.0.0.1:18551"
    path.write_text('[server]\nport = 18551\nhost = "0.0.0.0"\n[front]\nlisten = "127.0.0.1:18550"\n')
    assert check_front(load_config(path)).verdict is Verdict.WARN  # clients could go around it
    path.write_text('[server]\nport = 18550\n[front]\nlisten = "127.0.0.1:18550"\n')
    done = subprocess.run([sys.executable, "-m", "llama_guard", "check", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78 and "front.listen" in done.stderr


@pytest.mark.parametrize("text", [
    '[server]\nport = 18561\n[metrics]\nlisten = "127.0.0.1:18561"\n',
    '[server]\nport = 18561\n[front]\nlisten = "127.0.0.1:18562"\n[metrics]\nlisten = "0.0.0.0:18562"\n',
    '[server]\nport = 18561\n[front]\nlisten = "127.0.0.1:18561"\n[metrics]\nlisten = "18561"\n',
])
def test_listeners_on_one_port_fail_check_and_run_at_once(tmp_path: Path, text: str) -> None:
    import subprocess
    import sys

    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "port" in err.value.lines[0] and "listen" in err.value.lines[0]
    for verb in ("check", "run"):
        done = subprocess.run([sys.executable, "-m", "llama_guard", verb, "--config", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 78, (verb, done.stdout, done.stderr)
        assert err.value.lines[0] in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("section", ["front", "metrics"])
def test_check_says_fail_for_a_listen_host_that_does_not_resolve(tmp_path: Path, section: str) -> None:
    import subprocess
    import sys

    path = tmp_path / "c.toml"
    path.write_text(f'[server]\nport = 18563\n[{section}]\nlisten = "no-such-host.invalid:18564"\n')
    done = subprocess.run([sys.executable, "-m", "llama_guard", "check", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stdout + done.stderr
    fail = [line for line in done.stdout.splitlines()
            if line.startswith("FAIL") and f"[{section}].listen" in line]
    assert len(fail) == 1 and "'no-such-host.invalid' does not resolve" in fail[0], done.stdout
    assert done.returncode != 0


def test_client_connections_leave_file_descriptors_for_the_daemon() -> None:
    import resource

    from llama_guard.front.app import FD_RESERVE, effective_max_connections

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        assert effective_max_connections(16384) == 1024 - FD_RESERVE
        assert effective_max_connections(100) == 100
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_status_shows_the_front_door() -> None:
    from llama_guard.status.status_view import render

    doc = {"daemon_pid": 1, "phase": "backoff", "ready": False, "base_url": "http://127.0.0.1:8081",
           "front": {"listen": "127.0.0.1:8080", "waiting": 3, "in_flight": 0, "connections": 5}}
    lines = render(doc, clock=lambda: 0.0)
    assert any("front door" in line and "http://127.0.0.1:8080 (clients): 3 held, 0 in flight, 5 connections" in line
               for line in lines)


def test_an_ipv6_front_address_is_written_bracketed_and_a_bare_host_is_named(tmp_path: Path) -> None:
    from llama_guard.config.listen import parse_listen
    from llama_guard.front.check import check_front

    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 18551\n[front]\nlisten = "[::1]:18552"\n')
    assert check_front(load_config(path)).detail.startswith("clients connect to [::1]:18552;")
    with pytest.raises(ValueError, match=r"'localhost': expected PORT, HOST:PORT or \[IPv6\]:PORT"):
        parse_listen("localhost")


def test_a_reload_may_not_put_llama_server_on_a_port_the_daemon_listens_on(tmp_path: Path) -> None:
    from llama_guard.core.reload import port_clash

    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 18560\n[front]\nlisten = ""\n')
    config = load_config(path)
    assert "18560 is where this llama-guard listens (0.0.0.0:18560)" in port_clash(config, [None, ("0.0.0.0", 18560)])
    assert port_clash(config, [("127.0.0.1", 18561), None]) == ""


def test_check_says_which_listener_answers_livez_and_readyz_when_metrics_is_off() -> None:
    """``[metrics].listen`` off: with the front door on, ``check`` no longer says /livez and /readyz need
    ``[metrics]`` — the front door answers them (before: a newcomer was told to set it for them)."""
    from llama_guard.config import Config
    from llama_guard.front.check import check_metrics
    from llama_guard.vocab.verdicts import Verdict

    front = check_metrics(Config.model_validate({"front": {"listen": "127.0.0.1:18080"}}))
    assert front.verdict is Verdict.NOTE
    assert front.detail == "off (set [metrics].listen for /metrics; the front door answers /livez and /readyz)"
    bare = check_metrics(Config.model_validate({}))
    assert bare.detail == "off (set [metrics].listen for /metrics, /livez and /readyz)"
