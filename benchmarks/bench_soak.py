#!/usr/bin/env python3
"""Soak of ``llama-guard run`` against the real llama-server over the whole life of a box: front-door
traffic (plain and streamed completions, clients that leave mid-stream, requests held across restarts
and replayed), ``kill -9`` of llama-server, planned restarts with ``[slots]`` carry-over on (each saves
the slots, the next server restores them; rolling saves between), SIGHUP reloads — all interleaved. The
daemon's RSS, open fds, threads, zombie children and asyncio tasks (``llama_guard_asyncio_tasks`` on its
``/metrics``) are read at every tenth of the run; the table gives them at 10 % and at 100 % and the
difference. Nothing kept per request, per restart, per save or per reload means a flat table.

The run is ten equal rounds. Client threads send requests through the front door all the time; each
round's kills, planned restarts and SIGHUPs are spread over its requests (each waits for its answer:
the next ``server_ready``, or ``config_reloaded``/``reload_ignored``). At the end of a round the
clients pause, the bench waits until the front door has nothing in flight or held, and reads the
daemon five times 0.2 s apart, keeping each figure's lowest (a rolling save or a scrape in progress
is not a leak).

Flat within noise, decided per figure: the growth from 10 % to 100 % is a leak when it exceeds both a
floor (RSS 4 MiB; fds, threads 4; tasks 2; zombies 0) and three times the median change from one tenth to
the next (the run's own noise: a leak adds about the same every round, so its growth over nine rounds is
about nine such changes; noise wanders and comes back). A leak exits 1, so ``make bench-ci`` fails.

    . .work/real/env && .venv/bin/python benchmarks/bench_soak.py   # 20,000 requests, 100 kills, 50 planned (~25 min)
    BENCH_SIZE=ci .venv/bin/python benchmarks/bench_soak.py        # 500 requests, 10 kills, 5 planned (CI, ~50 s)
    . .work/real/env && .venv/bin/python benchmarks/bench_soak.py --requests 200000 --kills 1000 --restarts 500
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from benchlib import sized  # noqa: E402
from harness import DaemonRun, base_sections, free_port, merge  # noqa: E402

Event = dict[str, Any]
ROUNDS = 10  # the run's tenths: resources are read after each
READY_TIMEOUT_S = 120.0
RELOAD_ANSWERS = ("config_reloaded", "reload_ignored", "config_error")
FIGURES = ("rss_mib", "fds", "threads", "tasks", "zombies")
# The growth (10 % → 100 %) below which a figure is flat whatever the noise: allocator arenas and
# caches move RSS by a few MiB; one connection or a rolling save's lane moves a count by one or two.
FLOOR = {"rss_mib": 4.0, "fds": 4.0, "threads": 4.0, "tasks": 2.0, "zombies": 0.0}
NOISE_FACTOR = 3.0


class EventTail:
    """Reads the daemon's JSON-lines log incrementally (it grows to tens of thousands of lines) and
    counts every event by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.counts: Counter[str] = Counter()
        self.pending: list[Event] = []

    def read(self) -> None:
        """Take in what the daemon wrote since the last read."""
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict) and "event" in item:
                self.counts[str(item["event"])] += 1
                self.pending.append(item)

    def wait(self, names: set[str], timeout: float, where: Any = lambda e: True) -> Event:
        """The first event read from now on (older ones are dropped) named in ``names`` and matching
        ``where``; TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read()
            while self.pending:
                event = self.pending.pop(0)
                if event["event"] in names and where(event):
                    return event
            time.sleep(0.005)
        raise TimeoutError(f"none of {sorted(names)} within {timeout} s")


class Clients:
    """``threads`` clients sending through the front door until :meth:`close`: of every ten requests
    six plain completions, three streamed ones read to their end, one stream left after its first
    event (the client closes its connection). Each prompt is new (a counter in it)."""

    def __init__(self, front: int, threads: int, max_tokens: int) -> None:
        self.url = f"http://127.0.0.1:{front}/completion"
        self.max_tokens = max_tokens
        self.lock = threading.Lock()
        self.sent = 0
        self.outcomes: Counter[str] = Counter()
        self.go = threading.Event()
        self.go.set()
        self.idle = threading.Semaphore(0)
        self.closing = False
        self.workers = [threading.Thread(target=self._work, daemon=True) for _ in range(threads)]
        for worker in self.workers:
            worker.start()

    def _next(self) -> int | None:
        with self.lock:
            if not self.go.is_set() or self.closing:
                return None
            self.sent += 1
            return self.sent

    def _work(self) -> None:
        with httpx.Client(timeout=READY_TIMEOUT_S + 60) as client:
            while not self.closing:
                if not self.go.is_set():
                    self.idle.release()
                    self.go.wait()
                    continue
                n = self._next()
                if n is None:
                    continue
                outcome = self._one(client, n)
                with self.lock:
                    self.outcomes[outcome] += 1

    def _one(self, client: httpx.Client, n: int) -> str:
        kind = n % 10
        # A prompt llama-server's prompt cache mostly has (only the number is new): a request costs a few tokens.
        body = {"prompt": f"Name three colours. Request {n}", "n_predict": self.max_tokens, "temperature": 0}
        try:
            if kind < 6:
                return f"plain {client.post(self.url, json=body).status_code}"
            with client.stream("POST", self.url, json={**body, "stream": True,
                                                       "n_predict": self.max_tokens * (8 if kind == 9 else 1)}) as r:
                if kind == 9:
                    for _ in r.iter_raw():
                        return f"left {r.status_code}"  # leaving the block closes the connection mid-stream
                    return f"left (ended first) {r.status_code}"
                ended, last = False, b""  # the end marker may straddle two reads: each is looked at with the last bytes
                for chunk in r.iter_raw():
                    window = last + chunk
                    ended = ended or b"[DONE]" in window or b'"stop":true' in window
                    last = window[-16:]
                return f"stream {r.status_code}" + ("" if ended or r.status_code != 200 else " (no end)")
        except httpx.HTTPError as exc:
            return f"error {type(exc).__name__}"

    def run_until(self, total: int) -> None:
        self.go.set()
        while self.done() < total:
            time.sleep(0.01)

    def done(self) -> int:
        with self.lock:
            return sum(self.outcomes.values())

    def pause(self) -> None:
        """Stop sending; returns once every client finished its request (each waits at the gate)."""
        self.go.clear()
        for _ in self.workers:
            self.idle.acquire()

    def close(self) -> None:
        self.closing = True
        self.go.set()
        for worker in self.workers:
            worker.join(timeout=READY_TIMEOUT_S + 60)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def quiet(metrics_port: int, timeout_s: float = 60.0) -> None:
    """Until the front door holds nothing and answers nothing (the clients paused)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = scrape(metrics_port)
        if (m.get(("llama_guard_front_requests_in_flight", ()), 1) == 0
                and m.get(("llama_guard_front_requests_waiting", ()), 1) == 0):
            return
        time.sleep(0.05)
    raise TimeoutError(f"the front door still had requests after {timeout_s} s")


