#!/usr/bin/env python3
"""Start-up and restart cost of ``llama-guard run`` with the GPU watch on, against llama-server's own load.

Each round, for every code tree given (``--code NAME=DIR``, rotated order; default: this checkout), on ONE
port, one after the other:

1. ``bare``: llama-server alone (the argv llama-guard builds), exec → first ``/health`` 200 (polled every
   10 ms): the server's own load time;
2. a fresh daemon (``[gpu].enabled = "on"``, no ``[gpu].expected_vram_mib``, so nothing about the model's
   VRAM need is known yet): daemon exec → ``server_starting`` (``spawn``), ``daemon_started`` →
   ``server_starting`` (the daemon's own share, without Python's start-up), exec → ``/health`` 200;
3. ``kill -9`` of the server → ``/health`` 200 again;
4. a planned restart (SIGUSR1, what ``llama-guard restart`` sends) 1 s after ready → ``/health`` not 200
   → 200 again (the time the API was away);
5. the daemon is stopped (SIGTERM);
6. a daemon with the front door on and the KV carry-over off (no slot save between the drain and the
   SIGTERM): three completions through it, then (0.3 s later) a planned restart → the old server's
   ``server_stopped`` (``front door restart: SIGUSR1→old server gone``): what the drained server's exit
   waits for when clients just left (the pool's idle keep-alive connections, the daemon's own requests
   still open at the SIGTERM).

Then a failing start loop per tree: the same model, a llama-server stand-in that is killed (SIGKILL, as by the
kernel's OOM killer) as it starts: retried every time (a bad model file, or the same crash twice before ready,
would be a configuration error, exit 78),
``[recovery].backoff_factor = 1`` so every wait is ``backoff_initial_s``; per start, the daemon's cost is
``server_starting`` − the previous ``server_exited`` − that backoff.

Before the rounds, llama-server's own exit (signal → reaped, ``--rounds`` times each): SIGTERM with an idle
keep-alive HTTP connection open to it, SIGTERM with none, SIGKILL.

Each tree's ``supervisor/`` is byte-compiled first (as an install does): with ``PYTHONDONTWRITEBYTECODE=1``
in the environment a source tree would otherwise be compiled again at every start. The ``(event)`` rows
are the daemon's own ``restart_to_ready_s`` (trees that report it). The daemon's share, whatever the
server's load takes (a loaded host's load times vary by seconds from round to round): ``kill -9→spawn``,
``old server gone→spawn``, ``start→spawn`` and ``listening line→server_ready`` (the server's
``listening on`` line as the daemon read it, to ``server_ready``; events at debug level).

``overhead`` rows subtract the same round's bare load. Goal: each overhead ≤ 100 ms, the first start
included, whatever the model's size.

GPU watch: ``--nvml fake`` (this CPU host: tests/run_with_fake_nvml.py, the NVML test double, with a
CPU llama-server; ``require_server_on_gpu`` off since the double does not list a real server) or
``--nvml real`` (a GPU host: pynvml, and the server must appear on the GPU before it is ready).

    . .work/real/env && .venv/bin/python benchmarks/bench_start.py --rounds 5
    python3 benchmarks/bench_start.py --nvml real --ngl 99 --ctx 8192 --binary B --model M \\
        --code before=/tmp/main --code after=. --json out.json          # a GPU host
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks"), str(ROOT / "supervisor")]

from benchlib import epoch, health_status, poll_health_200, print_table, sized  # noqa: E402
from harness import DaemonRun, free_port  # noqa: E402

Event = dict[str, Any]
LISTENING = "listening on http"  # llama-server's line as its HTTP server begins answering


def ts(event: Event) -> float:
    return epoch(event["timestamp"])


class Tree:
    """One code tree to measure: its supervisor/ on PYTHONPATH, its own NVML double when faked."""

    def __init__(self, name: str, root: Path, nvml: str) -> None:
        self.name, self.root, self.nvml = name, root.resolve(), nvml

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        paths = [str(self.root / "supervisor"), str(self.root / "tests"), os.environ.get("PYTHONPATH", "")]
        return {"PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}

    def byte_compile(self) -> None:
        """Byte-compile the tree's ``supervisor/`` (as an install does): with ``PYTHONDONTWRITEBYTECODE=1``
        in the environment a source tree would otherwise be compiled again at every start."""
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(self.root / "supervisor")],
                       check=True, stdout=subprocess.DEVNULL)

    def command(self) -> list[str]:
        if self.nvml == "fake":
            return [sys.executable, str(self.root / "tests" / "run_with_fake_nvml.py")]
        return [sys.executable, "-m", "llama_guard"]


def sections(args: argparse.Namespace, tmp: Path, model: str, port: int) -> dict[str, dict[str, object]]:
    server: dict[str, object] = {"binary": args.binary, "model": model, "port": port, "n_gpu_layers": args.ngl,
                                 "ctx_size": args.ctx, "parallel": 1, "batch_size": 512, "ubatch_size": 256,
                                 "cache_type_k": args.ctk, "cache_type_v": args.ctk, "flash_attn": args.fa,
                                 "threads": args.threads, "env": {}}
    gpu: dict[str, object] = {"enabled": "off" if args.nvml == "off" else "on",
                              "require_server_on_gpu": args.nvml == "real", "enable_persistence": False}
    recovery: dict[str, object] = {"backoff_initial_s": 0.1, "backoff_factor": 1.0, "max_restarts": 1000,
                                   "restart_window_s": 60.0, "stable_after_s": 1.0, "stop_grace_s": 5.0}
    if args.nvml == "real":
        # Never a real reset here: the stub only records its argv.
        recovery["reset_command"] = [sys.executable, str(ROOT / "scripts" / "stub_gpu_reset.py"),
                                     str(tmp / "reset-argv.txt"), "{index}"]
    return {"server": server, "gpu": gpu, "recovery": recovery,
            "health": {"load_timeout_s": 600.0}, "schedule": {"restart_cron": ""},
            "log": {"level": "debug", "format": "json"}, "runtime": {"dir": str(tmp / "run")}}


def daemon(tree: Tree, tmp: Path, secs: dict[str, dict[str, object]], script: Path) -> DaemonRun:
    tmp.mkdir(parents=True, exist_ok=True)
    return DaemonRun(tmp, secs, env=tree.env({"FAKE_NVML_SCRIPT": str(script)}), command=tree.command())


def quiet_stop(run: DaemonRun) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        run.stop()


def bare_load(argv: list[str], port: int) -> float:
    """exec → /health 200 of a bare llama-server; then killed and reaped."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        return poll_health_200(port, t0, timeout_s=600)
    finally:
        proc.kill()
        proc.wait()
        wait_port_free(port)


