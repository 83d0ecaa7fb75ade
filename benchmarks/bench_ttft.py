#!/usr/bin/env python3
"""What the front door adds to one request, against an upstream whose own timing is known:

tests/fake_llama_server.py, supervised by the daemon with the front door on, streams ``/completion`` as
llama-server does (the headers at once, then one HTTP chunk per SSE event, ``--event-ms`` apart, the
first one ``--event-ms`` after the headers) and answers a non-streamed ``/completion`` at once. The same
requests go straight to its port and through the front door, rounds interleaved — each stream on a
connection of its own (llama-server, and the double, close the connection after a stream), the
non-streamed requests of each path on one keep-alive connection — so that the difference is the front
door's relay:

- time to first token (TTFT): the connect → the first SSE event's bytes received, p50 and p99;
- the whole stream (``--tokens`` events and the final one), p50;
- a non-streamed request's round trip, p50 and p99;
- the daemon's CPU time per request through the front door (user + system, from /proc: what the relay
  costs whatever the load; the timed rows above also hold the wake-ups of a shared host).

With ``--code NAME=DIR`` (repeatable) each tree's daemon runs beside the others, each with a double of
its own, and every round takes every path of every tree in a rotated order: the trees side by side in
one run (e.g. the code before and after a change).

    .venv/bin/python benchmarks/bench_ttft.py                       # make bench (~15 s)
    .venv/bin/python benchmarks/bench_ttft.py --code before=/tmp/before --code after=.   # two trees
    .venv/bin/python benchmarks/bench_ttft.py --rounds 1000 --gpu-watch   # on a GPU host: NVML watch on

Times are ``time.perf_counter()`` in this process. The front door runs in the daemon, another process on
the same cores: on a loaded host each hop costs a wake-up of the process it hands to, and the load
average printed at both ends says how much to trust the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_start import Tree  # noqa: E402
from harness import FAKE_SERVER, DaemonRun, base_sections, free_port, merge  # noqa: E402


def connect(port: int) -> http.client.HTTPConnection:
    """A keep-alive connection to ``port`` with TCP_NODELAY, as HTTP clients set it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.connect()
    assert conn.sock is not None
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def stream(port: int, tokens: int) -> tuple[float, float]:
    """One streamed ``/completion`` of ``tokens`` token events on a connection of its own (llama-server
    closes the connection after a stream): (seconds from the connect to the first event's bytes, to the
    end of the body)."""
    body = json.dumps({"prompt": "Hi", "n_predict": tokens, "stream": True})
    start = time.perf_counter()
    conn = connect(port)
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.read1(65536)  # returns as soon as any body bytes came
    ttft = time.perf_counter() - start
    if resp.status != 200 or not first.startswith(b"data: "):
        raise AssertionError(f"status {resp.status}, first bytes {first[:80]!r}")
    rest = resp.read()
    end = time.perf_counter() - start
    conn.close()
    if b'"stop": true' not in first + rest:
        raise AssertionError("the stream did not end with its final event")
    return ttft, end