def resources(pid: int, metrics_port: int) -> dict[str, float]:
    """The daemon's RSS (MiB), open fds, threads, asyncio tasks and zombie children: each the lowest of
    five readings 0.2 s apart."""
    readings = []
    proc = psutil.Process(pid)
    for i in range(5):
        if i:
            time.sleep(0.2)
        zombies = sum(1 for c in proc.children(recursive=True) if _status(c) == psutil.STATUS_ZOMBIE)
        readings.append({"rss_mib": proc.memory_info().rss / 2**20, "fds": float(proc.num_fds()),
                         "threads": float(proc.num_threads()), "zombies": float(zombies),
                         "tasks": scrape(metrics_port)[("llama_guard_asyncio_tasks", ())]})
    return {k: min(r[k] for r in readings) for k in FIGURES}


def _status(proc: psutil.Process) -> str:
    try:
        return str(proc.status())
    except psutil.Error:
        return ""


def quiet_stop(daemon: DaemonRun) -> None:
    """SIGTERM, then SIGKILL after 30 s (DaemonRun.stop prints every event: tens of thousands here)."""
    if daemon.proc is None or daemon.proc.poll() is not None:
        return
    daemon.proc.send_signal(signal.SIGTERM)
    try:
        daemon.proc.wait(timeout=30)
    except Exception:
        daemon.proc.kill()
        daemon.proc.wait(timeout=10)


