#!/usr/bin/env python3
"""Soak of ``llama-guard run`` against the real llama-server: N ``kill -9`` cycles, then M
SIGHUPs, printing the daemon's open fds, threads, zombie children and RSS at the start, the middle
and the end. Flat numbers mean nothing is kept per restart or per reload.

Each kill waits for the new server's ``server_ready`` before the next one (so every cycle is a full
death → restart → load); each SIGHUP waits for its answer (``config_reloaded`` or ``reload_ignored``).
The daemon runs with ``[recovery] max_restarts`` high and a short ``restart_window_s``, so a kill
is always the first failure in its window (restarted at once, no backoff); ``[log] level "info"``.

    . .work/real/env && .venv/bin/python benchmarks/bench_soak.py              # 100 kills, 500 SIGHUPs
    BENCH_SIZE=ci .venv/bin/python benchmarks/bench_soak.py                     # 30 kills, 150 SIGHUPs (CI)
    . .work/real/env && .venv/bin/python benchmarks/bench_soak.py --kills 1000 --hups 5000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from benchlib import sized  # noqa: E402
from harness import DaemonRun, base_sections, free_port, merge  # noqa: E402

Event = dict[str, Any]


class EventTail:
    """Reads the daemon's JSON-lines log incrementally (the file grows to thousands of lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def new(self) -> list[Event]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict) and "event" in item:
                out.append(item)
        return out

    def wait(self, names: set[str], timeout: float, where: Any = lambda e: True) -> Event:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.new():
                if event["event"] in names and where(event):
                    return event
            time.sleep(0.005)
        raise TimeoutError(f"none of {sorted(names)} within {timeout} s")


def resources(pid: int) -> dict[str, float]:
    """The daemon's open fds, threads, zombie children and RSS (MiB)."""
    proc = psutil.Process(pid)
    zombies = sum(1 for c in proc.children(recursive=True) if _status(c) == psutil.STATUS_ZOMBIE)
    return {"fds": float(proc.num_fds()), "threads": float(proc.num_threads()), "zombies": float(zombies),
            "rss_mib": proc.memory_info().rss / 2**20}


def _status(proc: psutil.Process) -> str:
    try:
        return str(proc.status())
    except psutil.Error:
        return ""


def quiet_stop(daemon: DaemonRun) -> None:
    """SIGTERM, then SIGKILL after 20 s (DaemonRun.stop prints every event: thousands here)."""
    if daemon.proc is None or daemon.proc.poll() is not None:
        return
    daemon.proc.send_signal(signal.SIGTERM)
    try:
        daemon.proc.wait(timeout=20)
    except Exception:
        daemon.proc.kill()
        daemon.proc.wait(timeout=10)


def record(rows: list[tuple[str, dict[str, float]]], name: str, values: dict[str, float]) -> None:
    """Keep a row for the table, and print it now (a long soak shows its progress)."""
    rows.append((name, values))
    print(f"  {name}: fds {values['fds']:.0f}, threads {values['threads']:.0f}, zombies {values['zombies']:.0f}, "
          f"RSS {values['rss_mib']:.1f} MiB", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=sized(100, 30), help="kill -9 cycles (100; CI 30; a long soak: 1000)")
    ap.add_argument("--hups", type=int, default=sized(500, 150), help="SIGHUPs (500; CI 150; a long soak: 5000)")
    args = ap.parse_args()
    binary = os.environ.get("LLAMA_SERVER_BIN", "")
    model = os.environ.get("LLAMA_GUARD_TEST_MODEL", "")
    if not (binary and Path(binary).is_file() and model and Path(model).is_file()):
        print("bench_soak: set LLAMA_SERVER_BIN and LLAMA_GUARD_TEST_MODEL (`. .work/real/env`)", file=sys.stderr)
        return 2
    print(f"machine: {platform.node()}, nproc {len(os.sched_getaffinity(0))}, Python {platform.python_version()}")
    print(f"soak: {args.kills} kill -9 cycles, then {args.hups} SIGHUPs; model {Path(model).name}, CPU only")
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    started = time.monotonic()
    rows: list[tuple[str, dict[str, float]]] = []
    ready_s: list[float] = []
    answers: dict[str, int] = {"config_reloaded": 0, "reload_ignored": 0, "config_error": 0}
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmpdir:
        tmp = Path(tmpdir)
        port = free_port()
        sections = merge(base_sections(tmp, binary, model, port), {
            "health": {"interval_s": 5.0, "timeout_s": 3.0, "canary_timeout_s": 30.0, "hang_strikes": 3},
            "recovery": {"max_restarts": 1_000_000, "restart_window_s": 0.05, "stable_after_s": 0.05,
                         "stop_grace_s": 3.0},
            "log": {"level": "info", "format": "json"},
        })
        daemon = DaemonRun(tmp, sections).start()
        tail = EventTail(daemon.log_path)
        try:
            pid = tail.wait({"server_ready"}, 120)["server_pid"]
            time.sleep(0.5)
            record(rows, "start (first server ready)", resources(daemon.pid))
            for i in range(args.kills):
                t0 = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                pid = tail.wait({"server_ready"}, 120, where=lambda e, old=pid: e["server_pid"] != old)["server_pid"]
                ready_s.append(time.monotonic() - t0)
                if i + 1 == args.kills // 2:
                    record(rows, f"after {i + 1} kills", resources(daemon.pid))
            time.sleep(0.5)
            record(rows, f"after {args.kills} kills", resources(daemon.pid))
            for i in range(args.hups):
                os.kill(daemon.pid, signal.SIGHUP)
                answer = tail.wait(set(answers), 30)
                answers[answer["event"]] += 1
                if i + 1 == args.hups // 2:
                    record(rows, f"after {i + 1} SIGHUPs", resources(daemon.pid))
            time.sleep(0.5)
            record(rows, f"end: after {args.hups} SIGHUPs", resources(daemon.pid))
        finally:
            quiet_stop(daemon)
    width = max(len(name) for name, _ in rows)
    print()
    print(f"{'daemon resources':<{width}}  {'fds':>5}  {'threads':>7}  {'zombies':>7}  {'RSS MiB':>8}")
    for name, r in rows:
        print(f"{name:<{width}}  {r['fds']:>5.0f}  {r['threads']:>7.0f}  {r['zombies']:>7.0f}  {r['rss_mib']:>8.1f}")
    if ready_s:
        print(f"\nkill -9 → next server_ready: median {statistics.median(ready_s) * 1000:.0f} ms, "
              f"min {min(ready_s) * 1000:.0f} ms, max {max(ready_s) * 1000:.0f} ms (n={len(ready_s)})")
    print(f"SIGHUP answers: {answers}")
    load = os.getloadavg()
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
