#!/usr/bin/env python3
"""Supervision latencies of ``llama-guard run``, N rounds each:

1. server death (``kill -9`` by the bench) → the daemon's ``server_exited`` and the new ``server_starting``;
2. an OOM line (wall-clock emission time recorded by the fake server) → ``server_oom``, the event emitted
   in the same policy step as the SIGTERM to the server's group;
3. a stuck server (``SIGSTOP`` by the bench) → ``server_hang``, with the probe configuration printed;
4. restart overhead: ``kill -9`` → ``/health`` 200 again (the bench polls every 10 ms) minus a bare
   llama-server's own start → ``/health`` 200, both measured here in this run; beside them the same
   kill under a plain ``while :; do llama-server; done`` shell loop (the floor of any supervisor:
   systemd's ``Restart=always`` adds its own ``RestartSec`` on top);
5. ``llama-guard status`` (a fresh process: import, read the snapshot, print) against the live daemon.

1, 3 and 4 use the real llama-server and model (``$LLAMA_SERVER_BIN``, ``$LLAMA_GUARD_TEST_MODEL``; ``make bench``
sets them); 2 uses tests/fake_llama_server.py (a CPU cannot run out of GPU memory). The bench times its
own intervals with ``time.monotonic()``; against the daemon's event timestamps it uses ``time.time()``
(same host). Every round starts with the backoff at its initial value: the daemon runs with a short
``stable_after_s`` and the bench waits past it before the next fault. The kill -9 rounds run with the
shipped ``[health]`` defaults and take a bare start right before each kill (so both halves of the overhead
see the same load); the SIGSTOP rounds use fast probes (``--interval``, ``--timeout``, ``--strikes``).
On a shared machine the load average printed at both ends says how much to trust the figures.

    . .work/real/env && .venv/bin/python benchmarks/bench_supervision.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from benchlib import epoch, poll_health_200, print_table, sized  # noqa: E402
from harness import FAKE_SERVER, DaemonRun, base_sections, free_port, merge  # noqa: E402
from llama_guard.config import load_config  # noqa: E402
from llama_guard.config.argv import build_argv  # noqa: E402

Event = dict[str, Any]
# The shipped [health] defaults (config.HealthConfig), used for the restart rounds.
DEFAULT_PROBES: dict[str, object] = {"interval_s": 5.0, "timeout_s": 3.0, "canary_timeout_s": 30.0, "hang_strikes": 3}


def ts(event: Event) -> float:
    return epoch(event["timestamp"])


def wait_after(daemon: DaemonRun, anchor: Event, name: str, timeout: float = 30.0) -> Event:
    """The first event ``name`` logged after ``anchor``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = daemon.events()
        if anchor in events:
            for event in events[events.index(anchor) + 1:]:
                if event["event"] == name:
                    return event
        time.sleep(0.05)
    raise AssertionError(f"no {name} after {anchor['event']} within {timeout} s; events: {daemon.names()}")


def of_pid(pid: int) -> Any:
    return lambda e: e.get("server_pid") == pid


def settle(daemon: DaemonRun, pid: int, stable_after_s: float) -> None:
    """Wait until ``pid`` is ready and has stayed ready past ``stable_after_s`` (backoff back to initial)."""
    daemon.wait_event("server_ready", 60.0, where=of_pid(pid))
    time.sleep(stable_after_s + 0.3)


