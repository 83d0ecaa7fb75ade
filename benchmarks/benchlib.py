"""Small helpers shared by the benchmarks (not a benchmark itself: the Makefile runs ``bench_*.py``)."""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import time
from datetime import datetime

#: ``BENCH_SIZE=ci`` (``.ci/run``, ``make bench-ci``): every benchmark runs its CI size — fewer rounds, the same
#: measurements and the same printed tables; unset (or ``full``), the sizes a user gets by default.
BENCH_SIZE_ENV = "BENCH_SIZE"


def sized(full: int, ci: int) -> int:
    """A benchmark's default count: ``full`` for a user, ``ci`` under ``BENCH_SIZE=ci``; an explicit
    command-line value always wins. Fails on any other ``BENCH_SIZE`` (a typo must not run the long size)."""
    size = os.environ.get(BENCH_SIZE_ENV, "full")
    if size not in ("full", "ci"):
        raise SystemExit(f"{BENCH_SIZE_ENV}={size!r}: expected 'full' or 'ci'")
    return ci if size == "ci" else full


def add_server_args(parser: argparse.ArgumentParser, *, ctx: int, threads: int) -> None:
    """The options of a benchmark that starts the real llama-server: ``--server-bin`` and ``--model``
    (defaults: ``$LLAMA_SERVER_BIN``, else ``llama-server`` on PATH, and ``$LLAMA_GUARD_TEST_MODEL``, as
    the tests take them), ``--gpu-layers`` (default 0), ``--ctx`` (tokens) and ``--threads``."""
    parser.add_argument("--server-bin", default=os.environ.get("LLAMA_SERVER_BIN", "llama-server"))
    parser.add_argument("--model", default=os.environ.get("LLAMA_GUARD_TEST_MODEL", ""))
    parser.add_argument("--gpu-layers", type=int, default=0)
    parser.add_argument("--ctx", type=int, default=ctx)
    parser.add_argument("--threads", type=int, default=threads)


def epoch(iso: str) -> float:
    """``time.time()`` seconds of a daemon event's ISO ``timestamp`` (naive local time, as structlog writes it)."""
    return datetime.fromisoformat(iso).timestamp()


def health_status(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> int | None:
    """The HTTP status of ``GET /health`` on a fresh connection; None when nothing answers."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def poll_health_200(port: int, start: float, *, every_s: float = 0.01, timeout_s: float = 60.0) -> float:
    """Poll ``/health`` every ``every_s`` until it answers 200; seconds since monotonic ``start``."""
    deadline = start + timeout_s
    next_poll = time.monotonic()
    while True:
        if health_status(port) == 200:
            return time.monotonic() - start
        next_poll += every_s
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"/health on port {port} not 200 within {timeout_s} s")
        if next_poll > now:
            time.sleep(next_poll - now)
        else:
            next_poll = now


def stats_ms(values_s: list[float]) -> tuple[float, float, float]:
    """(median, min, max) in milliseconds of seconds ``values_s``."""
    ms = [v * 1000 for v in values_s]
    return statistics.median(ms), min(ms), max(ms)


def print_table(rows: list[tuple[str, list[float]]], title: str = "") -> None:
    """One row per measurement: name, n, median / min / max in ms (values given in seconds)."""
    width = max(len(name) for name, _ in rows)
    if title:
        print(title)
    head = f"{'measurement':<{width}}  {'n':>3}  {'median ms':>10}  {'min ms':>10}  {'max ms':>10}"
    print(head)
    print("-" * len(head))
    for name, values in rows:
        if not values:
            print(f"{name:<{width}}  {0:>3}  {'-':>10}  {'-':>10}  {'-':>10}")
            continue
        med, lo, hi = stats_ms(values)
        print(f"{name:<{width}}  {len(values):>3}  {med:>10.1f}  {lo:>10.1f}  {hi:>10.1f}")