def verdicts(samples: list[dict[str, float]]) -> list[tuple[str, float, float, float, float, bool]]:
    """Per figure: (name, at 10 %, at 100 %, growth, tolerance, leak?). The tolerance is the larger of
    FLOOR and NOISE_FACTOR × the median change between consecutive tenths."""
    out = []
    for key in FIGURES:
        values = [s[key] for s in samples]
        steps = [abs(b - a) for a, b in itertools.pairwise(values)]
        tolerance = max(FLOOR[key], NOISE_FACTOR * statistics.median(steps)) if steps else FLOOR[key]
        growth = values[-1] - values[0]
        out.append((key, values[0], values[-1], growth, tolerance, growth > tolerance))
    return out


NAMES = {"rss_mib": "RSS MiB", "fds": "open fds", "threads": "threads", "tasks": "asyncio tasks",
         "zombies": "zombie children"}


def print_verdicts(rows: list[tuple[str, float, float, float, float, bool]]) -> None:
    width = max(len(n) for n in NAMES.values())
    head = f"{'daemon':<{width}}  {'at 10 %':>9}  {'at 100 %':>9}  {'difference':>10}  {'tolerance':>9}  verdict"
    print(head)
    print("-" * len(head))
    for key, first, last, growth, tolerance, leak in rows:
        digits = 1 if key == "rss_mib" else 0
        print(f"{NAMES[key]:<{width}}  {first:>9.{digits}f}  {last:>9.{digits}f}  {growth:>+10.{digits}f}  "
              f"{tolerance:>9.{digits}f}  {'GROWS' if leak else 'flat'}")


