"""Usage sampling and hysteresis: pure tracker, server lines, and real child processes."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_guard.config import Config
from llama_guard.config.sections import LimitsConfig
from llama_guard.limits import own as LO
from llama_guard.limits import plan as LP
from llama_guard.limits import readback as LR
from llama_guard.limits import rlimits as L
from llama_guard.limits.usage import (
    PIDS_MAX,
    UsageEvent,
    UsageSample,
    UsageSampler,
    UsageTracker,
    sample_cost_per_hour,
)
from llama_guard.vocab.events import CATALOG, render_message


def _s(fds: int, *, pid: int = 100, limit: int = 100, threads: int = 5, nproc: int | None = None,
       pids: tuple[int, int] | None = None) -> UsageSample:
    return UsageSample(pid=pid, fds=fds, threads=threads, connections=3, nofile_limit=limit,
                       nproc_limit=nproc, pids_current=pids[0] if pids else None,
                       pids_max=pids[1] if pids else None)


def _names(events: list[UsageEvent]) -> list[str]:
    return [e.name for e in events]


def _tracker() -> UsageTracker:
    return UsageTracker(warn_fraction=0.8, rearm_fraction=0.7, reminder_s=600.0)


# --------------------------------------------------------------------------- hysteresis


def test_limit_low_fires_once_then_rearms_only_below_the_lower_mark() -> None:
    t = _tracker()
    assert t.update(_s(50), 0) == []
    assert t.update(_s(79), 1) == []
    (ev,) = t.update(_s(80), 2)
    assert ev.name == "limit_low"
    assert ev.fields["limit"] == "RLIMIT_NOFILE"
    assert ev.fields["used"] == 80
    assert ev.fields["limit_value"] == 100
    assert ev.fields["server_pid"] == 100
    assert ev.fields["reminder"] is False
    assert "LimitNOFILE=" in ev.fields["fix"]
    assert t.update(_s(90), 3) == []          # still high: no repeat
    assert t.update(_s(75), 4) == []          # between the marks: still armed-off
    assert t.update(_s(85), 5) == []          # back up: no new warning, it never re-armed
    (ok,) = t.update(_s(69), 6)               # below the lower mark: re-armed
    assert ok.name == "limit_ok"
    assert ok.fields["since_s"] == 4
    assert _names(t.update(_s(81), 7)) == ["limit_low"]


def test_flapping_around_the_warn_mark_is_quiet() -> None:
    t = _tracker()
    events = []
    for i, fds in enumerate([81, 79, 81, 79, 80, 78, 82, 71, 80]):
        events += t.update(_s(fds), i)
    assert _names(events) == ["limit_low"]


def test_slow_reminder_while_it_lasts() -> None:
    t = _tracker()
    assert _names(t.update(_s(85), 0)) == ["limit_low"]
    assert t.update(_s(85), 599) == []
    (rem,) = t.update(_s(86), 600)
    assert rem.fields["reminder"] is True
    assert rem.fields["since_s"] == 600
    assert t.update(_s(86), 1000) == []
    assert _names(t.update(_s(86), 1200)) == ["limit_low"]


def test_exhausted_when_the_limit_is_hit() -> None:
    t = _tracker()
    assert _names(t.update(_s(85), 0)) == ["limit_low"]
    (ex,) = t.update(_s(100), 1)
    assert ex.name == "resource_exhausted"
    assert ex.fields["limit"] == "RLIMIT_NOFILE"
    assert ex.fields["source"] == "sample"
    assert "EMFILE" in ex.fields["reason"]
    assert "LimitNOFILE=65536" in ex.fields["fix"]
    assert t.update(_s(100), 2) == []          # once per episode
    assert t.update(_s(90), 3) == []
    assert t.update(_s(100), 4) == []          # not re-armed yet
    assert _names(t.update(_s(10), 5)) == ["limit_ok"]
    assert _names(t.update(_s(100), 6)) == ["resource_exhausted"]
    assert _names(t.update(_s(100), 606)) == ["resource_exhausted"]  # the slow reminder
    assert t.update(_s(100), 607) == []


def test_jump_straight_to_the_limit_is_one_event() -> None:
    t = _tracker()
    assert _names(t.update(_s(100), 0)) == ["resource_exhausted"]
    assert t.update(_s(85), 1) == []


def test_threads_and_cgroup_pids_are_tracked() -> None:
    t = _tracker()
    ev = t.update(_s(1, threads=45, nproc=50, pids=(10, 1000)), 0)
    assert [(e.name, e.fields["limit"]) for e in ev] == [("limit_low", "RLIMIT_NPROC")]
    ev = t.update(_s(1, threads=45, nproc=50, pids=(1000, 1000)), 1)
    assert [(e.name, e.fields["limit"]) for e in ev] == [("resource_exhausted", PIDS_MAX)]
    assert "TasksMax=" in ev[0].fields["fix"]


def test_unlimited_or_unknown_is_never_low() -> None:
    t = _tracker()
    assert t.update(_s(10**6, limit=L.RLIM_INFINITY), 0) == []
    assert t.update(UsageSample(pid=100, fds=None, threads=None, nofile_limit=100), 1) == []


def test_a_new_pid_resets_the_state() -> None:
    t = _tracker()
    assert _names(t.update(_s(90, pid=1), 0)) == ["limit_low"]
    assert _names(t.update(_s(90, pid=2), 1)) == ["limit_low"]


def test_tracker_from_config_and_bad_marks() -> None:
    t = UsageTracker.from_config(LimitsConfig(warn_fraction=0.9, reminder_interval_s=60))
    assert t.rearm_fraction == pytest.approx(0.8)
    assert t.reminder_s == 60
    with pytest.raises(ValueError, match="rearm_fraction"):
        UsageTracker(warn_fraction=0.5, rearm_fraction=0.6)


def test_events_are_in_the_catalogue_and_render() -> None:
    t = _tracker()
    events = t.update(_s(85), 0) + t.update(_s(100), 1) + t.update(_s(1), 2)
    assert _names(events) == ["limit_low", "resource_exhausted", "limit_ok"]
    for ev in events:
        assert ev.name in CATALOG
        text = render_message(ev.name, ev.fields)
        assert "RLIMIT_NOFILE" in text
        assert "?" not in text, text
    assert render_message("limit_low", events[0].fields) == "RLIMIT_NOFILE use 85 of 100 (85%)"


# --------------------------------------------------------------------------- real processes

FD_CHILD = textwrap.dedent("""
    import sys
    held = []
    for line in sys.stdin:
        target = int(line)
        try:
            while len(held) < target:
                held.append(open("/dev/null"))
            print("ok", len(held), flush=True)
        except OSError as exc:
            print("EMFILE" if exc.errno == 24 else f"ERR {exc.errno}", len(held), flush=True)