def exit_times(argv: list[str], port: int, rounds: int) -> dict[str, list[float]]:
    """A bare llama-server's exit, signal → reaped: SIGTERM with an idle keep-alive HTTP connection
    open to it (what a probe client with a connection pool leaves), SIGTERM with none, SIGKILL."""
    out: dict[str, list[float]] = {"bare exit: SIGTERM, idle keep-alive open": [],
                                   "bare exit: SIGTERM, no idle connection": [], "bare exit: SIGKILL": []}
    for _ in range(rounds):
        for key, sig, keep in (("bare exit: SIGTERM, idle keep-alive open", signal.SIGTERM, 1),
                               ("bare exit: SIGTERM, no idle connection", signal.SIGTERM, 0),
                               ("bare exit: SIGKILL", signal.SIGKILL, 0)):
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                poll_health_200(port, time.monotonic(), timeout_s=600)
                with httpx.Client(limits=httpx.Limits(max_keepalive_connections=keep)) as client:
                    client.get(f"http://127.0.0.1:{port}/health", timeout=10)
                    t0 = time.monotonic()
                    proc.send_signal(sig)
                    proc.wait(60)
                    out[key].append(time.monotonic() - t0)
            finally:
                proc.kill()
                proc.wait()
                wait_port_free(port)
    return out