def plain(conn: http.client.HTTPConnection) -> float:
    """One non-streamed ``/completion``: seconds from the request sent to its whole answer read."""
    start = time.perf_counter()
    conn.request("POST", "/completion", json.dumps({"prompt": "Hi", "n_predict": 1}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200 or b"timings" not in data:
        raise AssertionError(f"status {resp.status}: {data[:80]!r}")
    return time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def start_daemon(tree: Tree, args: argparse.Namespace) -> tuple[DaemonRun, int, int]:
    """``tree``'s daemon supervising a test double of its own, front door on: (the run, the double's
    port, the front door's port)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-ttft-{tree.name}-"))
    port, front = free_port(), free_port()
    model = tmp / "fake.gguf"  # the double loads nothing; the daemon checks that the file is there
    model.write_bytes(b"GGUF")
    sections = merge(base_sections(tmp, str(FAKE_SERVER), str(model), port), {
        "health": {"interval_s": 60.0, "canary": False},  # no probe between the measured requests
        "front": {"listen": f"127.0.0.1:{front}", "header_timeout_s": 600.0}})
    if args.gpu_watch:
        sections["gpu"] = {"enabled": "auto", "require_server_on_gpu": False}
    daemon = DaemonRun(tmp, sections, tree.env({"FAKE_LLAMA_EVENT_S": str(args.event_ms / 1000)}),
                       command=tree.command())
    daemon.start()
    daemon.wait_event("server_ready", 60.0)
    daemon.wait_event("front_listening", 10.0)
    return daemon, port, front


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=150, help="requests of each kind per path")
    ap.add_argument("--tokens", type=int, default=2, help="token events per stream")
    ap.add_argument("--event-ms", type=float, default=13.0,
                    help="the upstream's time before each event (ms; 13: a 27B-class model's decode on an H200)")
    ap.add_argument("--gpu-watch", action="store_true", help="the daemon watches GPU 0 through NVML")
    ap.add_argument("--code", action="append", default=[], help="NAME=DIR: a tree to measure (repeatable)")
    args = ap.parse_args()
    pairs = [c.split("=", 1) for c in args.code] or [["this", str(ROOT)]]
    trees = [Tree(name, Path(root), "off") for name, root in pairs]
    print(f"host {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; upstream "
          f"tests/fake_llama_server.py, one event every {args.event_ms:g} ms; GPU watch "
          f"{'on' if args.gpu_watch else 'off'}; trees: {', '.join(f'{t.name}={t.root}' for t in trees)}")
    for tree in trees:
        tree.byte_compile()
    runs: dict[str, tuple[DaemonRun, int, int]] = {}
    paths = [(tree.name, side) for tree in trees for side in ("direct", "front")]
    ttft: dict[tuple[str, str], list[float]] = {p: [] for p in paths}
    whole: dict[tuple[str, str], list[float]] = {p: [] for p in paths}
    trip: dict[tuple[str, str], list[float]] = {p: [] for p in paths}
    cpu_s: dict[str, float] = {}
    try:
        for tree in trees:
            runs[tree.name] = start_daemon(tree, args)
        conns = {(name, side): connect(port if side == "direct" else front)
                 for name, (_, port, front) in runs.items() for side in ("direct", "front")}
        for (name, side), conn in conns.items():  # warm every path (the front door's upstream pool included)
            _, port, front = runs[name]
            stream(port if side == "direct" else front, 1)
            plain(conn)
        procs = {name: psutil.Process(run.pid) for name, (run, _, _) in runs.items()}
        cpu_before = {name: sum(proc.cpu_times()[:2]) for name, proc in procs.items()}
        for i in range(args.rounds):
            for name, side in paths[i % len(paths):] + paths[:i % len(paths)]:  # a rotated order each round
                _, port, front = runs[name]
                first, end = stream(port if side == "direct" else front, args.tokens)
                ttft[(name, side)].append(first)
                whole[(name, side)].append(end)
                trip[(name, side)].append(plain(conns[(name, side)]))
        cpu_s = {name: sum(proc.cpu_times()[:2]) - cpu_before[name] for name, proc in procs.items()}
        for conn in conns.values():
            conn.close()
    finally:
        with contextlib.redirect_stdout(sys.stderr):  # the daemon's events: the table stays alone on stdout
            for run, _, _ in runs.values():
                run.stop()
    print(f"\n{args.rounds} rounds per path, interleaved (rotated order); streams of {args.tokens} token events")
    head = "".join(f"{f'{t.name} {c}':>16}" for t in trees for c in ("direct", "front", "added"))
    print(f"{'measurement':<32}{head}")
    print("-" * (32 + 48 * len(trees)))
    rows = [("TTFT p50 (ms)", ttft, 50), ("TTFT p99 (ms)", ttft, 99),
            ("whole stream p50 (ms)", whole, 50),
            ("non-streamed request p50 (ms)", trip, 50), ("non-streamed request p99 (ms)", trip, 99)]
    for label, values, q in rows:
        cells = ""
        for tree in trees:
            a, b = pct(values[(tree.name, "direct")], q) * 1000, pct(values[(tree.name, "front")], q) * 1000
            cells += f"{a:>16.2f}{b:>16.2f}{b - a:>+16.2f}"
        print(f"{label:<32}{cells}")
    for tree in trees:
        print(f"[{tree.name}] the daemon's CPU time (user + system) per request through the front door: "
              f"{cpu_s[tree.name] / (2 * args.rounds) * 1000:.3f} ms")
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
