"""Cost of one usage sample of a real child process (fd count, threads, connections, cgroup).

Spawns a Python child that holds ``--fds`` open files, ``--threads`` threads and ``--conns``
loopback TCP connection pairs (a stand-in for a busy llama-server) — or, with ``--server BIN
--model GGUF``, a real llama-server to which a helper process holds ``--conns`` keep-alive
connections (each re-used every 2 s, inside the server's 5 s keep-alive, and replaced when the server
ends it) — then times each part of
:meth:`llama_guard.limits.usage.UsageSampler.sample` ``--n`` times and prints, per part, the median and
90th percentile wall time in µs, the mean CPU time in µs (``time.process_time``; the mean, not
the median, because the default sampler counts connections only every 6th sample), and the CPU
seconds per hour at the sampling interval (default: ``[limits].sample_interval_s``).

    .venv/bin/python benchmarks/bench_usage_sample.py [--n 2000] [--fds 200] [--threads 20] [--conns 16]
    .venv/bin/python benchmarks/bench_usage_sample.py --server "$LLAMA_SERVER_BIN" \
        --model "$LLAMA_GUARD_TEST_MODEL" [--conns 200] [--n 2000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

from llama_guard.config.sections import LimitsConfig
from llama_guard.limits.own import cgroup_pids
from llama_guard.limits.readback import read_limits
from llama_guard.limits.usage import UsageSampler, sample_cost_per_hour

CHILD = textwrap.dedent("""
    import socket, sys, threading, time
    n_fds, n_threads, n_conns = map(int, sys.argv[1:4])
    stop = threading.Event()
    for _ in range(n_threads):
        threading.Thread(target=stop.wait, daemon=True).start()
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(max(n_conns, 1))
    pairs = []
    for _ in range(n_conns):
        c = socket.create_connection(srv.getsockname()); a, _ = srv.accept(); pairs.append((c, a))
    files = [open("/dev/null") for _ in range(n_fds)]
    print("ready", flush=True)
    time.sleep(3600)
""")

# Holds n keep-alive connections to a llama-server on a port, one request on each every 2 s.
HOLDER = textwrap.dedent("""
    import socket, sys, time
    port, n = int(sys.argv[1]), int(sys.argv[2])
    req = b"GET /health HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: keep-alive\\r\\n\\r\\n"
    def connect():
        return socket.create_connection(("127.0.0.1", port), timeout=10)
    socks = [connect() for _ in range(n)]
    def touch():  # the server closes a connection after a few requests: replace it
        for i, s in enumerate(socks):
            try:
                s.sendall(req)
                if s.recv(4096):
                    continue
            except OSError:
                pass
            s.close()
            socks[i] = connect()
            socks[i].sendall(req); socks[i].recv(4096)
    touch()
    print("ready", flush=True)
    while True:
        time.sleep(2.0)
        touch()
""")


def start_server(binary: str, model: str) -> tuple[subprocess.Popen[str], int]:
    """A real llama-server (CPU, 2 threads) on a free port, once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    server = subprocess.Popen([binary, "--model", model, "--host", "127.0.0.1", "--port", str(port),
                               "--n-gpu-layers", "0", "--ctx-size", "1024", "--threads", "2", "--metrics"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if c.recv(64).startswith(b"HTTP/1.1 200"):
                    return server, port
        except OSError:
            pass
        if server.poll() is not None:
            break
        time.sleep(0.2)
    server.kill()
    raise SystemExit(f"llama-server did not become ready (exit {server.poll()})")


def measure(fn: Callable[[], object], n: int) -> tuple[float, float, float]:
    """(median wall µs, p90 wall µs, mean CPU µs) of ``fn`` over ``n`` calls after a warm-up."""
    for _ in range(min(50, n)):
        fn()
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(n):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        w1, c1 = time.perf_counter(), time.process_time()
        wall.append((w1 - w0) * 1e6)
        cpu.append((c1 - c0) * 1e6)
    wall.sort()
    return statistics.median(wall), wall[int(0.9 * (len(wall) - 1))], statistics.fmean(cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="samples per row (median of N)")
    parser.add_argument("--fds", type=int, default=200, help="files the child holds open")
    parser.add_argument("--threads", type=int, default=20, help="extra threads in the child")
    parser.add_argument("--conns", type=int, default=16, help="loopback connection pairs in the child")
    parser.add_argument("--interval", type=float, default=LimitsConfig().sample_interval_s,
                        help="sampling interval in seconds (default: [limits].sample_interval_s)")
    parser.add_argument("--server", help="sample a real llama-server binary instead of a Python child")
    parser.add_argument("--model", help="the GGUF model for --server")
    args = parser.parse_args()

    helpers: list[subprocess.Popen[str]] = []
    if args.server:
        if not args.model:
            parser.error("--server needs --model")
        child, port = start_server(args.server, args.model)
        helpers.append(child)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), str(args.conns)],
                                  stdout=subprocess.PIPE, text=True)
        helpers.append(holder)
        ready_from = holder
    else:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(args.fds), str(args.threads), str(args.conns)],
                                 stdout=subprocess.PIPE, text=True)
        helpers.append(child)
        ready_from = child
    try:
        assert ready_from.stdout is not None
        if ready_from.stdout.readline().strip() != "ready":
            print("child did not start", file=sys.stderr)
            return 1
        full = UsageSampler(child.pid, connections_every=1)
        lean = UsageSampler(child.pid, connections=False)
        default = UsageSampler(child.pid)
        proc = full._proc  # the same psutil.Process the sampler keeps
        first = full.sample()
        rows: list[tuple[str, Callable[[], object]]] = [
            ("num_fds (/proc/<pid>/fd)", proc.num_fds),
            ("num_threads (/proc/<pid>/stat)", proc.num_threads),
            ("net_connections inet (/proc/net/tcp*)", lambda: proc.net_connections(kind="inet")),
            ("cgroup pids.max/current", lambda: cgroup_pids(child.pid)),
            ("read_limits (prlimit)", lambda: read_limits(child.pid)),
            ("sample(), no connections", lean.sample),
            ("sample(), connections every time", full.sample),
            ("sample(), default (conns every 6th)", default.sample),
        ]
        what = f"llama-server {os.path.basename(args.model)}" if args.server else "Python child"
        print(f"{what} pid {child.pid}: {first.fds} fds, {first.threads} threads, {first.connections} inet "
              f"connections; N = {args.n}; interval {args.interval:g} s; Python {sys.version.split()[0]}; "
              f"{os.cpu_count()} CPUs")
        header = f"{'part':<40} {'median µs':>10} {'p90 µs':>10} {'mean CPU µs':>12} {'CPU s/hour':>11}"
        print(header)
        print("-" * len(header))
        for name, fn in rows:
            med, p90, cpu = measure(fn, args.n)
            per_hour = sample_cost_per_hour(cpu / 1e6, args.interval)
            print(f"{name:<40} {med:>10.1f} {p90:>10.1f} {cpu:>12.1f} {per_hour:>11.4f}")
    finally:
        for helper in reversed(helpers):
            helper.kill()
            helper.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
