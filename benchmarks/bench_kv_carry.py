#!/usr/bin/env python3
"""What carrying each slot's KV cache across restarts gives, and what its rolling save costs, side by
side in one run against the real llama-server through llama-guard's front door:

1. a returning conversation (a ``--facts``-sized history, then one more turn) after a planned restart
   (``llama-guard restart``) and after a kill -9 of llama-server (once the rolling save of the previous
   turn was reported), with ``[slots]`` off vs on, the rounds interleaved: the prompt tokens the server
   evaluated again (its own ``timings.prompt_n``) and the time to first token (the wall time of the turn,
   which asks for 1 token), medians over ``--rounds``;
2. decode speed with the rolling save on vs off: two daemons (one each), ``--decode-rounds`` completions
   of ``--tokens`` tokens on each, alternating, each a new prompt (so the on-daemon saves a changed slot
   after every one, ``rolling_save_interval_s`` 1 s); llama-server's own ``predicted_per_second``,
   medians, and their ratio; plus the saves' own time and size.

    . .work/real/env && .venv/bin/python benchmarks/bench_kv_carry.py
    .venv/bin/python benchmarks/bench_kv_carry.py --server-bin /path/llama-server --model /path/27b.gguf \\
        --gpu-layers 999 --ctx 8192 --facts 600 --tokens 256

Waits are on the daemon's events, each bounded; a wait that runs out stops the bench with its message.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from benchlib import add_server_args, sized  # noqa: E402
from harness import DaemonRun, base_sections, free_port, merge, terminate  # noqa: E402

READY_TIMEOUT_S = 300.0


def daemon(tmp: Path, args: argparse.Namespace, carry: bool) -> tuple[DaemonRun, int]:
    """A started daemon with the front door on and ``[slots]`` on or off; (the run, its front port)."""
    port, front = free_port(), free_port()
    where = Path(tempfile.mkdtemp(dir=tmp))
    sections = merge(base_sections(where, args.server_bin, args.model, port), {
        "server": {"ctx_size": args.ctx, "n_gpu_layers": args.gpu_layers, "threads": args.threads},
        "front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": READY_TIMEOUT_S},
        "health": {"interval_s": 1.0, "hang_strikes": 5, "timeout_s": 5.0, "canary_timeout_s": 30.0,
                   "load_timeout_s": READY_TIMEOUT_S},
        "recovery": {"stable_after_s": 1.0, "max_restarts": 10},
        "schedule": {"drain_timeout_s": 120.0},
        "log": {"level": "info", "format": "json"},
        "slots": {"enabled": carry, "rolling_save_interval_s": 1.0}})
    run = DaemonRun(where, sections).start()
    run.wait_event("server_ready", READY_TIMEOUT_S)
    return run, front


def history(args: argparse.Namespace, tag: int) -> list[dict[str, str]]:
    facts = " ".join(f"Fact {i} of set {tag}: item {i} weighs {i * 7 % 113} grams." for i in range(args.facts))
    return [{"role": "system", "content": f"You know these facts. {facts}"}]


def turn(front: int, messages: list[dict[str, str]], question: str, max_tokens: int) -> tuple[dict[str, Any], float]:
    """One chat turn through the front door: (llama-server's timings, the wall time in s)."""
    messages.append({"role": "user", "content": question})
    start = time.monotonic()
    resp = httpx.post(f"http://127.0.0.1:{front}/v1/chat/completions", timeout=READY_TIMEOUT_S,
                      json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    wall = time.monotonic() - start
    resp.raise_for_status()
    body = resp.json()
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return body["timings"], wall


def ready_count(run: DaemonRun) -> int:
    return sum(1 for e in run.events() if e["event"] == "server_ready")


def returning(run: DaemonRun, front: int, args: argparse.Namespace, tag: int, carry: bool,
              how: str) -> tuple[int, float]:
    """One conversation, a restart of kind ``how`` ("planned" or "kill"), then its next turn:
    (prompt tokens evaluated again, the turn's wall time in s)."""
    messages = history(args, tag)
    pid = [e for e in run.events() if e["event"] == "server_ready"][-1]["server_pid"]

    def rolling(e: dict[str, Any]) -> bool:
        return bool(e["server_pid"] == pid and e["reason"] == "rolling")

    saves = sum(1 for e in run.events() if e["event"] == "slot_saved" and rolling(e))
    turn(front, messages, "Which item weighs the most?", 8)
    ready = ready_count(run)
    if how == "planned":
        run.signal(signal.SIGUSR1)
    else:
        if carry:  # this turn's rolling save, not an earlier one of this server
            run.wait_event("slot_saved", 60, skip=saves, where=rolling)
        os.kill(pid, signal.SIGKILL)
    new = run.wait_event("server_ready", READY_TIMEOUT_S, skip=ready)["server_pid"]
    if carry:
        run.wait_event("slot_restored", 30, where=lambda e: e["server_pid"] == new)
    timings, wall = turn(front, messages, "And which item weighs the least?", 1)
    return int(timings["prompt_n"]), wall


def decode(front: int, args: argparse.Namespace, i: int) -> float:
    resp = httpx.post(f"http://127.0.0.1:{front}/completion", timeout=READY_TIMEOUT_S, json={
        "prompt": f"Story {i}: once upon a time", "n_predict": args.tokens, "ignore_eos": True})
    resp.raise_for_status()
    return float(resp.json()["timings"]["predicted_per_second"])


def end(run: DaemonRun) -> None:
    """Stop a daemon (SIGTERM: it stops its server; SIGKILL after 30 s), without printing its events."""
    if run.proc is not None:
        terminate(run.proc, 30.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser, ctx=2048, threads=2)
    parser.add_argument("--facts", type=int, default=40, help="history size: 40 facts ~ 600 tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--decode-rounds", type=int, default=sized(6, 3), help="completions per daemon (6; CI 3)")
    parser.add_argument("--parts", default="carry,decode", help="which parts to run: carry, decode or both")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    if not args.model:
        parser.error("--model (or $LLAMA_GUARD_TEST_MODEL) is needed")
    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; model {args.model}; "
          f"gpu layers {args.gpu_layers}; ctx {args.ctx}")
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        runs = {carry: daemon(tmp, args, carry) for carry in (False, True)}
        try:
            carried: dict[tuple[str, bool], list[tuple[int, float]]] = {}
            tag = 0
            for _ in range(args.rounds if "carry" in parts else 0):
                for how in ("planned", "kill"):
                    for carry in (False, True):
                        tag += 1
                        run, front = runs[carry]
                        carried.setdefault((how, carry), []).append(returning(run, front, args, tag, carry, how))
            if carried:
                print("\nA returning conversation after a restart (medians)")
                print(f"{'restart':<10} {'carry-over':<11} {'n':>2} {'prompt tokens re-evaluated':>27} "
                      f"{'first token s':>14}")
            for (how, carry), values in sorted(carried.items()):
                tokens = statistics.median(v[0] for v in values)
                first = statistics.median(v[1] for v in values)
                print(f"{how:<10} {'on' if carry else 'off':<11} {len(values):>2} {tokens:>27.0f} {first:>14.2f}")
            if "decode" not in parts:
                return 0
            speeds: dict[bool, list[float]] = {False: [], True: []}
            for i in range(args.decode_rounds):
                for carry in (False, True):
                    speeds[carry].append(decode(runs[carry][1], args, i))
                    time.sleep(1.5)  # the rolling save's chance (interval 1 s) before the next decode
            off, on = statistics.median(speeds[False]), statistics.median(speeds[True])
            saves = [e for e in runs[True][0].events() if e["event"] == "slot_saved"]
            print("\nDecode speed with the rolling save (medians)")
            print(f"{'rolling save':<13} {'n':>2} {'tokens/s':>9}")
            print(f"{'off':<13} {len(speeds[False]):>2} {off:>9.1f}")
            print(f"{'on':<13} {len(speeds[True]):>2} {on:>9.1f}")
            print(f"ratio on/off: {on / off:.3f}")
            if saves:
                print(f"saves: {len(saves)}, median {statistics.median(e['save_ms'] for e in saves):.1f} ms, "
                      f"median {statistics.median(e['bytes'] for e in saves) / 2**20:.1f} MiB")
        finally:
            for run, _ in runs.values():
                end(run)
    print(f"\nload at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
