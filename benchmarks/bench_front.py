#!/usr/bin/env python3
"""The cost of the front door, side by side in one run against one real llama-server:

1. streaming ``--tokens`` tokens through the front door vs straight to llama-server's private port
   (the same server, rounds interleaved so both see the same load): tokens/s and time to first token
   (TTFT, the first SSE event with content), p50 and p99, and a non-streamed one-token ``/completion``'s
   time (the whole answer), p50 and p99: their ratio / difference;
2. ``--streams`` concurrent streams through the front door: how many ended without an error
   (status 200 and ``data: [DONE]``);
3. ``kill -9`` of llama-server with nothing running, while ``--streams`` streams run through the front
   door, and while ``--idle`` idle connections are open to it: the decision latency (the kill → the
   daemon's ``server_exited`` event) and the watchdog's pace (the largest gap between two ``WATCHDOG=1``
   the daemon sent to our ``$NOTIFY_SOCKET`` during the window; ``WATCHDOG_USEC`` is 2 s), with what the
   cut streams' clients got (completed, cut with an SSE error, answered 5xx by the front door, or stuck:
   still open ``--give-up-s`` after the next server was ready). Part 3 says on stderr what it waits for
   every 10 s, and gives up on a wait with a message instead of hanging.

    . .work/real/env && .venv/bin/python benchmarks/bench_front.py    # CPU-sized defaults (make bench)
    # on a GPU host, the issue's figures:
    .venv/bin/python benchmarks/bench_front.py --server-bin /path/llama-server --model /path/model.gguf \\
        --gpu-layers 999 --tokens 256 --rounds 20 --parallel 4

The bench times its own intervals with ``time.monotonic()``; against the daemon's event timestamps it uses
``time.time()`` (same host). The load average printed at both ends says how much to trust the figures on a
shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import resource
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from benchlib import add_server_args, epoch, sized  # noqa: E402
from harness import DaemonRun, base_sections, free_port, merge  # noqa: E402

WATCHDOG_USEC = 2_000_000
PROGRESS_S = 10.0  # how often part 3 says what it is waiting for
T0 = time.monotonic()


def progress(message: str) -> None:
    """One line of part 3's progress, with the seconds since the bench started (stderr: the tables stay on stdout)."""
    print(f"[{time.monotonic() - T0:7.1f} s] {message}", file=sys.stderr, flush=True)


class NotifyCatcher:
    """The receiving end of ``$NOTIFY_SOCKET``: the arrival time (monotonic) of every ``WATCHDOG=1``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.pings: list[float] = []
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            if b"WATCHDOG=1" in data:
                self.pings.append(time.monotonic())

    def max_gap(self, start: float, end: float) -> float:
        inside = [t for t in self.pings if start <= t <= end]
        points = [start, *inside, end]
        return max(b - a for a, b in itertools.pairwise(points))

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        self.sock.close()


def stream(port: int, tokens: int, timeout: float = 600.0) -> dict[str, Any]:
    """One streamed ``/completion``: ttft (s), token events, decode tokens/s, whether it ended in [DONE]
    / an error event, the status."""
    body = {"prompt": "Write a long story about a lighthouse.", "n_predict": tokens, "ignore_eos": True,
            "stream": True, "cache_prompt": False}
    start = time.monotonic()
    times: list[float] = []
    done = error = False
    status = 0
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/completion", json=body, timeout=timeout) as resp:
            status = resp.status_code
            for line in resp.iter_lines():
                if line == "event: error":
                    error = True
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if data.get("content"):
                        times.append(time.monotonic())
                    if data.get("stop"):
                        done = True
    except httpx.HTTPError:
        error = True
    tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    return {"status": status, "ttft": times[0] - start if times else None, "tokens": len(times), "tps": tps,
            "done": done and not error, "error": error}


def plain(port: int, timeout: float = 600.0) -> float:
    """One non-streamed ``/completion`` of one token: seconds from the call to its whole answer."""
    body = {"prompt": "Write a long story about a lighthouse.", "n_predict": 1, "cache_prompt": False}
    start = time.monotonic()
    resp = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=timeout)
    resp.raise_for_status()
    return time.monotonic() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def wait_after(daemon: DaemonRun, name: str, after_wall: float, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in daemon.events():
            if event["event"] == name and epoch(event["timestamp"]) >= after_wall:
                return event
        time.sleep(0.02)
    raise AssertionError(f"no {name} after the kill within {timeout} s: {daemon.names()[-10:]}")


@contextlib.contextmanager
def idle_connections(port: int, n: int, daemon_pid: int) -> Iterator[None]:
    """``n`` client connections to the front door that never send a byte, once the daemon (``daemon_pid``)
    has accepted them all (main() raised RLIMIT_NOFILE for them before the daemon started, which inherits it)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            socks.append(sock)
        progress(f"{n} idle connections opened; waiting (at most 120 s) until the daemon has accepted them")
        start = time.monotonic()
        deadline, report = start + 120.0, start + PROGRESS_S
        while (fds := psutil.Process(daemon_pid).num_fds()) < n and time.monotonic() < deadline:
            if time.monotonic() >= report:  # past the kernel's accept queue a connect waits on SYN retries
                progress(f"the daemon holds {fds} file descriptors of the {n} idle connections")
                report += PROGRESS_S
            time.sleep(0.2)  # until the daemon has accepted them all: idle, not arriving
        if fds < n:
            progress(f"gave up waiting: the daemon holds {fds} file descriptors, not {n}; the idle column "
                     "measures that many (raise net.core.somaxconn / lower --idle)")
        time.sleep(1.0)
        yield
    finally:
        for sock in socks:
            sock.close()