""")


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_real_fd_use_warns_before_exhaustion(children: list[subprocess.Popen[str]]) -> None:
    """A child under RLIMIT_NOFILE = 64 opens files step by step: limit_low fires while it can
    still open more; resource_exhausted when it is at the limit."""
    plan = LP.plan_child_limits(Config(limits=LimitsConfig(nofile=64)), LO.read_own_limits(),
                               LO.can_raise_hard_limits())
    proc = subprocess.Popen([sys.executable, "-c", FD_CHILD], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
    children.append(proc)
    for res, pair in plan.settings:  # the child opens nothing before it reads its first line
        resource.prlimit(proc.pid, res, pair)
    assert proc.stdin is not None
    assert proc.stdout is not None
    sampler = UsageSampler(proc.pid)
    assert sampler.limits.soft("RLIMIT_NOFILE") == 64
    tracker = UsageTracker(warn_fraction=0.8, rearm_fraction=0.7)
    history: list[tuple[int, str, list[str]]] = []
    for step, target in enumerate(range(10, 80, 5)):
        proc.stdin.write(f"{target}\n")
        proc.stdin.flush()
        reply = proc.stdout.readline().split()[0]
        sample = sampler.sample()
        history.append((sample.fds or -1, reply, _names(tracker.update(sample, float(step)))))
        if reply == "EMFILE":
            break
    warned = [i for i, (_, _, ev) in enumerate(history) if "limit_low" in ev]
    exhausted = [i for i, (_, _, ev) in enumerate(history) if "resource_exhausted" in ev]
    first_emfile = next(i for i, (_, reply, _) in enumerate(history) if reply == "EMFILE")
    assert warned, history
    assert exhausted, history
    assert warned[0] < first_emfile, history        # warned while the child could still open files
    assert history[warned[0]][0] >= 0.8 * 64, history
    assert exhausted[0] == first_emfile, history
    assert history[first_emfile][0] == 64, history


THREAD_CHILD = textwrap.dedent("""
    import socket, threading, time
    stop = threading.Event()
    for _ in range(10):
        threading.Thread(target=stop.wait, daemon=True).start()
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(8)
    clients = [socket.create_connection(srv.getsockname()) for _ in range(3)]
    accepted = [srv.accept()[0] for _ in range(3)]
    print("ready", flush=True)
    time.sleep(60)