def spread(total: int, rounds: int) -> list[int]:
    """``total`` actions over ``rounds`` rounds, as even as integers allow, the first round never without
    one (the 10 % reading comes after every kind of action ran at least once: pools and lanes are warm)."""
    return [-(-total * (r + 1) // rounds) + (-total * r // rounds) for r in range(rounds)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=sized(20_000, 500), help="front-door requests (20000; CI 500)")
    ap.add_argument("--kills", type=int, default=sized(100, 10), help="kill -9 of llama-server (100; CI 10)")
    ap.add_argument("--restarts", type=int, default=sized(50, 5), help="planned restarts (SIGUSR1) (50; CI 5)")
    ap.add_argument("--hups", type=int, default=sized(200, 20), help="SIGHUP reloads (200; CI 20)")
    ap.add_argument("--clients", type=int, default=4, help="client threads (4)")
    ap.add_argument("--parallel", type=int, default=4, help="llama-server slots (4)")
    ap.add_argument("--max-tokens", type=int, default=2, help="n_predict of a request (2; a leaving stream 8×)")
    # One thread: on a host whose cores are all taken, llama-server's threads wait for each other at every
    # step (10x slower per request on 2 busy cores); the soak measures the daemon, not decode speed.
    ap.add_argument("--threads", type=int, default=1, help="llama-server --threads (1)")
    args = ap.parse_args()
    # `timeout` and CI end a bench with SIGTERM: stop the daemon (the finally below) rather than orphan it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    binary = os.environ.get("LLAMA_SERVER_BIN", "")
    model = os.environ.get("LLAMA_GUARD_TEST_MODEL", "")
    if not (binary and Path(binary).is_file() and model and Path(model).is_file()):
        print("bench_soak: set LLAMA_SERVER_BIN and LLAMA_GUARD_TEST_MODEL (`. .work/real/env`)", file=sys.stderr)
        return 2
    print(f"machine: {platform.node()}, nproc {len(os.sched_getaffinity(0))}, Python {platform.python_version()}")
    print(f"soak: {args.requests} front-door requests ({args.clients} clients), {args.kills} kill -9, "
          f"{args.restarts} planned restarts with [slots] on ({args.parallel} slots), {args.hups} SIGHUPs, "
          f"in {ROUNDS} rounds; model {Path(model).name}, CPU only")
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    started = time.monotonic()
    samples: list[dict[str, float]] = []
    ready_s: dict[str, list[float]] = {"kill -9": [], "planned": []}
    answers: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmpdir:
        tmp = Path(tmpdir)
        port, front, metrics_port = free_port(), free_port(), free_port()
        sections = merge(base_sections(tmp, binary, model, port), {
            "server": {"parallel": args.parallel, "threads": args.threads},
            "front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": READY_TIMEOUT_S},
            "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
            "slots": {"enabled": True, "rolling_save_interval_s": 1.0},
            "health": {"interval_s": 5.0, "timeout_s": 3.0, "canary_timeout_s": 30.0, "hang_strikes": 3,
                       "load_timeout_s": READY_TIMEOUT_S},
            "recovery": {"max_restarts": 1_000_000, "restart_window_s": 0.05, "stable_after_s": 0.05,
                         "stop_grace_s": 3.0},
            "schedule": {"drain_timeout_s": 60.0},
            "log": {"level": "info", "format": "json"},
        })
        daemon = DaemonRun(tmp, sections).start()
        tail = EventTail(daemon.log_path)
        clients: Clients | None = None
        try:
            pid = tail.wait({"server_ready"}, READY_TIMEOUT_S)["server_pid"]
            clients = Clients(front, args.clients, args.max_tokens)
            requests = spread(args.requests, ROUNDS)
            plan = [["kill"] * k + ["planned"] * p + ["hup"] * h for k, p, h in
                    zip(spread(args.kills, ROUNDS), spread(args.restarts, ROUNDS), spread(args.hups, ROUNDS),
                        strict=True)]
            sent = 0
            for r in range(ROUNDS):
                # Interleave the round's actions (kills, planned restarts, reloads) and spread them over its requests.
                actions = [plan[r][i] for i in sorted(range(len(plan[r])), key=lambda i: (i * 7919) % len(plan[r]))]
                for i, action in enumerate(actions):
                    clients.run_until(sent + requests[r] * (i + 1) // (len(actions) + 1))
                    t0 = time.monotonic()
                    if action == "hup":
                        os.kill(daemon.pid, signal.SIGHUP)
                        answers[tail.wait(set(RELOAD_ANSWERS), 60)["event"]] += 1
                        continue
                    if action == "kill":
                        os.kill(pid, signal.SIGKILL)
                    else:
                        os.kill(daemon.pid, signal.SIGUSR1)
                    pid = tail.wait({"server_ready"}, READY_TIMEOUT_S,
                                    where=lambda e, old=pid: e["server_pid"] != old)["server_pid"]
                    ready_s["kill -9" if action == "kill" else "planned"].append(time.monotonic() - t0)
                sent += requests[r]
                clients.run_until(sent)
                clients.pause()
                quiet(metrics_port)
                samples.append(resources(daemon.pid, metrics_port))
                s = samples[-1]
                print(f"  {10 * (r + 1):>3} %: {clients.done()} requests, RSS {s['rss_mib']:.1f} MiB, fds "
                      f"{s['fds']:.0f}, threads {s['threads']:.0f}, tasks {s['tasks']:.0f}, zombies "
                      f"{s['zombies']:.0f}; {time.monotonic() - started:.0f} s", flush=True)
            front_metrics = scrape(metrics_port)
        finally:
            if clients is not None:
                clients.close()
            quiet_stop(daemon)
        tail.read()  # the events written by the stop (the last saves)
    print()
    rows = verdicts(samples)
    print_verdicts(rows)
    print()
    outcomes = clients.outcomes if clients is not None else Counter()
    print(f"requests through the front door: {sum(outcomes.values())}: "
          + ", ".join(f"{k} {n}" for k, n in sorted(outcomes.items())))
    held = front_metrics.get(("llama_guard_front_requests_held_total", ()), 0)
    replayed = front_metrics.get(("llama_guard_front_requests_replayed_total", ()), 0)
    resumed = front_metrics.get(("llama_guard_front_streams_resumed_total", ()), 0)
    print(f"front door: held {held:.0f}, replayed {replayed:.0f}, streams resumed {resumed:.0f}")
    counts = tail.counts
    print(f"restarts: kill -9 {len(ready_s['kill -9'])}, planned {len(ready_s['planned'])}; slot saves "
          f"{counts['slot_saved']} (failed {counts['slot_save_failed']}), restores {counts['slot_restored']} "
          f"(failed {counts['slot_restore_failed']}, refused {counts['slot_restore_refused']}, unused "
          f"{counts['slot_restore_unused']}); SIGHUP answers {dict(answers)}")
    for kind, values in ready_s.items():
        if values:
            print(f"{kind} → next server_ready: median {statistics.median(values) * 1000:.0f} ms, "
                  f"min {min(values) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms (n={len(values)})")
    load = os.getloadavg()
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; total {time.monotonic() - started:.0f} s")
    leaks = [NAMES[key] for key, *_, leak in rows if leak]
    if leaks:
        print(f"bench_soak: grows over the run (a leak): {', '.join(leaks)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