def kill_round(daemon: DaemonRun, catcher: NotifyCatcher, streams: int, stream_tokens: int,
               front: int, give_up_s: float) -> dict[str, Any]:
    """kill -9 of the current server (with ``streams`` streams running through the front door when > 0);
    streams not ended ``give_up_s`` seconds after the next server is ready are counted as stuck."""
    ready = [e for e in daemon.events() if e["event"] == "server_ready"]
    pid = ready[-1]["server_pid"]
    pool = ThreadPoolExecutor(max(1, streams))
    futures = [pool.submit(stream, front, stream_tokens) for _ in range(streams)]
    if streams:
        time.sleep(2.0)  # let them connect and start
    start_mono, start_wall = time.monotonic(), time.time()
    ended_before = sum(f.done() for f in futures)
    progress(f"kill -9 of llama-server pid {pid} with {streams} streams running ({ended_before} already ended)")
    os.kill(pid, signal.SIGKILL)
    exited = wait_after(daemon, "server_exited", start_wall - 0.5)
    latency = epoch(exited["timestamp"]) - start_wall
    again = wait_after(daemon, "server_ready", start_wall, 120.0)
    progress(f"server_exited after {latency * 1000:.0f} ms; llama-server pid {again['server_pid']} ready "
             f"{epoch(again['timestamp']) - start_wall:.1f} s after the kill")
    deadline = time.monotonic() + give_up_s
    pending = set(futures)
    while pending and time.monotonic() < deadline:
        _, pending = wait_futures(pending, min(PROGRESS_S, max(0.0, deadline - time.monotonic())), FIRST_EXCEPTION)
        if pending:
            progress(f"{len(futures) - len(pending)} of {streams} streams ended, {len(pending)} still open")
    if pending:
        progress(f"gave up on {len(pending)} streams still open {give_up_s:g} s after the server was ready "
                 "(counted as stuck; --give-up-s)")
    results = [f.result() for f in futures if f not in pending]
    pool.shutdown(wait=False, cancel_futures=True)  # a stuck stream ends when daemon.stop() closes its connection
    end_mono = time.monotonic()
    return {"latency_s": latency, "watchdog_gap_s": catcher.max_gap(start_mono - 1.0, end_mono),
            "ok": sum(r["done"] for r in results), "cut": sum(r["error"] for r in results), "n": len(results),
            "refused": sum(r["status"] not in (0, 200) for r in results), "stuck": len(pending),
            "ended_before": ended_before}


