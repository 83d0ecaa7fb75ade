#!/usr/bin/env python3
"""Judgement latencies of ``llama-guard run`` with the real llama-server, N rounds each:

1. frozen at load → replaced: a launcher that SIGSTOPs itself right after spawn (before it execs the real
   llama-server; no line, no CPU time, no HTTP answer) → ``server_load_stalled``, and → the next
   ``server_ready`` (a real load), at ``[health].load_stall_s`` (shipped default unless ``--load-stall``);
   the rounds run side by side (a daemon each), beside part 2;
2. SIGSTOP → ``server_hang`` at the shipped ``[health]`` defaults (interval, timeout, canary, strikes):
   the bench SIGSTOPs a ready server and times the event (the goal: within 20 s, the docs' figure
   ``hang_strikes`` × ``interval_s`` + ``timeout_s``), and the verdict → the server's exit (the goal:
   within 2 s: a hung server gets no full graceful stop).

Times against the daemon's event timestamps use ``time.time()`` (same host). On a shared machine the load
average printed at both ends says how much to trust the figures.

    . .work/real/env && .venv/bin/python benchmarks/bench_judgement.py [--rounds 3] [--load-stall 60]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import stat
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from benchlib import epoch, print_table, sized  # noqa: E402
from harness import DaemonRun, base_sections, free_port, merge  # noqa: E402
from llama_guard.config.sections import HealthConfig  # noqa: E402

SHIPPED = {name: getattr(HealthConfig(), name) for name in ("interval_s", "timeout_s", "canary_timeout_s",
                                                            "hang_strikes", "load_stall_s", "progress_cpu_s")}


def sections(tmp: Path, binary: str, model: str, port: int, health: dict[str, object]) -> dict[str, dict[str, object]]:
    return merge(base_sections(tmp, binary, model, port), {
        "health": health, "recovery": {"max_restarts": 1000, "stop_grace_s": 1.0, "stable_after_s": 1.0},
        "log": {"level": "info", "format": "json"}})


def frozen_launcher(tmp: Path, binary: str, marks: Path) -> Path:
    """Freezes (SIGSTOP to itself) while ``marks`` holds a line, consuming one per server start (a
    ``--version`` or ``--help`` run, llama-guard's preflight of the build, is no start: passed through)."""
    script = tmp / "frozen.sh"
    script.write_text(f'#!/bin/sh\ncase "$1" in --version|--help) exec "{binary}" "$@";; esac\n'
                      f'if [ -s "{marks}" ]; then sed -i 1d "{marks}"; kill -STOP $$; fi\n'
                      f'exec "{binary}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def frozen_round(stall_s: float, tmp: Path, binary: str, model: str) -> tuple[float, float]:
    """One daemon whose second server comes up frozen: (its start → ``server_load_stalled``, its start →
    the next ``server_ready``), seconds. Rounds run side by side, each with its own daemon and port: a
    frozen launcher takes no CPU, so the stall's wait is the same whatever runs beside it."""
    marks = tmp / "freeze-next"
    marks.write_text("")
    launcher = frozen_launcher(tmp, binary, marks)
    daemon = DaemonRun(tmp, sections(tmp, str(launcher), model, free_port(),
                                     {**SHIPPED, "load_stall_s": stall_s}))
    daemon.start()
    try:
        pid = daemon.wait_event("server_ready", 60.0)["server_pid"]
        marks.write_text("freeze\n")
        os.kill(pid, signal.SIGKILL)  # the restart that follows comes up frozen
        stalled = daemon.wait_event("server_load_stalled", stall_s + 60.0)
        starting = next(e for e in daemon.events() if e["event"] == "server_starting"
                        and e["server_pid"] == stalled["server_pid"])
        ready = daemon.wait_event("server_ready", 120.0, skip=1)
    finally:
        daemon.stop()
    return epoch(stalled["timestamp"]) - epoch(starting["timestamp"]), \
        epoch(ready["timestamp"]) - epoch(starting["timestamp"])


def hang_rounds(rounds: int, tmp: Path, binary: str, model: str) -> tuple[list[float], list[float]]:
    """(SIGSTOP → server_hang, server_hang → the server's exit event) per round, seconds."""
    out: list[float] = []
    killed: list[float] = []
    daemon = DaemonRun(tmp, sections(tmp, binary, model, free_port(), dict(SHIPPED)))
    daemon.start()
    try:
        for i in range(rounds):
            pid = daemon.wait_event("server_ready", 60.0, skip=i)["server_pid"]
            time.sleep(2.0)
            t_wall = time.time()
            os.kill(pid, signal.SIGSTOP)
            hang = daemon.wait_event("server_hang", 90.0, skip=i)
            out.append(epoch(hang["timestamp"]) - t_wall)
            gone = daemon.wait_event("server_stopped", 30.0, skip=i)
            killed.append(epoch(gone["timestamp"]) - epoch(hang["timestamp"]))
    finally:
        daemon.stop()
    return out, killed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=sized(3, 2), help="rounds of each part (3; CI 2)")
    parser.add_argument("--load-stall", type=float, default=float(SHIPPED["load_stall_s"]),  # type: ignore[arg-type]
                        help="[health].load_stall_s for the frozen-at-load rounds (default: shipped)")
    args = parser.parse_args()
    binary, model = os.environ.get("LLAMA_SERVER_BIN", ""), os.environ.get("LLAMA_GUARD_TEST_MODEL", "")
    if not (binary and model):
        print("set LLAMA_SERVER_BIN and LLAMA_GUARD_TEST_MODEL (. .work/real/env)", file=sys.stderr)
        return 2
    print(f"load average at start: {os.getloadavg()}; shipped [health]: {SHIPPED}", flush=True)
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(args.rounds + 1) as pool:
        dirs = [Path(stack.enter_context(tempfile.TemporaryDirectory())) for _ in range(args.rounds + 1)]
        hang_job = pool.submit(hang_rounds, args.rounds, dirs[0], binary, model)
        frozen_jobs = [pool.submit(frozen_round, args.load_stall, d, binary, model) for d in dirs[1:]]
        frozen = {"stalled": [job.result()[0] for job in frozen_jobs],
                  "replaced": [job.result()[1] for job in frozen_jobs]}
        hang, killed = hang_job.result()
    print_table([
        (f"frozen at load → server_load_stalled (load_stall_s {args.load_stall:g})", frozen["stalled"]),
        ("frozen at load → replaced (next server_ready)", frozen["replaced"]),
        ("SIGSTOP → server_hang at shipped defaults", hang),
        ("server_hang → the hung server's exit (server_stopped)", killed),
    ], title="judgement latencies (real llama-server), from the stall's start / the SIGSTOP")
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
