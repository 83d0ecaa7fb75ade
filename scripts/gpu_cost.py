#!/usr/bin/env python3
"""What supervision costs on a real GPU: the tables of benchmarks/bench_start.py (start-up and restart),
benchmarks/bench_rss.py (the daemon's memory, the NVIDIA library's share) and, on a large model,
scripts/gpu_insight.py (``check``'s VRAM prediction against NVML at several flag sets, ``bench``'s median,
ceiling and efficiency), plus benchmarks/bench_liveness.py (decode speed bare vs supervised, the
conversation's KV cache) when that benchmark is in the tree. Each part runs as its own process with a
deadline, prints its table, and writes its JSON under ``--out``.

Read-only for the GPU: no reset (``[recovery].reset_command`` is scripts/stub_gpu_reset.py), persistence
mode, clocks and power limit only read. See scripts/README-gpu-e2e.md for the build and the model.

    python3 scripts/gpu_cost.py --binary /tmp/build/bin/llama-server --model /tmp/qwen27b.gguf \\
        --out /tmp/res --parts insight,start,rss [--code before=/tmp/main --code after=.]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The reference flags of the H200 runs (the motivating setup's): -ngl 99 -c 8192 -np 1 -b 512 -ub 256
# -ctk q8_0 -ctv q8_0 -fa on -t 8.
SERVER = ["--ngl", "99", "--ctx", "8192", "--ctk", "q8_0", "--fa", "on", "--threads", "8"]
FLAG_SETS = ["ref:", "ctx32k-f16:ctx_size=32768,cache_type_k=f16,cache_type_v=f16", "ngl40:n_gpu_layers=40"]


def part(name: str, argv: list[str], timeout_s: float, log: Path) -> int:
    """Run one part; its output goes to the terminal and to ``log``. Returns its exit status (124: deadline)."""
    print(f"\n===== {name}: {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT),
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        assert proc.stdout is not None
        deadline = t0 + timeout_s
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                out.write(line)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, timeout_s)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
    print(f"===== {name}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True)
    ap.add_argument("--model", required=True, help="the model of the start/RSS/liveness tables")
    ap.add_argument("--big-model", help="the large model of the insight part (default: --model)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--parts", default="insight,start,rss")
    ap.add_argument("--code", action="append", default=[], help="NAME=DIR trees for start/rss (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rss-rounds", type=int, default=3)
    ap.add_argument("--bench-runs", type=int, default=5)
    ap.add_argument("--bench-tokens", type=int, default=128)
    ap.add_argument("--tag", default="", help="suffix of the output names (e.g. the model)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="deadline of all parts together")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    code = [a for c in args.code for a in ("--code", c)]
    common = ["--binary", args.binary, "--model", args.model, *SERVER]
    tag = f"-{args.tag}" if args.tag else ""
    plan: dict[str, list[str]] = {
        "insight": [py, "scripts/gpu_insight.py", "--binary", args.binary, "--model", args.big_model or args.model,
                    "--out", str(args.out / f"insight{tag}"), "--runs", str(args.bench_runs),
                    "--tokens", str(args.bench_tokens), *[a for f in FLAG_SETS for a in ("--flag-set", f)]],
        "start": [py, "benchmarks/bench_start.py", "--nvml", "real", *common, *code, "--rounds", str(args.rounds),
                  "--json", str(args.out / f"start{tag}.json"), "--events-dir", str(args.out / f"events{tag}")],
        "rss": [py, "benchmarks/bench_rss.py", "--nvml", "real", *common, *code, "--rounds", str(args.rss_rounds),
                "--arena-max", "2", "--json", str(args.out / f"rss{tag}.json")],
        "liveness": [py, "benchmarks/bench_liveness.py", "--binary", args.binary, "--model", args.model,
                     "--ngl", "99", "--ctx", "8192", "--parallel", "1", "--batch", "512", "--ubatch", "256",
                     "--ctk", "q8_0", "--ctv", "q8_0", "--fa", "on", "--threads", "8", "--gpu", "auto",
                     "--rounds", str(args.rounds), "--runs", "5", "--tokens", "256"],
    }
    end = time.monotonic() + args.budget_s
    status = 0
    for name in args.parts.split(","):
        left = end - time.monotonic()
        if left < 20:
            print(f"===== {name}: skipped, {left:.0f} s left of --budget-s", flush=True)
            status = 1
            continue
        if not (ROOT / plan[name][1]).exists():
            print(f"===== {name}: skipped, {plan[name][1]} is not in this tree", flush=True)
            continue
        status |= part(name, plan[name], left, args.out / f"{name}{tag}.log") != 0
    return status


if __name__ == "__main__":
    sys.exit(main())
