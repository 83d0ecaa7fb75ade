#!/usr/bin/env python3
"""What the trial of a new llama-server build costs the clients, against the real llama-server through
llama-guard's front door: one daemon, ``--clients`` client loops (each one completion of 2 tokens after
another through the front door), a plain planned restart (``llama-guard restart``: the window without a
trial, for comparison) and reloads that name a new build —

* **good**: the same llama-server copied elsewhere (kept after its trial);
* **slow**: the real llama-server under a CPU quota of 10 ms in 200 ms once it answers ``/health``
  (tests/e2e/test_upgrade_trial_e2e.py ``throttled``: slow by design, rolled back after its trial).

Per reload: the drained window (``restart_requested`` to the ``server_ready`` that releases the held
clients, seconds), the requests the front door held in it and the longest hold (its ``front_held``
event), both trial figures (decode tokens/s, median of ``--runs`` completions of ``--tokens`` tokens) and
the outcome. The good rows also give the run-to-run spread of one build measured twice on this host (old
vs new: the same content). ``--rounds`` good/slow pairs (3; CI 1).

    . .work/real/env && .venv/bin/python benchmarks/bench_upgrade.py
    .venv/bin/python benchmarks/bench_upgrade.py --server-bin /path/llama-server --model /path/27b.gguf \\
        --gpu-layers 999 --ctx 8192 --runs 3 --tokens 32

Waits are on the daemon's events, each bounded; a wait that runs out stops the bench with its message.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests"), str(ROOT / "tests" / "e2e"), str(ROOT / "benchmarks")]

from benchlib import add_server_args, epoch, sized  # noqa: E402
from harness import DaemonRun, base_sections, free_port, merge, terminate  # noqa: E402
from test_upgrade_e2e import copy_build  # noqa: E402
from test_upgrade_trial_e2e import throttled  # noqa: E402

WAIT_S = 900.0  # one reload's window at most (the slow build's trial on a loaded 2-core host: minutes)


class Clients(threading.Thread):
    """Completions through the front door, one after another, until stopped; failures kept."""

    def __init__(self, front: int) -> None:
        super().__init__(daemon=True)
        self.front, self.done, self.failures = front, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=WAIT_S) as client:
            while not self.stop.is_set():
                try:
                    ok = client.post(f"http://127.0.0.1:{self.front}/completion",
                                     json={"prompt": "Hello", "n_predict": 2}).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.done += 1
                self.failures += not ok


def reload_to(run: DaemonRun, binary: Path) -> None:
    text = run.config.read_text()
    old = next(line for line in text.splitlines() if line.startswith("binary = "))
    run.config.write_text(text.replace(old, f'binary = "{binary}"'))
    run.signal(signal.SIGHUP)


def window(run: DaemonRun, binary: Path | None, kind: str) -> dict[str, Any]:
    """Reload onto ``binary`` (None: a planned restart, SIGUSR1); the window's figures once the held
    clients are released to a server."""
    def count(name: str) -> int:
        return sum(1 for e in run.events() if e["event"] == name)

    outcome = {"good": "upgrade_trial_passed", "slow": "upgrade_rolled_back"}.get(kind, "server_ready")
    asked, ready, held, verdicts = (count("restart_requested"), count("server_ready"), count("front_held"),
                                    count(outcome))
    if binary is None:
        run.signal(signal.SIGUSR1)
    else:
        reload_to(run, binary)
    begin = run.wait_event("restart_requested", 120, skip=asked)
    verdict = run.wait_event(outcome, WAIT_S, skip=verdicts)
    end = run.wait_event("server_ready", WAIT_S, skip=ready)  # the build kept, or the one rolled back to
    hold = run.wait_event("front_held", 60, skip=held)
    return {"kind": kind, "window_s": epoch(end["timestamp"]) - epoch(begin["timestamp"]),
            "held": hold["held"], "longest_s": hold["longest_s"], "failed": hold["failed"],
            "old": verdict.get("previous_tokens_per_s"), "new": verdict.get("tokens_per_s"),
            "outcome": {"good": "kept", "slow": "rolled back"}.get(kind, "restarted")}


def _tps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser, ctx=1024, threads=1)
    parser.add_argument("--rounds", type=int, default=sized(3, 1), help="good/slow reload pairs (3; CI 1)")
    parser.add_argument("--runs", type=int, default=1, help="[upgrade].trial_runs (completions per build)")
    parser.add_argument("--tokens", type=int, default=sized(16, 8), help="[upgrade].trial_tokens (16; CI 8)")
    parser.add_argument("--limit", type=float, default=75.0, help="[upgrade].max_slowdown_pct")
    parser.add_argument("--clients", type=int, default=4, help="client loops through the front door")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    if not args.model:
        parser.error("--model (or $LLAMA_GUARD_TEST_MODEL) is needed")
    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; model {args.model}; gpu layers "
          f"{args.gpu_layers}; threads {args.threads}; trial {args.runs} x {args.tokens} tokens (+ warm-up), "
          f"limit {args.limit:g} %")
    real = Path(args.server_bin)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        port, front = free_port(), free_port()
        sections = merge(base_sections(tmp, str(real), args.model, port), {
            "server": {"ctx_size": args.ctx, "n_gpu_layers": args.gpu_layers, "threads": args.threads},
            "front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": WAIT_S},
            "health": {"canary": False, "interval_s": 1.0, "timeout_s": 5.0, "hang_strikes": 5},
            "recovery": {"stable_after_s": 1.0, "max_restarts": 10},
            "log": {"level": "info", "format": "json"},
            "upgrade": {"probation_s": 1.0, "trial_runs": args.runs, "trial_tokens": args.tokens,
                        "max_slowdown_pct": args.limit, "trial_timeout_s": WAIT_S / 2}})
        run = DaemonRun(tmp, sections).start()
        clients = [Clients(front) for _ in range(args.clients)]
        try:
            run.wait_event("server_ready", WAIT_S)
            for client in clients:
                client.start()
            for i in range(args.rounds):
                rows.append(window(run, None, "plain"))
                good = copy_build(real, tmp / f"good-{i}")  # a new path: a new build to try
                rows.append(window(run, good, "good"))
                # A new slow build each round (a build rolled back once is never started again).
                slow = throttled(tmp / f"llama-server-slow-{i}", real)
                slow.write_text(slow.read_text() + f"# round {i}\n")
                rows.append(window(run, slow, "slow"))
        finally:
            for client in clients:
                client.stop.set()
            for client in clients:
                client.join(WAIT_S)
            if run.proc is not None:
                terminate(run.proc, 30.0)
    print(f"\n{'build':<6} {'outcome':<12} {'window s':>9} {'held':>5} {'longest hold s':>15} {'failed':>7} "
          f"{'old tok/s':>10} {'new tok/s':>10}")
    for r in rows:
        print(f"{r['kind']:<6} {r['outcome']:<12} {r['window_s']:>9.1f} {r['held']:>5} {r['longest_s']:>15.1f} "
              f"{r['failed']:>7} {_tps(r['old']):>10} {_tps(r['new']):>10}")
    for kind in ("plain", "good", "slow"):
        mine = [r for r in rows if r["kind"] == kind]
        print(f"{kind}: window median {statistics.median(r['window_s'] for r in mine):.1f} s over {len(mine)}")
    spread = [abs(r["old"] - r["new"]) / r["old"] * 100 for r in rows if r["kind"] == "good" and r["old"]]
    if spread:
        print(f"one build measured twice (good rows: old vs new, same content): differed by "
              f"{statistics.median(spread):.0f} % median, {max(spread):.0f} % at most")
    done, failed = sum(c.done for c in clients), sum(c.failures for c in clients)
    print(f"clients: {done} requests, {failed} failed; load at the end: {os.getloadavg()[0]:.2f}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
