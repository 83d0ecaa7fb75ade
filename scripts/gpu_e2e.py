#!/usr/bin/env python3
"""llama-guard on a real NVIDIA GPU with a real CUDA llama-server — READ-ONLY for the GPU.

Run on a GPU machine from the repository root (see scripts/README-gpu-e2e.md for the exact
device command). Two runs, each a real ``llama-guard run`` subprocess with JSON events:

A. GPU watch on: the server must appear in NVML's process list before "ready"; bench; a torch
   process holding 4 GiB is reported as gpu_foreign_process; kill -9 of the server → restart.
B. Real OOM: a torch process holds all but ~150 MiB of VRAM, so the server's allocation really
   fails; llama-guard classifies it (server_oom), runs the reset sequence with a STUB reset
   command (it only records its argv: this GPU is never reset), and the server becomes ready
   once the VRAM is free (the hog exits when it sees server_oom).

Nothing here changes the GPU's persistence mode, clocks or power limit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

HOG = r"""
import os, sys, time, torch
mode, log_path, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
free, total = torch.cuda.mem_get_info()
if mode == "leave":  # hold all but `mib` MiB
    want = free - mib * 2**20
else:                # hold `mib` MiB
    want = mib * 2**20
x = torch.empty(want, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(f"hog pid {os.getpid()} holds {want >> 20} MiB (free before {free >> 20} MiB)", flush=True)
deadline = time.monotonic() + float(os.environ.get("HOG_MAX_S", "120"))
while time.monotonic() < deadline:
    if log_path != "-" and os.path.exists(log_path) and "server_oom" in open(log_path).read():
        print("hog: saw server_oom, releasing", flush=True)
        break
    time.sleep(0.05)
"""


def config(tmp: Path, server: str, model: str, port: int, stub: Path, record: Path) -> str:
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

[recovery]
backoff_initial_s = 0.5
max_restarts = 6
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


def events(log: Path) -> list[dict[str, object]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and "event" in item:
            out.append(item)
    return out


def wait_event(log: Path, name: str, timeout: float, skip: int = 0) -> dict[str, object] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in events(log) if e["event"] == name]
        if len(found) > skip:
            return found[skip]
        time.sleep(0.1)
    return None


def start_daemon(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("ab") as handle:
        return subprocess.Popen([PY, "-m", "llama_guard", "run", "--config", str(cfg)],
                                stdout=handle, stderr=handle, env=env, cwd=str(ROOT))


def stop_daemon(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def run_a(args: argparse.Namespace, out: Path, stub: Path) -> dict[str, object]:
    tmp = Path("/tmp/lg-a")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "llama-guard.toml"
    cfg.write_text(config(tmp, args.server, args.model, 18081, stub, tmp / "reset-argv.txt"))
    log = out / "run_a_events.jsonl"
    summary: dict[str, object] = {}
    subprocess.run([PY, "-m", "llama_guard", "check", "--config", str(cfg)], cwd=str(ROOT), timeout=120,
                   stdout=(out / "run_a_check.txt").open("w"), stderr=subprocess.STDOUT, check=False)
    daemon = start_daemon(cfg, log)
    try:
        ready = wait_event(log, "server_ready", 180)
        summary["ready"] = ready
        bench = subprocess.run([PY, "-m", "llama_guard", "bench", "--config", str(cfg), "--runs", "5",
                                "--tokens", "256"], cwd=str(ROOT), capture_output=True, text=True, timeout=300,
                               check=False)
        summary["bench"] = bench.stdout.strip() + "\n" + bench.stderr.strip()
        hog = subprocess.Popen([PY, "-c", HOG, "hold", "-", "4096"], env=dict(os.environ, HOG_MAX_S="8"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        summary["foreign"] = wait_event(log, "gpu_foreign_process", 30)
        hog_out, _ = hog.communicate(timeout=60)
        summary["hog"] = hog_out.strip()
        status = subprocess.run([PY, "-m", "llama_guard", "status", "--config", str(cfg), "--json"],
                                cwd=str(ROOT), capture_output=True, text=True, timeout=60, check=False)
        (out / "run_a_status.json").write_text(status.stdout)
        pid = int(str(ready["server_pid"])) if ready else 0
        if pid:
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            again = wait_event(log, "server_ready", 180, skip=1)
            summary["kill9_to_ready_s"] = time.time() - t0 if again else None
    finally:
        summary["daemon_exit"] = stop_daemon(daemon)
    return summary


def run_b(args: argparse.Namespace, out: Path, stub: Path) -> dict[str, object]:
    tmp = Path("/tmp/lg-b")
    tmp.mkdir(parents=True, exist_ok=True)
    record = out / "run_b_reset_argv.txt"
    cfg = tmp / "llama-guard.toml"
    cfg.write_text(config(tmp, args.server, args.model, 18082, stub, record))
    log = out / "run_b_events.jsonl"
    log.touch()
    hog = subprocess.Popen([PY, "-c", HOG, "leave", str(log), "150"], env=dict(os.environ, HOG_MAX_S="90"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert hog.stdout is not None
    summary: dict[str, object] = {"hog": hog.stdout.readline().strip()}
    daemon = start_daemon(cfg, log)
    try:
        summary["oom"] = wait_event(log, "server_oom", 120)
        summary["reset"] = wait_event(log, "gpu_reset", 120)
        summary["ready"] = wait_event(log, "server_ready", 180)
    finally:
        summary["daemon_exit"] = stop_daemon(daemon)
        hog.kill()
        summary["hog_rest"] = hog.communicate(timeout=30)[0].strip()
    if Path(tmp / "server.log").exists():
        lines = Path(tmp / "server.log").read_text(errors="replace").splitlines()
        (out / "run_b_server_oom_lines.txt").write_text(
            "\n".join(ln for ln in lines if "CUDA" in ln or "alloc" in ln or "out of memory" in ln)[:20000] + "\n")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stub = ROOT / "scripts" / "stub_gpu_reset.py"
    result = {"run_a": run_a(args, out, stub), "run_b": run_b(args, out, stub)}
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