""")


def test_sampler_counts_threads_and_connections(children: list[subprocess.Popen[str]]) -> None:
    proc = subprocess.Popen([sys.executable, "-c", THREAD_CHILD], stdout=subprocess.PIPE, text=True)
    children.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    sample = UsageSampler(proc.pid).sample()
    assert sample.threads == 11
    assert sample.connections == 7  # 1 listening + 3 client + 3 accepted
    assert sample.fds is not None
    assert sample.fds >= 10
    fd_count = len(os.listdir(f"/proc/{proc.pid}/fd"))
    assert sample.fds == fd_count
    assert sample.nofile_limit == LR.read_limits(proc.pid).soft("RLIMIT_NOFILE")


def test_sampler_of_a_process_that_died(children: list[subprocess.Popen[str]]) -> None:
    proc = subprocess.Popen(["sleep", "30"], text=True)
    children.append(proc)
    sampler = UsageSampler(proc.pid, connections=False)
    proc.kill()
    proc.wait()
    sample = sampler.sample()
    assert sample.fds is None
    assert sample.threads is None
    assert _tracker().update(sample, 0) == []
    with pytest.raises(ProcessLookupError):
        UsageSampler(proc.pid)


def test_sample_is_cheap_enough(children: list[subprocess.Popen[str]]) -> None:
    """A loose guard (benchmarks/bench_usage_sample.py measures): one sample of a small child well
    under 20 ms, even on a loaded machine."""
    proc = subprocess.Popen(["sleep", "30"], text=True)
    children.append(proc)
    sampler = UsageSampler(proc.pid)
    costs = []
    for _ in range(50):
        start = time.perf_counter()
        sampler.sample()
        costs.append(time.perf_counter() - start)
    costs.sort()
    assert costs[len(costs) // 2] < 0.02
    assert sample_cost_per_hour(costs[len(costs) // 2], 10.0) < 2.0
    with pytest.raises(ValueError, match="interval_s"):
        sample_cost_per_hour(0.001, 0)


def test_proc_fd_dir_matches_num_fds_of_self() -> None:
    sampler = UsageSampler(os.getpid(), connections=False)
    sample = sampler.sample()
    assert sample.fds is not None
    assert abs(sample.fds - len(os.listdir("/proc/self/fd"))) <= 1  # listdir holds one fd itself
    assert Path(f"/proc/{os.getpid()}/limits").exists()


def test_connections_are_counted_every_nth_sample(children: list[subprocess.Popen[str]]) -> None:
    proc = subprocess.Popen([sys.executable, "-c", THREAD_CHILD], stdout=subprocess.PIPE, text=True)
    children.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    sampler = UsageSampler(proc.pid, connections_every=3)
    counts = [sampler.sample().connections for _ in range(4)]
    assert counts == [7, 7, 7, 7]
    assert UsageSampler(proc.pid, connections=False).sample().connections is None
    with pytest.raises(ValueError, match="connections_every"):
        UsageSampler(proc.pid, connections_every=0)