def bare_start(argv: list[str], port: int) -> tuple[float, float]:
    """A bare llama-server: seconds from exec to the first ``/health`` 200 (polled every 10 ms), and
    seconds from its ``kill -9`` (0.2 s later) to its reaping (the kernel's teardown, no supervisor)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        up = poll_health_200(port, t0)
        time.sleep(0.2)
    finally:
        t1 = time.monotonic()
        proc.kill()
        proc.wait()
    return up, time.monotonic() - t1


def shell_loop_rounds(argv: list[str], port: int, rounds: int) -> list[float]:
    """kill -9 of a llama-server restarted by ``while :; do llama-server ...; done`` → /health 200."""
    loop = subprocess.Popen(["sh", "-c", 'while :; do "$@"; done', "sh", *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    out = []
    try:
        poll_health_200(port, time.monotonic())
        for _ in range(rounds):
            child = _only_child(loop.pid)
            time.sleep(0.2)
            t0 = time.monotonic()
            os.kill(child, signal.SIGKILL)
            while _only_child(loop.pid) == child:  # the loop's next server is another pid
                time.sleep(0.001)
            out.append(poll_health_200(port, t0))
    finally:
        os.killpg(loop.pid, signal.SIGKILL)
        loop.wait()
    return out


def _only_child(pid: int) -> int:
    import psutil

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for child in psutil.Process(pid).children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.001)
    raise TimeoutError("the shell loop started no server")


def status_rounds(runtime_dir: Path, rounds: int) -> list[float]:
    """Seconds for ``python -m llama_guard status --runtime-dir DIR`` (a fresh process each)."""
    out = []
    for _ in range(rounds):
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "llama_guard", "status", "--runtime-dir", str(runtime_dir)],
                             capture_output=True, text=True, cwd=str(ROOT / "supervisor"), timeout=30)
        out.append(time.monotonic() - t0)
        if res.returncode != 0:
            raise AssertionError(f"llama-guard status failed: {res.stderr}")
    return out


def real_sections(tmp: Path, binary: str, model: str, port: int, args: argparse.Namespace,
                  health: dict[str, object]) -> dict[str, dict[str, object]]:
    return merge(base_sections(tmp, binary, model, port), {
        "health": health,
        "recovery": {"max_restarts": 1000, "stable_after_s": args.stable_after, "stop_grace_s": args.stop_grace},
        "log": {"level": "info", "format": "json"},
    })


def restart_rounds(args: argparse.Namespace, tmp: Path, binary: str, model: str) -> dict[str, list[float]]:
    """1 and 4, interleaved: each round a bare start, then a kill -9 of the supervised server."""
    out: dict[str, list[float]] = {k: [] for k in (
        "bare", "teardown", "exited", "restart", "spawn", "starting", "ready_event", "health200", "backoff",
        "shell_loop", "status")}
    port = free_port()
    daemon = DaemonRun(tmp, real_sections(tmp, binary, model, port, args, dict(DEFAULT_PROBES)))
    cfg = load_config(daemon.config)
    bare_port = free_port()
    bare_argv = build_argv(cfg.server.model_copy(update={"port": bare_port}), Path(binary))
    print(f"llama-server argv (daemon and bare, bare on another port): {' '.join(bare_argv)}", flush=True)
    bare_start(bare_argv, bare_port)  # warm-up (page cache), not counted
    daemon.start()
    try:
        pid = daemon.wait_event("server_starting", 60.0)["server_pid"]
        settle(daemon, pid, args.stable_after)
        for _ in range(args.rounds):
            up, teardown = bare_start(bare_argv, bare_port)
            out["bare"].append(up)
            out["teardown"].append(teardown)
            t_wall = time.time()
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            out["health200"].append(poll_health_200(port, t0))
            exited = daemon.wait_event("server_exited", 30.0, where=of_pid(pid))
            backoff = wait_after(daemon, exited, "server_backoff")
            restart = wait_after(daemon, exited, "server_restart")
            starting = wait_after(daemon, exited, "server_starting")
            pid = starting["server_pid"]
            ready = daemon.wait_event("server_ready", 60.0, where=of_pid(pid))
            out["exited"].append(ts(exited) - t_wall)
            out["starting"].append(ts(starting) - t_wall)
            out["restart"].append(ts(restart) - ts(exited))
            out["spawn"].append(ts(starting) - ts(restart))
            out["ready_event"].append(ts(ready) - t_wall)
            out["backoff"].append(float(backoff["backoff_s"]))
            settle(daemon, pid, args.stable_after)
        out["status"] = status_rounds(cfg.runtime.dir, args.rounds)
    finally:
        daemon.stop()
    out["shell_loop"] = shell_loop_rounds(bare_argv, bare_port, args.rounds)
    print(f"restart rounds done: bare starts {', '.join(f'{v * 1000:.0f}' for v in out['bare'])} ms; "
          f"kill -9 → /health 200 {', '.join(f'{v * 1000:.0f}' for v in out['health200'])} ms; "
          f"backoff_s {out['backoff']}", flush=True)
    return out


def hang_rounds(args: argparse.Namespace, tmp: Path, binary: str, model: str) -> dict[str, list[float]]:
    """3: SIGSTOP → server_hang; the stopped server then needs SIGKILL after the grace period."""
    out: dict[str, list[float]] = {"hang": [], "hang_strikes": [], "hang_to_stopped": []}
    port = free_port()
    probes = {"interval_s": args.interval, "timeout_s": args.timeout, "canary_timeout_s": args.canary_timeout,
              "hang_strikes": args.strikes}
    daemon = DaemonRun(tmp, real_sections(tmp, binary, model, port, args, probes))
    daemon.start()
    try:
        pid = daemon.wait_event("server_starting", 60.0)["server_pid"]
        settle(daemon, pid, args.stable_after)
        for _ in range(args.rounds):
            t_wall = time.time()
            os.kill(pid, signal.SIGSTOP)
            try:
                hang = daemon.wait_event("server_hang", 60.0, where=of_pid(pid))
                stopped = daemon.wait_event("server_stopped", 60.0, where=of_pid(pid))
            except AssertionError:
                os.kill(pid, signal.SIGKILL)
                raise
            out["hang"].append(ts(hang) - t_wall)
            out["hang_strikes"].append(float(hang["failures"]))
            out["hang_to_stopped"].append(ts(stopped) - ts(hang))
            pid = wait_after(daemon, stopped, "server_starting", 60.0)["server_pid"]
            settle(daemon, pid, args.stable_after)
    finally:
        daemon.stop()
    print("SIGSTOP rounds done", flush=True)
    return out


def trigger_completion(port: int) -> None:
    """POST /completion to the fake (it prints the OOM block and aborts: the connection just drops)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
    try:
        conn.request("POST", "/completion", body=b'{"prompt": "x", "n_predict": 1}',
                     headers={"Content-Type": "application/json"})
        conn.getresponse().read()
    except (OSError, http.client.HTTPException):
        pass
    finally:
        conn.close()


