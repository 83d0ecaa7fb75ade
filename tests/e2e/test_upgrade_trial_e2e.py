"""The trial of a new llama-server build in its drained window, with the real llama-server: a serving
daemon pointed (reload) at a build that decodes clearly slower ends up serving on the last good build
with the cause and both figures named; a good new build (the same llama-server copied elsewhere) is
kept with both figures in its event; a client loop through the front door sees no failed request.

The slow build is slow by design, whatever the host's speed: the real llama-server, same flags, under a
CPU quota once it answers ``/health`` — it runs 10 ms in every 200 ms (SIGSTOP/SIGCONT, cpulimit's
method), so it decodes at most about a twentieth as fast as the same binary unthrottled at that moment.
Fewer threads alone is no slow build on this shared 2-core host: measured with ``bench``'s method,
``--threads 1`` decoded 8.5 tokens/s while ``--threads 2`` decoded 0.35 to 2.8 (its threads' barrier
spins against the other work on the host). So both daemons here run ``--threads 1``; one build
measured twice that way still differed by 1.3 % to 56 % here as the other work came and went (at most
36 % slower the second time: benchmarks/bench_upgrade.py), and the slow build measured 89-93 % slower.
The limit of these tests (75 %) lies between the two.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from harness import ROOT, free_port
from test_upgrade_e2e import ClientLoop, copy_build, reload_with, serving, started_binaries, status_when

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

HOLD_S = 600.0  # the front door holds clients through both measurements and the roll-back
TRIAL = {"probation_s": 1.0, "trial_runs": 1, "trial_tokens": 8, "max_slowdown_pct": 75.0,
         "trial_timeout_s": 300.0}


def throttled(path: Path, real: Path) -> Path:
    """The real build, slower by design: a CPU quota of 10 ms in 200 ms from the moment it answers
    ``/health`` (its load is not slowed: the daemon's load bounds stay as they are)."""
    path.write_text(f"""#!/bin/bash
case "$*" in *--version*|*--help*) exec "{real}" "$@";; esac
port=$(printf '%s\\n' "$*" | sed -n 's/.*--port \\([0-9]*\\).*/\\1/p')
"{real}" "$@" &
child=$!
trap 'kill -CONT $child; kill -TERM $child; wait $child; exit $?' TERM INT
healthy() {{ exec 3<>/dev/tcp/127.0.0.1/$port || return 1; printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3
            read -r status <&3; exec 3<&-; case "$status" in *" 200 "*) return 0;; esac; return 1; }}
until healthy 2>/dev/null; do kill -0 $child 2>/dev/null || break; sleep 0.1; done
exec {{nap}}<> <(:)  # read -t on a pipe nobody writes: a sleep without a process per pause
while kill -0 $child 2>/dev/null; do
  kill -STOP $child; read -rt 0.19 -u $nap; kill -CONT $child; read -rt 0.01 -u $nap
done
wait $child
""")
    path.chmod(0o755)
    return path


def test_a_build_that_decodes_clearly_slower_is_rolled_back_to_the_last_good_one(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    slow = throttled(tmp_path / "llama-server-slow", llama_server_bin)
    with serving(tmp_path, llama_server_bin, real_model, upgrade=TRIAL, front={"hold_timeout_s": HOLD_S},
                 server={"threads": 1}) as run, ClientLoop(run.front, HOLD_S + 60) as clients:
        reload_with(run, slow)
        run.wait_event("upgrade_preflight_passed", 120)
        back = run.wait_event("upgrade_rolled_back", 600)
        assert back["from_binary"] == str(slow) and back["to_binary"] == str(llama_server_bin), back
        assert back["cause"].startswith("slower: ") and "limit 75 %" in back["cause"], back
        assert back["tokens_per_s"] < back["previous_tokens_per_s"] / 4, back
        assert back["slowdown_pct"] > 75 and back["max_slowdown_pct"] == 75.0, back
        run.wait_event("server_ready", 300, skip=1)
        assert started_binaries(run) == [str(llama_server_bin), str(slow), str(llama_server_bin)]
        assert "upgrade_trial_passed" not in run.names()
    assert clients.failures == [] and clients.done >= 1


def test_a_good_new_build_is_kept_after_its_trial_with_both_figures(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    new = copy_build(llama_server_bin, tmp_path / "new-build")
    metrics = free_port()
    with serving(tmp_path, llama_server_bin, real_model, upgrade=TRIAL, front={"hold_timeout_s": HOLD_S},
                 server={"threads": 1}, metrics={"listen": f"127.0.0.1:{metrics}"}) as run, \
            ClientLoop(run.front, HOLD_S + 60) as clients:
        reload_with(run, new)
        passed = run.wait_event("upgrade_trial_passed", 600)
        assert passed["binary"] == str(new) and passed["max_slowdown_pct"] == 75.0, passed
        assert passed["tokens_per_s"] > 0 and passed["previous_tokens_per_s"] > 0, passed
        assert passed["previous_build"] != "unknown" and passed["build"] != "unknown", passed
        run.wait_event("upgrade_kept", 120)
        assert started_binaries(run) == [str(llama_server_bin), str(new)]
        assert "upgrade_rolled_back" not in run.names()
        scraped = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=30).text.splitlines()
        figures = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in scraped
                   if line.startswith("llama_guard_upgrade_trial_tokens_per_second{")}
        assert figures == {'build="old"': pytest.approx(passed["previous_tokens_per_s"], abs=0.01),
                           'build="new"': pytest.approx(passed["tokens_per_s"], abs=0.01)}, figures
        assert "llama_guard_upgrade_trial_kept 1.0" in scraped
        trial_shown = status_when(tmp_path, lambda s: (s["build"] or {}).get("trial") is not None)["build"]["trial"]
        assert trial_shown["kept"] is True and trial_shown["tokens_per_s"] == passed["tokens_per_s"], trial_shown
        shown = subprocess.run([sys.executable, "-m", "llama_guard", "status", "--config", str(run.config)],
                               capture_output=True, text=True, timeout=60, cwd=str(ROOT)).stdout
        assert f"last trial {passed['build']} {passed['tokens_per_s']} tok/s vs" in " ".join(shown.split()), shown
    assert clients.failures == [] and clients.done >= 1


def test_a_build_replaced_in_place_found_at_a_crash_is_rolled_back_by_the_recorded_figure(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """No old server to measure at an unplanned start: the new content at the path is measured against
    the serving build's figure from its own trial (a reload onto it, here), and rolled back to its kept
    copy."""
    first = copy_build(llama_server_bin, tmp_path / "first")
    second = copy_build(llama_server_bin, tmp_path / "second")
    with serving(tmp_path, first, real_model, upgrade=TRIAL, front={"hold_timeout_s": HOLD_S},
                 server={"threads": 1}) as run, ClientLoop(run.front, HOLD_S + 60) as clients:
        run.wait_event("upgrade_copy_kept", 120)
        reload_with(run, second)
        passed = run.wait_event("upgrade_trial_passed", 600)  # records both builds' figures
        assert passed["previous_figure"] == "measured in this window", passed
        kept = run.wait_event("upgrade_copy_kept", 120, skip=1)  # the second build's copy
        second.unlink()
        throttled(second, llama_server_bin)  # `make install` over it: slower
        pid = run.wait_event("server_ready", 60, skip=1)["server_pid"]
        os.kill(pid, signal.SIGKILL)  # a crash: the start that follows finds the new content
        back = run.wait_event("upgrade_rolled_back", 600)
        assert back["from_binary"] == str(second) and Path(back["to_binary"]).parent == Path(kept["dir"]), back
        assert back["cause"].startswith("slower: ") and back["previous_figure"] == (
            "recorded at its last trial on this box"), back
        assert back["previous_tokens_per_s"] == pytest.approx(passed["tokens_per_s"], abs=0.01), back
        run.wait_event("server_ready", 300, skip=2)
        assert started_binaries(run)[-2:] == [str(second), back["to_binary"]]
    assert clients.failures == [] and clients.done >= 1


def test_upgrades_in_a_row_each_slow_one_rolls_back_to_the_build_before_it(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """A good build kept, then a slow one, twice over, each reload as soon as the previous window ended
    (the good build still on probation when the slow one comes): each slow build rolls back to the good
    build before it."""
    with serving(tmp_path, llama_server_bin, real_model, upgrade=TRIAL, front={"hold_timeout_s": HOLD_S},
                 server={"threads": 1}) as run, ClientLoop(run.front, HOLD_S + 60) as clients:
        for i in range(2):
            good = copy_build(llama_server_bin, tmp_path / f"good-{i}")
            reload_with(run, good)
            assert run.wait_event("upgrade_trial_passed", 600, skip=i)["binary"] == str(good)
            slow = throttled(tmp_path / f"slow-{i}", llama_server_bin)
            slow.write_text(slow.read_text() + f"# round {i}\n")
            reload_with(run, slow)
            back = run.wait_event("upgrade_rolled_back", 600, skip=i)
            assert back["from_binary"] == str(slow) and back["to_binary"] == str(good), back
            run.wait_event("server_ready", 300, skip=2 * i + 2)
    assert clients.failures == [] and clients.done >= 1
