#!/usr/bin/env python3
"""VRAM admission on a real NVIDIA GPU — READ-ONLY for the GPU.

Run on a GPU machine from the repository root (see scripts/README-gpu-e2e.md for how the machine
is prepared; the same llama-server build and model serve here). A torch process ("the hog")
holds all but ~150 MiB of VRAM for ``--hold-s`` seconds (20 by default) and then exits, while
llama-guard starts a CUDA llama-server. Two runs, each a real ``llama-guard run`` subprocess:

V1. No ``[gpu].expected_vram_mib`` and no earlier good start: the need is the estimate from the
    model's GGUF (read once per start); the admission check must see the shortfall and report
    ``gpu_vram_wait`` (naming the hog's pid and MiB) without starting the server; once the hog
    exits and the driver has freed its memory, the server starts and becomes ready.
V2. ``[gpu].expected_vram_mib`` set: the same, with that figure as the need.

Bounded: ``[gpu].vram_wait_timeout_s`` is ``--wait-timeout-s`` (90 s), and each run ends within
:data:`RUN_BUDGET_S` (105 s: the hog's start, the wait, readiness, the daemon's stop), so the whole
script ends within about 3.5 minutes, under an outer ``timeout 300``.

Expected in both: no ``server_backoff``/``crash_loop``, no reset command run (the reset command is
``scripts/stub_gpu_reset.py``, which only records its argv; the GPU is never reset), and
``server_ready`` after the hog has gone. Nothing here changes persistence mode, clocks or power.

Writes to ``--out``: ``v1_events.jsonl``, ``v2_events.jsonl`` (the daemon's JSON events, to keep
as a fixture), ``v*_hog.txt``, ``v*_reset_argv.txt`` (only if a reset ran: it must not) and
``summary.json`` with the checks above as booleans. Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_e2e import events  # the daemon's JSON event lines, read as gpu_e2e.py reads them

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
RUN_BUDGET_S = 105.0  # one run, hog start to daemon stop (s); two runs stay well under 4 minutes

HOG = r"""
import os, sys, time, torch
leave_mib, hold_s = int(sys.argv[1]), float(sys.argv[2])
free, total = torch.cuda.mem_get_info()
want = free - leave_mib * 2**20
x = torch.empty(want, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(f"hog pid {os.getpid()} holds {want >> 20} MiB of {total >> 20} (free before {free >> 20} MiB)", flush=True)
time.sleep(hold_s)
print(f"hog pid {os.getpid()} exits after {hold_s:.0f} s", flush=True)
"""


def config(tmp: Path, server: str, model: str, port: int, stub: Path, record: Path, expected_mib: int,
           wait_timeout_s: float) -> str:
    return f"""
[server]
binary = "{server}"
model = "{model}"
port = {port}
n_gpu_layers = 99
ctx_size = 8192
parallel = 1
batch_size = 512
ubatch_size = 256
cache_type_k = "q8_0"
cache_type_v = "q8_0"
flash_attn = "on"
threads = 8
env = {{CUDA_VISIBLE_DEVICES = "0", OMP_NUM_THREADS = "8"}}

[health]
interval_s = 2.0
timeout_s = 2.0

[gpu]
enabled = "on"
sample_interval_s = 1.0
require_server_on_gpu = true
foreign_processes = "warn"
enable_persistence = false
expected_vram_mib = {expected_mib}
vram_wait_timeout_s = {wait_timeout_s}

[recovery]
backoff_initial_s = 0.5
max_restarts = 4
reset_on = ["gpu_lost", "xid", "oom"]
reset_command = ["{PY}", "{stub}", "{record}", "{{index}}"]

[schedule]
restart_cron = ""

[log]
level = "debug"
format = "json"
server_log_file = "{tmp}/server.log"

[runtime]
dir = "{tmp}/run"
"""


def wait_event(log: Path, name: str, deadline: float) -> dict[str, object] | None:
    """The first event ``name`` in ``log``, or None once time.monotonic() passes ``deadline``."""
    while time.monotonic() < deadline:
        found = [e for e in events(log) if e["event"] == name]
        if found:
            return found[0]
        time.sleep(0.1)
    return None


def run(args: argparse.Namespace, out: Path, name: str, port: int, expected_mib: int) -> dict[str, object]:
    tmp = Path(f"/tmp/lg-vram-{name}")
    tmp.mkdir(parents=True, exist_ok=True)
    record = out / f"{name}_reset_argv.txt"
    cfg = tmp / "llama-guard.toml"
    cfg.write_text(config(tmp, args.server, args.model, port, ROOT / "scripts" / "stub_gpu_reset.py", record,
                          expected_mib, args.wait_timeout_s))
    log = out / f"{name}_events.jsonl"
    log.write_text("")
    budget_end = time.monotonic() + RUN_BUDGET_S
    hog = subprocess.Popen([PY, "-c", HOG, str(args.leave_mib), str(args.hold_s)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert hog.stdout is not None
    if not select.select([hog.stdout], [], [], 30.0)[0]:  # torch's start, bounded
        hog.kill()
        raise SystemExit(f"{name}: the hog did not start within 30 s")
    first = hog.stdout.readline().strip()
    hog_pid = hog.pid
    summary: dict[str, object] = {"hog": first, "hog_pid": hog_pid, "expected_vram_mib": expected_mib}
    with log.open("ab") as handle:
        daemon = subprocess.Popen([PY, "-m", "llama_guard", "run", "--config", str(cfg)], stdout=handle,
                                  stderr=handle, env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=str(ROOT))
    started = time.monotonic()
    try:
        wait = wait_event(log, "gpu_vram_wait", min(budget_end, time.monotonic() + 30.0))
        summary["vram_wait"] = wait
        ready = wait_event(log, "server_ready", budget_end - 25.0)  # 25 s left to stop
        summary["ready"] = ready
        summary["ready_after_s"] = round(time.monotonic() - started, 2) if ready else None
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            summary["daemon_exit"] = daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            summary["daemon_exit"] = daemon.wait(timeout=10)
        hog.kill()
        rest = hog.communicate(timeout=5)[0]
        (out / f"{name}_hog.txt").write_text(first + "\n" + rest)
    names = [str(e["event"]) for e in events(log) if e["event"] not in ("server_line", "server_probe")]
    summary["events"] = names
    wait_fields = summary["vram_wait"] if isinstance(summary["vram_wait"], dict) else {}
    summary["checks"] = {
        "gpu_vram_wait_names_the_hog": wait_fields.get("foreign_pid") == hog_pid,
        "no_restart_budget_spent": "server_backoff" not in names and "crash_loop" not in names,
        "no_reset_command_ran": not record.exists(),
        "ready_once_the_memory_is_free": summary["ready"] is not None,
        # Both start only once the memory is free (V1's need: the GGUF estimate).
        "no_start_before_the_memory_is_free": names.count("server_starting") == 1,
    }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="a CUDA llama-server binary")
    parser.add_argument("--model", required=True, help="a GGUF model file")
    parser.add_argument("--out", required=True, help="directory for the events and summary.json")
    parser.add_argument("--hold-s", type=float, default=20.0, help="how long the hog holds the VRAM (s)")
    parser.add_argument("--wait-timeout-s", type=float, default=90.0, help="[gpu].vram_wait_timeout_s (s)")
    parser.add_argument("--leave-mib", type=int, default=150, help="VRAM the hog leaves free (MiB)")
    parser.add_argument("--expected-vram-mib", type=int, default=2048,
                        help="[gpu].expected_vram_mib of run V2 (MiB; more than --leave-mib)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"v1": run(args, out, "v1", 18091, 0), "v2": run(args, out, "v2", 18092, args.expected_vram_mib)}
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v["checks"] for k, v in result.items()}, indent=1))
    ok = all(all(v["checks"].values()) for v in result.values())  # type: ignore[union-attr]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