def print_streaming(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]],
                    plains: dict[str, list[float]]) -> None:
    d_tps = [r["tps"] for r in runs["direct"]]
    f_tps = [r["tps"] for r in runs["front"]]
    d_ttft = [r["ttft"] for r in runs["direct"] if r["ttft"] is not None]
    f_ttft = [r["ttft"] for r in runs["front"] if r["ttft"] is not None]
    print(f"\n1. streaming {args.tokens} tokens, {args.rounds} rounds per path, interleaved")
    print(f"{'measurement':<28}{'direct':>12}{'front door':>12}{'front/direct':>14}")
    print("-" * 66)
    ratio = statistics.median(f_tps) / statistics.median(d_tps)
    print(f"{'tokens/s (median)':<28}{statistics.median(d_tps):>12.2f}{statistics.median(f_tps):>12.2f}"
          f"{ratio:>13.3f}x")
    for q in (50, 99):
        a, b = pct(d_ttft, q) * 1000, pct(f_ttft, q) * 1000
        print(f"{f'TTFT p{q} (ms)':<28}{a:>12.1f}{b:>12.1f}{b - a:>+12.1f}ms", flush=True)
    for q in (50, 99):
        a, b = pct(plains["direct"], q) * 1000, pct(plains["front"], q) * 1000
        print(f"{f'1 token, no stream p{q} (ms)':<28}{a:>12.1f}{b:>12.1f}{b - a:>+12.1f}ms", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(ap, ctx=4096, threads=os.cpu_count() or 2)
    ap.add_argument("--parallel", type=int, default=4)
    # Defaults fit a 2-core CPU host (`make bench`); on a GPU host: --tokens 256 --rounds 20.
    ap.add_argument("--tokens", type=int, default=16, help="tokens per stream of part 1 (the issue's figure: 256)")
    ap.add_argument("--rounds", type=int, default=sized(6, 3), help="streams per path in part 1 (6; CI 3)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--stream-tokens", type=int, default=2, help="tokens per stream of parts 2 and 3")
    ap.add_argument("--idle", type=int, default=10_000, help="idle client connections of part 3's last column")
    ap.add_argument("--give-up-s", type=float, default=300.0,
                    help="part 3: how long after the restart a stream may still run before it counts as stuck")
    args = ap.parse_args()
    if not (args.server_bin and args.model):
        ap.error("--server-bin and --model (or $LLAMA_SERVER_BIN, $LLAMA_GUARD_TEST_MODEL) are needed")
    print(f"host {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; "
          f"server {args.server_bin}, model {Path(args.model).name}, -ngl {args.gpu_layers}, -np {args.parallel}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.idle + 1024  # this process and the daemon (which inherits it) each hold the idle connections
    if hard != resource.RLIM_INFINITY and hard < want:
        ap.error(f"--idle {args.idle} needs RLIMIT_NOFILE {want}; the hard limit is {hard} (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    tmp = Path(tempfile.mkdtemp(prefix="bench-front-"))
    port, front = free_port(), free_port()
    sections = merge(base_sections(tmp, args.server_bin, args.model, port), {
        "server": {"n_gpu_layers": args.gpu_layers, "ctx_size": args.ctx, "parallel": args.parallel,
                   "threads": args.threads},
        # No canary: its completion would queue between the measured streams (the shipped liveness rounds
        # otherwise: /health, /slots, /metrics every 5 s).
        "health": {"interval_s": 5.0, "timeout_s": 3.0, "canary": False, "hang_strikes": 3,
                   "load_timeout_s": 600.0},
        "recovery": {"stable_after_s": 1.0, "max_restarts": 10},
        "log": {"level": "info"},
        "front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": 300.0, "header_timeout_s": 600.0}})
    if args.gpu_layers:
        sections["gpu"] = {"enabled": "auto", "require_server_on_gpu": False}
    catcher = NotifyCatcher(tmp / "notify.sock")
    daemon = DaemonRun(tmp, sections, env={"NOTIFY_SOCKET": str(catcher.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the daemon below
    daemon.start()
    try:
        daemon.wait_event("server_ready", 600.0)
        stream(port, 4)
        stream(front, 4)  # warm both paths
        runs: dict[str, list[dict[str, Any]]] = {"direct": [], "front": []}
        plains: dict[str, list[float]] = {"direct": [], "front": []}
        for i in range(args.rounds):
            order = ("direct", "front") if i % 2 == 0 else ("front", "direct")
            for path in order:
                runs[path].append(stream(port if path == "direct" else front, args.tokens))
                plains[path].append(plain(port if path == "direct" else front))
        print_streaming(args, runs, plains)
        with ThreadPoolExecutor(args.streams) as pool:
            many = list(pool.map(lambda _: stream(front, args.stream_tokens), range(args.streams)))
        ok = sum(r["done"] for r in many)
        print(f"\n2. {args.streams} concurrent streams of {args.stream_tokens} tokens through the front door: "
              f"{ok} ended with [DONE], {args.streams - ok} with an error", flush=True)
        quiet = kill_round(daemon, catcher, 0, args.stream_tokens, front, args.give_up_s)
        time.sleep(2.0)
        busy = kill_round(daemon, catcher, args.streams, args.stream_tokens, front, args.give_up_s)
        time.sleep(2.0)
        with idle_connections(front, args.idle, daemon.pid):
            idle = kill_round(daemon, catcher, 0, args.stream_tokens, front, args.give_up_s)
    finally:
        daemon.stop()
        catcher.close()
    print(f"\n3. kill -9 of llama-server (WATCHDOG_USEC {WATCHDOG_USEC / 1e6:g} s)")
    print(f"{'measurement':<44}{'no traffic':>14}{f'{args.streams} streams':>14}{f'{args.idle} idle':>14}")
    print("-" * 86)
    print(f"{'kill -9 -> server_exited (ms)':<44}{quiet['latency_s'] * 1000:>14.1f}{busy['latency_s'] * 1000:>14.1f}"
          f"{idle['latency_s'] * 1000:>14.1f}")
    print(f"{'largest watchdog gap around it (ms)':<44}{quiet['watchdog_gap_s'] * 1000:>14.0f}"
          f"{busy['watchdog_gap_s'] * 1000:>14.0f}{idle['watchdog_gap_s'] * 1000:>14.0f}")
    outcome = f"{busy['ok']} / {busy['cut']} / {busy['refused']} / {busy['stuck']}"
    print(f"{'streams: completed / cut / 5xx / stuck':<44}{'-':>14} {outcome:>13}{'-':>14}")  # a space: it may fill
    if busy["ended_before"]:
        print(f"({busy['ended_before']} of the {args.streams} streams had ended before the kill: "
              "raise --stream-tokens)")
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
