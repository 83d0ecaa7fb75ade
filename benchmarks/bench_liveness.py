#!/usr/bin/env python3
"""What liveness costs the API: decode speed bare vs supervised, and a conversation's KV cache.

Part 0, each request alone: the server's CPU time per request of each kind a round may send
(idle bare server, one request a second).

Part 1, decode speed. The same llama-server argv (built by llama-guard from the same ``[server]``
keys) on the same port, in interleaved rounds; each round runs every mode once, in a rotated order,
and each mode runs ``--runs`` completions of ``--tokens`` tokens (``ignore_eos``, one fixed prompt)
after one warm-up completion. The figure is llama-server's own eval speed
(``timings.predicted_per_second``). Modes:

- ``bare``: llama-server alone;
- ``guard``: under ``llama-guard run`` with the shipped ``[health]`` defaults (canary on);
- ``guard-nocanary``: the same with ``[health].canary = false``;
- diagnostic modes (``--modes``), a bare server plus one candidate cost alone, at the shipped
  interval: ``bare+health`` (GET /health), ``bare+metrics`` (GET /metrics), ``bare+slots``
  (GET /slots), ``bare+old-round`` (what a round used to send: /health, /metrics + /slots twice and
  a 1-token "ping" completion on any slot), ``bare+psutil`` (a process-tree CPU-time walk), and
  ``guard-quiet`` (the daemon with liveness rounds every 10 min: its own base cost), and on a GPU
  host ``guard-nogpu`` (supervised, GPU watch off) and ``bare+nvml`` (a bare server while this
  process samples NVML as the GPU watch does: every ``[gpu].sample_interval_s``, plus the
  per-process utilisation read of each round).

Part 2, a 3-turn chat (``/v1/chat/completions``, a ~600-token system prompt) with liveness rounds
between the turns (``--turn-gap`` seconds at ``[health].interval_s`` 1 s), for ``--cache-ram 0`` and
the build's default host prompt cache, ``-np 1`` (``--chat-parallel 1,2`` adds ``-np 2``): under
llama-guard with the canary on (``guard``; ``--chat-variants`` adds ``guard-nocanary``, off), and a bare
server beside the requests a round used to send (``bare+old-round``, every 1 s).
Printed per turn: prompt tokens evaluated (``timings.prompt_n``), tokens reused from the cache,
prompt seconds. A turn that evaluates only its new tokens left the conversation in the KV cache.

On this CPU host (``. .work/real/env`` sets the binary and model)::

    .venv/bin/python benchmarks/bench_liveness.py --rounds 5 --runs 3 --tokens 128

On a GPU host (e.g. CUDA llama-server, the reference flags of an H200 run)::

    .venv/bin/python benchmarks/bench_liveness.py --binary /path/llama-server --model /path/model.gguf \\
        --ngl 99 --ctx 8192 --parallel 1 --batch 512 --ubatch 256 --ctk q8_0 --ctv q8_0 --fa on --threads 8 \\
        --gpu auto --rounds 5 --runs 5 --tokens 256 \
        --modes bare,guard,guard-nocanary,guard-nogpu,bare+nvml,bare+old-round

``--gpu auto`` turns llama-guard's GPU watch on (NVML) in the supervised modes; ``--part 0``, ``1``
or ``2`` runs one part. The load average printed at both ends says how far to trust the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from benchlib import poll_health_200, sized  # noqa: E402
from harness import DaemonRun, config_text, free_port  # noqa: E402
from llama_guard.config import load_config  # noqa: E402
from llama_guard.config.argv import build_argv  # noqa: E402
from llama_guard.config.gpu import GpuConfig  # noqa: E402
from llama_guard.config.sections import HealthConfig  # noqa: E402
from llama_guard.core.progress import tree_cpu_seconds  # noqa: E402

PROMPT = ("Write a long story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the sea, the storm, the keeper's past and the message in detail.")
INTERVAL_S = HealthConfig().interval_s  # the shipped round interval, for the diagnostic pollers
MODES = ("bare", "guard", "guard-nocanary")


def server_sections(args: argparse.Namespace, port: int, tmp: Path) -> dict[str, dict[str, object]]:
    server: dict[str, object] = {
        "binary": args.binary, "model": args.model, "port": port, "n_gpu_layers": args.ngl,
        "ctx_size": args.ctx, "parallel": args.parallel, "batch_size": args.batch, "ubatch_size": args.ubatch,
        "cache_type_k": args.ctk, "cache_type_v": args.ctv, "flash_attn": args.fa, "threads": args.threads,
        "extra_args": list(args.extra_arg or []), "env": {}}
    return {"server": server, "gpu": {"enabled": args.gpu}, "schedule": {"restart_cron": ""},
            "log": {"level": "info", "format": "json"}, "runtime": {"dir": str(tmp / "run")}}


class Bare:
    """A bare llama-server with the argv llama-guard would build (optionally with a side poller)."""

    def __init__(self, argv: list[str], port: int, poller: Callable[[int, int, threading.Event], None] | None):
        self.argv, self.port, self.poller = argv, port, poller
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_flag = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> Bare:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        poll_health_200(self.port, time.monotonic())
        if self.poller is not None:
            self.thread = threading.Thread(target=self.poller, args=(self.port, self.proc.pid, self.stop_flag),
                                           daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        if self.thread is not None:
            self.thread.join(10)
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


def every(action: Callable[[httpx.Client, int], object],
          interval_s: float = INTERVAL_S) -> Callable[[int, int, threading.Event], None]:
    """A poller that runs ``action`` every ``interval_s`` seconds until stopped."""

    def run(port: int, pid: int, stop: threading.Event) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0, trust_env=False) as client:
            while not stop.wait(interval_s):
                with contextlib.suppress(httpx.HTTPError):
                    action(client, pid)

    return run


def _old_round(client: httpx.Client, _pid: int) -> None:
    client.get("/health")
    client.get("/metrics")
    client.get("/slots")
    client.post("/completion", json={"prompt": "ping", "n_predict": 1, "cache_prompt": True})
    client.get("/slots")
    client.get("/metrics")
    client.get("/slots")


def nvml_poller(port: int, pid: int, stop: threading.Event) -> None:
    """What the GPU watch does alone: one NVML sample every [gpu].sample_interval_s, plus the
    per-process utilisation read of each liveness round (GPU hosts only)."""
    from llama_guard.gpu.nvml import Nvml

    nvml = Nvml()
    since, last_sample = 0, 0.0
    try:
        while not stop.wait(INTERVAL_S):
            if time.monotonic() - last_sample >= GpuConfig().sample_interval_s:
                nvml.sample()
                last_sample = time.monotonic()
            with contextlib.suppress(Exception):
                since = nvml.process_busy(frozenset({pid}), since)[1]
    finally:
        nvml.close()


POLLERS: dict[str, Callable[[int, int, threading.Event], None]] = {
    "bare+nvml": nvml_poller,
    "bare+health": every(lambda c, _p: c.get("/health")),
    "bare+metrics": every(lambda c, _p: c.get("/metrics")),
    "bare+slots": every(lambda c, _p: c.get("/slots")),
    "bare+old-round": every(_old_round),
    "bare+psutil": every(lambda _c, p: tree_cpu_seconds(p)),
}


def completion_speed(port: int, tokens: int) -> float:
    resp = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=600.0, trust_env=False,
                      json={"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "cache_prompt": True})
    resp.raise_for_status()
    return float(resp.json()["timings"]["predicted_per_second"])


DAEMON_CPU: dict[str, list[float]] = {}  # mode -> the daemon's CPU share of one core while measured


def run_mode(mode: str, args: argparse.Namespace, tmp: Path, port: int, argv: list[str]) -> list[float]:
    speeds: list[float] = []

    def measure() -> None:
        completion_speed(port, min(args.tokens, 32))  # warm-up, not counted
        speeds.extend(completion_speed(port, args.tokens) for _ in range(args.runs))

    if mode == "bare" or mode in POLLERS:
        with Bare(argv, port, POLLERS.get(mode)):
            measure()
        return speeds
    by_mode: dict[str, dict[str, object]] = {"guard": {}, "guard-nocanary": {"canary": False},
                                             "guard-quiet": {"interval_s": 600.0}, "guard-nogpu": {}}
    health = by_mode[mode]
    sections = server_sections(args, port, tmp)
    sections["health"] = dict(health)
    if mode == "guard-nogpu":
        sections["gpu"] = {"enabled": "off"}
    daemon = DaemonRun(tmp, sections)
    daemon.start()
    try:
        daemon.wait_event("server_ready", 120.0)
        me = psutil.Process(daemon.pid)
        cpu0, t0 = sum(me.cpu_times()[:2]), time.monotonic()
        measure()
        DAEMON_CPU.setdefault(mode, []).append((sum(me.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0))
    finally:
        daemon.stop()
    return speeds


def part1(args: argparse.Namespace, tmp: Path) -> None:
    modes = [m for m in args.modes.split(",") if m]
    port = free_port()
    cfg_path = tmp / "argv.toml"
    cfg_path.write_text(config_text(server_sections(args, port, tmp)))
    cfg = load_config(cfg_path)
    argv = build_argv(cfg.server, Path(args.binary))
    print(f"llama-server argv (every mode, same port {port}): {' '.join(argv)}", flush=True)
    speeds: dict[str, list[float]] = {m: [] for m in modes}
    per_round: dict[str, list[float]] = {m: [] for m in modes}  # each round's median
    for rnd in range(args.rounds):
        order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
        for mode in order:
            sub = tmp / f"r{rnd}-{mode}"
            sub.mkdir()
            got = run_mode(mode, args, sub, port, argv)
            speeds[mode] += got
            per_round[mode].append(statistics.median(got))
            print(f"  round {rnd + 1} {mode:16s} {' '.join(f'{s:.1f}' for s in got)} tok/s", flush=True)
    bare = statistics.median(speeds["bare"]) if speeds.get("bare") else None
    print()
    print(f"{'mode':18s} {'n':>3s} {'median tok/s':>13s} {'min':>8s} {'max':>8s} {'ratio to bare':>14s} "
          f"{'paired ratio':>13s}")
    for mode in modes:
        vals = speeds[mode]
        med = statistics.median(vals)
        ratio = f"{med / bare:.4f}" if bare else "-"
        paired = (f"{statistics.median(m / b for m, b in zip(per_round[mode], per_round['bare'], strict=True)):.4f}"
                  if bare else "-")
        print(f"{mode:18s} {len(vals):3d} {med:13.2f} {min(vals):8.2f} {max(vals):8.2f} {ratio:>14s} {paired:>13s}")
    for mode, shares in DAEMON_CPU.items():
        print(f"  {mode}: llama-guard's own CPU while measured: {100 * statistics.median(shares):.2f} % of one core")
    print("(eval tokens/s as llama-server reports it, timings.predicted_per_second; paired ratio: the median over "
          "rounds of the mode's round median over bare's in the same round; goal: guard/bare ≥ 0.995)")


# ---------------------------------------------------------------- part 0: each request alone

def part0(args: argparse.Namespace, tmp: Path) -> None:
    """The server's CPU seconds per request of each kind a round may send, on an idle bare server,
    one request a second (so that each pays its own wake-up), against doing nothing."""
    port = free_port()
    cfg_path = tmp / "argv0.toml"
    cfg_path.write_text(config_text(server_sections(args, port, tmp)))
    argv = build_argv(load_config(cfg_path).server, Path(args.binary))
    canary = {"prompt": "ping", "n_predict": 1, "cache_prompt": True, "id_slot": 0, "seed": 0x6C670001}
    kinds: list[tuple[str, Callable[[httpx.Client], object]]] = [
        ("nothing", lambda c: None), ("GET /health", lambda c: c.get("/health")),
        ("GET /metrics", lambda c: c.get("/metrics")), ("GET /slots", lambda c: c.get("/slots")),
        ("POST /completion (canary, its own slot)", lambda c: c.post("/completion", json=canary))]
    rows = []
    with Bare(argv, port, None) as bare, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0,
                                                      trust_env=False) as client:
        assert bare.proc is not None
        proc = psutil.Process(bare.proc.pid)
        client.post("/completion", json=canary)
        for name, call in kinds:
            time.sleep(1.0)
            cpu0 = sum(proc.cpu_times()[:2])
            for _ in range(args.calls):
                call(client)
                time.sleep(1.0)
            rows.append((name, (sum(proc.cpu_times()[:2]) - cpu0) / args.calls))
    print()
    print(f"{'request (idle server, 1 per second)':42s} {'server CPU ms per request':>26s}")
    for name, cpu in rows:
        print(f"{name:42s} {1000 * cpu:26.2f}")
    print("(psutil user+system time of the server; 'nothing' is the idle server's own per-second baseline)")


# ---------------------------------------------------------------- part 2: the conversation

SYSTEM = ("You are a careful assistant for a harbour office. " + " ".join(
    f"Rule {i}: answer briefly, name the pier, the tide and the ship when you know them, and never invent a "
    f"timetable." for i in range(1, 31)))
TURNS = ("Which pier does the morning ferry use?", "And when is high tide today?", "Thank you. Anything else?")


def conversation(port: int, tokens: int, gap_s: float) -> list[tuple[int, int, float]]:
    """Three turns; between them ``gap_s`` seconds of liveness rounds. Per turn: prompt tokens
    evaluated, tokens taken from the cache, prompt seconds."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    out = []
    for i, turn in enumerate(TURNS):
        if i:
            time.sleep(gap_s)
        messages.append({"role": "user", "content": turn})
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=600.0, trust_env=False,
                          json={"messages": messages, "max_tokens": tokens, "temperature": 0.0,
                                "cache_prompt": True})
        resp.raise_for_status()
        body: dict[str, Any] = resp.json()
        timings = body["timings"]
        cached = body.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
        out.append((int(timings["prompt_n"]), int(cached), float(timings["prompt_ms"]) / 1000.0))
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return out