def wait_port_free(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while health_status(port) is not None and time.monotonic() < deadline:
        time.sleep(0.01)


def unavailable(port: int, t0: float, timeout_s: float = 600.0) -> tuple[float, float]:
    """Poll /health every 10 ms from ``t0``: (seconds until it was first not 200, seconds it stayed so)."""
    down = None
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        ok = health_status(port, timeout_s=0.2) == 200
        now = time.monotonic()
        if not ok and down is None:
            down = now
        if ok and down is not None:
            return down - t0, now - down
        time.sleep(0.01)
    raise TimeoutError("/health did not go down and come back")


def own(out: dict[str, list[float]], key: str, ready: Event) -> None:
    """The daemon's own figure of a restart (``server_ready``'s ``restart_to_ready_s``; a tree from
    before it existed has none)."""
    if isinstance(ready.get("restart_to_ready_s"), (int, float)):
        out[key].append(float(ready["restart_to_ready_s"]))


def ready_lags(events: list[Event]) -> list[float]:
    """Per server: its ``listening on`` line (as the daemon read it) → its ``server_ready``: how long
    the daemon took to see a server that could answer (independent of how long the load took)."""
    lags = []
    for ready in (e for e in events if e["event"] == "server_ready"):
        pid = ready["server_pid"]
        line = next((e for e in events if e["event"] == "server_line" and e.get("server_pid") == pid
                     and LISTENING in str(e.get("line", ""))), None)
        if line is not None:
            lags.append(ts(ready) - ts(line))
    return lags


def one_round(tree: Tree, args: argparse.Namespace, tmp: Path, port: int, script: Path, out: dict[str, list[float]],
              argv: list[str]) -> None:
    out["bare"].append(bare_load(argv, port))
    run = daemon(tree, tmp, sections(args, tmp, args.model, port), script)
    t_wall, t0 = time.time(), time.monotonic()
    run.start()
    try:
        out["start→/health 200"].append(poll_health_200(port, t0, timeout_s=600))
        starting = run.wait_event("server_starting", 60.0)
        started = run.wait_event("daemon_started", 5.0)
        pid = starting["server_pid"]
        run.wait_event("server_ready", 60.0, where=lambda e: e.get("server_pid") == pid)
        out["start→spawn"].append(ts(starting) - t_wall)
        out["daemon_started→spawn"].append(ts(starting) - ts(started))
        time.sleep(1.0)
        t_kill, t0 = time.time(), time.monotonic()
        os.kill(pid, signal.SIGKILL)
        out["kill -9→/health 200"].append(poll_health_200(port, t0, timeout_s=600))
        respawn = run.wait_event("server_starting", 60.0, skip=1)
        out["kill -9→spawn"].append(ts(respawn) - t_kill)
        pid = respawn["server_pid"]
        ready = run.wait_event("server_ready", 60.0, where=lambda e: e.get("server_pid") == pid)
        own(out, "kill -9: restart_to_ready_s (event)", ready)
        time.sleep(1.0)
        t_usr1, t0 = time.time(), time.monotonic()
        os.kill(run.pid, signal.SIGUSR1)  # what `llama-guard restart` sends (the fake-NVML runner has another argv)
        _, away = unavailable(port, t0)
        out["restart: API away"].append(away)
        own(out, "restart: restart_to_ready_s (event)", run.wait_event("server_ready", 60.0, skip=2))
        stopped = run.wait_event("server_stopped", 10.0)
        out["restart: SIGUSR1→old server gone"].append(ts(stopped) - t_usr1)
        out["restart: old server gone→spawn"].append(ts(run.wait_event("server_starting", 10.0, skip=2))
                                                     - ts(stopped))
        out["listening line→server_ready"] += ready_lags(run.events())
    finally:
        quiet_stop(run)
        wait_port_free(port)
        if args.events_dir is not None and not (args.events_dir / f"events-{tree.name}.jsonl").exists():
            args.events_dir.mkdir(parents=True, exist_ok=True)  # one round's daemon events, for a replay
            (args.events_dir / f"events-{tree.name}.jsonl").write_text("".join(
                json.dumps(e) + "\n" for e in run.events() if e["event"] != "server_line"))
    out["front door restart: SIGUSR1→old server gone"].append(front_restart(tree, args, tmp / "front", port, script))
    bare = out["bare"][-1]
    out["overhead: first start"].append(out["start→/health 200"][-1] - bare)
    out["overhead: kill -9"].append(out["kill -9→/health 200"][-1] - bare)
    out["overhead: restart"].append(out["restart: API away"][-1] - bare)


def front_restart(tree: Tree, args: argparse.Namespace, tmp: Path, port: int, script: Path) -> float:
    """Step 6: SIGUSR1 → the old server's ``server_stopped`` (seconds), the front door on, the carry-over
    off, three completions through it answered just before."""
    front = free_port()
    secs = sections(args, tmp, args.model, port)
    secs["front"] = {"listen": f"127.0.0.1:{front}"}
    secs["slots"] = {"enabled": False}
    run = daemon(tree, tmp, secs, script)
    run.start()
    try:
        run.wait_event("server_ready", 600.0)
        with httpx.Client() as client:
            for _ in range(3):
                client.post(f"http://127.0.0.1:{front}/completion", json={"prompt": "hi", "n_predict": 1}, timeout=600)
        time.sleep(0.3)
        t_usr1 = time.time()
        os.kill(run.pid, signal.SIGUSR1)
        return ts(run.wait_event("server_stopped", 60.0)) - t_usr1
    finally:
        quiet_stop(run)
        wait_port_free(port)


CRASHER = """#!/bin/sh
# llama-server's --help/--version answer as the real one; a start is killed at once (SIGKILL, as by the
# kernel's OOM killer: retried, never taken for a deterministic boot failure).
case " $* " in *" --help "*|*" --version "*) exec "{real}" "$@";; esac
kill -KILL $$
"""


def crasher(real: str, path: Path) -> Path:
    """A stand-in llama-server that crashes as it starts (what a failing start loop restarts)."""
    path.write_text(CRASHER.format(real=real))
    path.chmod(0o755)
    return path


def failing_loop(tree: Tree, args: argparse.Namespace, tmp: Path, port: int, script: Path, bad: Path,
                 argv_bad: list[str]) -> dict[str, list[float]]:
    t0 = time.monotonic()
    proc = subprocess.run(argv_bad, capture_output=True, timeout=120, check=False)
    bare_fail = time.monotonic() - t0
    secs = sections(args, tmp, args.model, port)
    secs["server"]["binary"] = str(bad)
    run = daemon(tree, tmp, secs, script)
    run.start()
    try:
        run.wait_event("server_starting", 120.0, skip=args.fail_starts)
    finally:
        events = run.events()
        quiet_stop(run)
    cost, server_s = [], []
    starts = [e for e in events if e["event"] == "server_starting"]
    for first, nxt in itertools.pairwise(starts):
        between = events[events.index(first):events.index(nxt)]
        exited = next(e for e in between if e["event"] == "server_exited")
        backoff = next((float(e["backoff_s"]) for e in between if e["event"] == "server_backoff"), 0.0)
        cost.append(ts(nxt) - ts(exited) - backoff)
        server_s.append(ts(exited) - ts(first))
    return {"failing start: daemon cost per start": cost, "failing start: server start→exit": server_s,
            "failing start: bare server exec→exit": [bare_fail], "_bare_rc": [float(proc.returncode)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=os.environ.get("LLAMA_SERVER_BIN", ""))
    ap.add_argument("--model", default=os.environ.get("LLAMA_GUARD_TEST_MODEL", ""))
    ap.add_argument("--nvml", choices=("fake", "real", "off"), default="fake")
    ap.add_argument("--code", action="append", default=[], help="NAME=DIR: a tree to measure (repeatable)")
    ap.add_argument("--ngl", type=int, default=99, help="[server].n_gpu_layers (> 0: the VRAM need matters)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--ctk", default="f16")
    ap.add_argument("--fa", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=sized(5, 3), help="rounds (5; CI 3)")
    ap.add_argument("--fail-starts", type=int, default=sized(5, 3), help="failing starts (5; CI 3)")
    ap.add_argument("--json", type=Path, help="write the raw figures here")
    ap.add_argument("--events-dir", type=Path, help="keep the first round's daemon events here (per tree)")
    args = ap.parse_args()
    if not args.binary or not args.model:
        ap.error("--binary and --model (or $LLAMA_SERVER_BIN, $LLAMA_GUARD_TEST_MODEL) are required")
    pairs = [c.split("=", 1) if "=" in c else (Path(c).name, c) for c in args.code] or [("this", str(ROOT))]
    trees = [Tree(name, Path(root), args.nvml) for name, root in pairs]
    port = free_port()
    for tree in trees:
        tree.byte_compile()
    results: dict[str, dict[str, list[float]]] = {}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmpdir:
        tmp = Path(tmpdir)
        script = tmp / "nvml.json"
        script.write_text(json.dumps({}))
        sys.path.insert(0, str(trees[0].root / "supervisor"))
        from llama_guard.config import load_config
        from llama_guard.config.argv import build_argv

        (tmp / "argv").mkdir()
        probe = DaemonRun(tmp / "argv", sections(args, tmp / "argv", args.model, port))
        cfg = load_config(probe.config)
        argv = build_argv(cfg.server, Path(args.binary))
        bad = crasher(args.binary, tmp / "llama-server")
        argv_bad = build_argv(cfg.server, bad)
        print(f"llama-server argv: {' '.join(argv)}", flush=True)
        bare_load(argv, port)  # warm-up: the page cache holds the model, not counted
        exits = exit_times(argv, port, args.rounds)
        keys = ["bare", "start→spawn", "daemon_started→spawn", "start→/health 200", "kill -9→/health 200",
                "restart: API away", "kill -9: restart_to_ready_s (event)", "restart: restart_to_ready_s (event)",
                "kill -9→spawn", "restart: SIGUSR1→old server gone", "restart: old server gone→spawn",
                "listening line→server_ready", "front door restart: SIGUSR1→old server gone",
                "overhead: first start", "overhead: kill -9", "overhead: restart"]
        for tree in trees:
            results[tree.name] = {k: [] for k in keys}
        for r in range(args.rounds):
            order = trees[r % len(trees):] + trees[:r % len(trees)]
            for tree in order:
                one_round(tree, args, tmp / f"{tree.name}-{r}", port, script, results[tree.name], argv)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        for tree in trees:
            results[tree.name].update(failing_loop(tree, args, tmp / f"{tree.name}-fail", port, script, bad,
                                                   argv_bad))
    load1 = os.getloadavg()
    print(f"\nhost {platform.node()} ({os.cpu_count()} cores), load {load0[0]:.2f} → {load1[0]:.2f}; "
          f"GPU watch: {args.nvml} NVML; model {Path(args.model).name} "
          f"({Path(args.model).stat().st_size / 2**20:,.0f} MiB)")
    print_table(list(exits.items()), title="\nllama-server's own exit")
    for tree in trees:
        rows = [(k, v) for k, v in results[tree.name].items() if not k.startswith("_")]
        print_table(rows, title=f"\n[{tree.name}] {tree.root}")
    if args.json:
        args.json.write_text(json.dumps({"host": platform.node(), "cores": os.cpu_count(), "nvml": args.nvml,
                                         "model": Path(args.model).name, "argv": argv, "load": [load0, load1],
                                         "rounds": args.rounds, "results": results, "exits": exits}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