def marks_of(path: Path, pid: int) -> list[tuple[float, str]]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == str(pid):
            out.append((float(parts[1]), parts[2]))
    return out


def wait_mark(path: Path, pid: int, line: str, timeout: float = 10.0) -> float:
    """The fake's wall-clock emission time of ``line`` (it appends the mark just after the write)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [t for t, text in marks_of(path, pid) if text.strip() == line]
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no wall-clock mark for the OOM line {line!r} of pid {pid}")


def oom_rounds(args: argparse.Namespace, tmp: Path, model: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"line_to_read": [], "line_to_oom": [], "read_to_oom": []}
    port = free_port()
    marks = tmp / "marks.txt"
    sections = merge(base_sections(tmp, str(FAKE_SERVER), model, port), {
        # No liveness rounds during the measurement: the canary would trigger the OOM itself.
        "health": {"interval_s": 600.0},
        "recovery": {"max_restarts": 1000, "stable_after_s": args.stable_after},
        "log": {"level": "debug", "format": "json"},
    })
    daemon = DaemonRun(tmp, sections, env={"FAKE_LLAMA_FAULT": "oom_runtime", "FAKE_LLAMA_MARKS": str(marks)})
    daemon.start()
    try:
        pid = daemon.wait_event("server_starting", 60.0)["server_pid"]
        settle(daemon, pid, args.stable_after)
        for _ in range(args.rounds):
            trigger_completion(port)
            oom = daemon.wait_event("server_oom", 30.0, where=of_pid(pid))
            line = oom["line"]
            read = daemon.wait_event("server_line", 10.0,
                                     where=lambda e, p=pid, s=line: e.get("server_pid") == p
                                     and e["line"].strip() == s)
            emitted = wait_mark(marks, pid, line)
            out["line_to_read"].append(ts(read) - emitted)
            out["line_to_oom"].append(ts(oom) - emitted)
            out["read_to_oom"].append(ts(oom) - ts(read))
            pid = wait_after(daemon, oom, "server_starting", 30.0)["server_pid"]
            settle(daemon, pid, args.stable_after)
    finally:
        daemon.stop()
    return out


def server_version(binary: str) -> str:
    try:
        res = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    for line in (res.stdout + res.stderr).splitlines():
        if line.startswith("version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=sized(3, 2), help="rounds of each fault (3; CI 2)")
    ap.add_argument("--interval", type=float, default=0.5, help="[health].interval_s for the hang rounds")
    ap.add_argument("--timeout", type=float, default=1.0, help="[health].timeout_s")
    ap.add_argument("--canary-timeout", type=float, default=2.0, help="[health].canary_timeout_s")
    ap.add_argument("--strikes", type=int, default=2, help="[health].hang_strikes")
    ap.add_argument("--stable-after", type=float, default=1.0,
                    help="[recovery].stable_after_s (the bench waits past it between rounds)")
    ap.add_argument("--stop-grace", type=float, default=3.0, help="[recovery].stop_grace_s")
    args = ap.parse_args()
    binary = os.environ.get("LLAMA_SERVER_BIN", "")
    model = os.environ.get("LLAMA_GUARD_TEST_MODEL", "")
    if not (binary and Path(binary).is_file() and model and Path(model).is_file()):
        print("bench_supervision: set LLAMA_SERVER_BIN and LLAMA_GUARD_TEST_MODEL (`. .work/real/env`; "
              "`make real` builds them)", file=sys.stderr)
        return 2

    print(f"machine: {platform.node()}, nproc {len(os.sched_getaffinity(0))} (cpu_count {os.cpu_count()}), "
          f"{platform.machine()}, Python {platform.python_version()}")
    print(f"llama-server {server_version(binary)}, model {Path(model).name}, CPU only (n_gpu_layers 0, "
          f"ctx 1024, threads 2), [gpu] enabled off")
    print(f"daemon config: [recovery] backoff_initial_s 0.1 (default), stable_after_s {args.stable_after}, "
          f"stop_grace_s {args.stop_grace}, max_restarts 1000; [health] startup_poll_s 0.1 (default); "
          f"rounds {args.rounds}")
    print("  kill -9 rounds (1, 4): [health] " + ", ".join(f"{k} {v}" for k, v in DEFAULT_PROBES.items())
          + " (the shipped defaults); a bare start right before each kill, same argv, another port")
    print(f"  SIGSTOP rounds (3): [health] interval_s {args.interval}, timeout_s {args.timeout}, canary_timeout_s "
          f"{args.canary_timeout}, hang_strikes {args.strikes} (fast probes; see the bound below)")
    print("  OOM rounds (2): tests/fake_llama_server.py, FAKE_LLAMA_FAULT=oom_runtime, [health] interval_s 600 "
          "(no canary: the bench's own completion triggers the OOM), [log] level debug (server_line events)")
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-supervision-") as tmpdir:
        tmp = Path(tmpdir)
        for sub in ("restart", "hang", "fake"):
            (tmp / sub).mkdir()
        real = restart_rounds(args, tmp / "restart", binary, model)
        real.update(hang_rounds(args, tmp / "hang", binary, model))
        fake = oom_rounds(args, tmp / "fake", model)

    paired = [r - b for r, b in zip(real["health200"], real["bare"], strict=True)]
    print()
    print_table([
        ("1. bare server: kill -9 → reaped by its parent (kernel)", real["teardown"]),
        ("1. kill -9 → server_exited (death noticed)", real["exited"]),
        ("1.   server_exited → server_restart (backoff timer)", real["restart"]),
        ("1.   server_restart → server_starting (spawn: fork, exec)", real["spawn"]),
        ("1. kill -9 → server_starting (new server spawned)", real["starting"]),
        ("2. OOM line emitted → server_line (read, classified)", fake["line_to_read"]),
        ("2. OOM line emitted → server_oom (+ SIGTERM, same step)", fake["line_to_oom"]),
        ("2.   of which server_line → server_oom (queue, decide)", fake["read_to_oom"]),
        ("3. SIGSTOP → server_hang", real["hang"]),
        ("3.   server_hang → server_stopped (SIGTERM, grace, SIGKILL)", real["hang_to_stopped"]),
        ("4. bare llama-server start → /health 200", real["bare"]),
        ("4. kill -9 → /health 200 again (supervised)", real["health200"]),
        ("4. kill -9 → server_ready event", real["ready_event"]),
        ("4. restart overhead, per round (kill→200 − bare)", paired),
        ("4. kill -9 → /health 200, plain shell loop (no supervisor)", real["shell_loop"]),
        ("5. llama-guard status (fresh process)", real["status"]),
    ], title=f"supervision latencies, {args.rounds} rounds (ms)")
    med = statistics.median(real["health200"]) - statistics.median(real["bare"])
    loop_med = statistics.median(real["shell_loop"]) - statistics.median(real["bare"])
    print(f"\nrestart overhead = median(kill→200) − median(bare) = {med * 1000:.1f} ms "
          f"(target ≤ 50 ms: {'met' if med <= 0.05 else 'NOT met'}); a plain shell loop in the same run: "
          f"{loop_med * 1000:.1f} ms over bare (systemd Restart=always adds RestartSec, default 100 ms, to that)")
    print(f"llama-guard status: median {statistics.median(real['status']) * 1000:.0f} ms (target ≤ 150 ms)")
    print(f"backoff before each restart: {sorted(set(real['backoff']))} s; hang detected after "
          f"{sorted({int(s) for s in real['hang_strikes']})} failed rounds "
          f"(bound ≈ strikes × (interval + timeout) = {args.strikes * (args.interval + args.timeout):.1f} s when "
          f"/health is what fails)")
    print("2. is measured to server_oom: the policy emits it and the daemon sends SIGTERM to the group in the "
          "same decide() step, right after the event is written (no separate event marks the signal).")
    load = os.getloadavg()
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
          + ("  (other work shared the CPUs: the figures are noisy)" if load[0] > len(os.sched_getaffinity(0))
             else ""))
    print(f"total bench time {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