CHAT_VARIANTS = ("guard", "guard-nocanary", "bare+old-round")
DEFAULT_CHAT_VARIANTS = ("guard", "bare+old-round")  # what make bench runs: the canary on vs the old rounds


def part2(args: argparse.Namespace, tmp: Path) -> None:
    rows = []
    variants = [v for v in args.chat_variants.split(",") if v]
    unknown = sorted(set(variants) - set(CHAT_VARIANTS))
    if unknown:
        raise SystemExit(f"--chat-variants: unknown {', '.join(unknown)} (known: {', '.join(CHAT_VARIANTS)})")
    for cache_ram in ("0", "default"):
        for parallel in (int(n) for n in args.chat_parallel.split(",")):
            for variant in variants:
                port = free_port()
                sub = tmp / f"chat-{cache_ram}-{parallel}-{variant}"
                sub.mkdir()
                sections = server_sections(args, port, sub)
                sections["server"]["parallel"] = parallel
                sections["server"]["ctx_size"] = max(args.ctx, 2048 * parallel)
                if cache_ram == "0":
                    sections["server"]["extra_args"] = [*(args.extra_arg or []), "--cache-ram", "0"]
                if variant == "bare+old-round":  # what a round used to send, once a second, beside a bare server
                    cfg_path = sub / "argv.toml"
                    cfg_path.write_text(config_text(sections))
                    argv = build_argv(load_config(cfg_path).server, Path(args.binary))
                    with Bare(argv, port, every(_old_round, 1.0)):
                        time.sleep(2.5)
                        turns = conversation(port, args.chat_tokens, args.turn_gap)
                    rows.append((cache_ram, parallel, variant, turns, "-"))
                    continue
                sections["health"] = {"interval_s": 1.0, "canary": variant == "guard"}
                sections["log"] = {"level": "debug", "format": "json"}
                daemon = DaemonRun(sub, sections)
                daemon.start()
                try:
                    pid = daemon.wait_event("server_ready", 120.0)["server_pid"]
                    time.sleep(2.5)  # rounds before the first turn too
                    turns = conversation(port, args.chat_tokens, args.turn_gap)
                    probes = [e for e in daemon.events() if e["event"] == "server_probe" and e["server_pid"] == pid]
                finally:
                    daemon.stop()
                sent = sum(1 for e in probes if e.get("canary") not in (None, "not_sent"))
                rows.append((cache_ram, parallel, variant, turns, f"{len(probes)} ({sent})"))
    print()
    print(f"{'host cache':>10s} {'-np':>3s} {'liveness':>15s} | {'prompt tokens evaluated':>23s} | "
          f"{'cached':>14s} | {'prompt s per turn':>18s} | rounds (canaries)")
    for cache_ram, parallel, variant, turns, rounds in rows:
        evaluated = ", ".join(str(t[0]) for t in turns)
        cached = ", ".join(str(t[1]) for t in turns)
        secs = ", ".join(f"{t[2]:.2f}" for t in turns)
        label = "off (0)" if cache_ram == "0" else "default"
        print(f"{label:>10s} {parallel:3d} {variant:>15s} | {evaluated:>23s} | {cached:>14s} | {secs:>18s} | {rounds}")
    print("(turns 2 and 3 should evaluate only their new tokens: the history stays in the KV cache; "
          "bare+old-round: the requests a round used to send, every second, beside a bare server)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=os.environ.get("LLAMA_SERVER_BIN", ""))
    ap.add_argument("--model", default=os.environ.get("LLAMA_GUARD_TEST_MODEL", ""))
    ap.add_argument("--ngl", type=int, default=0, help="[server].n_gpu_layers (default 0: CPU)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--ubatch", type=int, default=256)
    ap.add_argument("--ctk", default="f16")
    ap.add_argument("--ctv", default="f16")
    ap.add_argument("--fa", default="auto", choices=("on", "off", "auto"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extra-arg", action="append", help="one more llama-server argument (repeatable)")
    ap.add_argument("--gpu", default="off", choices=("off", "auto", "on"), help="[gpu].enabled when supervised")
    ap.add_argument("--rounds", type=int, default=sized(3, 2), help="interleaved rounds of part 1 (3; CI 2)")
    ap.add_argument("--runs", type=int, default=sized(3, 2), help="completions per mode per round (3; CI 2)")
    ap.add_argument("--tokens", type=int, default=sized(128, 64), help="tokens per completion (ignore_eos; 128; CI 64)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"part 1 modes, comma-separated; also {', '.join(POLLERS)}, guard-quiet")
    ap.add_argument("--chat-tokens", type=int, default=24, help="max_tokens per chat turn")
    ap.add_argument("--chat-parallel", default="1",
                    help="part 2: the -np values, comma-separated (1,2 adds -np 2; "
                         "tests/e2e/test_liveness_real.py has it)")
    ap.add_argument("--chat-variants", default=",".join(DEFAULT_CHAT_VARIANTS),
                    help=f"part 2: comma-separated, of {','.join(CHAT_VARIANTS)}")
    ap.add_argument("--turn-gap", type=float, default=3.5, help="seconds of liveness rounds between turns")
    ap.add_argument("--calls", type=int, default=sized(8, 4), help="part 0: requests of each kind (8; CI 4)")
    ap.add_argument("--part", choices=("0", "1", "2", "all"), default="all")
    args = ap.parse_args()
    if not (args.binary and Path(args.binary).is_file() and args.model and Path(args.model).is_file()):
        print("bench_liveness: give --binary and --model (or `. .work/real/env`)", file=sys.stderr)
        return 2
    print(f"machine: {platform.node()}, nproc {len(os.sched_getaffinity(0))}, {platform.machine()}; "
          f"model {Path(args.model).name}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-liveness-") as tmpdir:
        tmp = Path(tmpdir)
        if args.part in ("0", "all"):
            part0(args, tmp)
        if args.part in ("1", "all"):
            part1(args, tmp)
        if args.part in ("2", "all"):
            part2(args, tmp)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
