#!/usr/bin/env python3
"""Raw VRAM and speed readings of a real CUDA llama-server — READ-ONLY for the GPU.

For each llama-server configuration below: start the server, wait for ``/health`` 200, read NVML's
memory figure for the server's pid (``nvmlDeviceGetComputeRunningProcesses``) and the GPU's used
memory, keep the server's load log (its buffer-size lines), then stop it. For the reference
configuration with flash attention on and off: one warm-up and N chat completions of M generated
tokens (``ignore_eos``), keeping the server's own ``timings``. Also records the memory bus width and
the maximum memory clock (the bandwidth ceiling's inputs).

The output (one JSON file) is a fixture: tests/insight/test_budget_h200_fixture.py replays it through
``llama_guard.insight`` (budget and ceiling) — the expectations come from the code, not the file.
Nothing here changes the GPU's persistence mode, clocks or power limit; nothing resets it.

    python3 scripts/gpu_vram_measure.py --server build/bin/llama-server --model M.gguf --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pynvml  # nvidia-ml-py

REFERENCE = ["-ngl", "99", "-c", "8192", "-np", "1", "-b", "512", "-ub", "256",
             "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
CONFIGS: dict[str, list[str]] = {
    "reference": REFERENCE,
    "ctx32768": ["-ngl", "99", "-c", "32768", "-np", "1", "-b", "512", "-ub", "256",
                 "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
    "f16_kv": ["-ngl", "99", "-c", "8192", "-np", "1", "-b", "512", "-ub", "256", "-fa", "on"],
    "fa_off": ["-ngl", "99", "-c", "8192", "-np", "1", "-b", "512", "-ub", "256", "-fa", "off"],
    "ubatch1024": ["-ngl", "99", "-c", "8192", "-np", "1", "-b", "2048", "-ub", "1024",
                   "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
    "parallel4": ["-ngl", "99", "-c", "16384", "-np", "4", "-b", "512", "-ub", "256",
                  "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
    "ngl10": ["-ngl", "10", "-c", "8192", "-np", "1", "-b", "512", "-ub", "256",
              "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
    "ngl0": ["-ngl", "0", "-c", "512", "-np", "1", "-b", "512", "-ub", "256", "-fa", "on"],
}


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except OSError:
        return 0, b""


def chat(port: int, tokens: int) -> dict[str, Any]:
    body = json.dumps({"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
                       "max_tokens": tokens, "ignore_eos": True, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        data: dict[str, Any] = json.loads(r.read())
    return dict(data["timings"])


def start(server: str, model: str, port: int, flags: list[str], log: Path) -> subprocess.Popen[bytes]:
    argv = [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--metrics", "-t", "8", *flags]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-2000:]}")
        if get(f"http://127.0.0.1:{port}/health")[0] == 200:
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("not ready in 120 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def pid_mib(handle: Any, pid: int) -> int | None:
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if p.pid == pid and p.usedGpuMemory is not None:
            return int(p.usedGpuMemory) >> 20
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--port", type=int, default=18190)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    result: dict[str, Any] = {
        "gpu": {"name": pynvml.nvmlDeviceGetName(h), "driver": pynvml.nvmlSystemGetDriverVersion(),
                "memory_total_bytes": pynvml.nvmlDeviceGetMemoryInfo(h).total,
                "bus_width_bits": pynvml.nvmlDeviceGetMemoryBusWidth(h),
                "max_mem_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)},
        "model_file": Path(args.model).name, "model_bytes": Path(args.model).stat().st_size,
        "configs": {}, "bench": {}}
    for name, flags in CONFIGS.items():
        log = args.out / f"server_{name}.log"
        used_before = pynvml.nvmlDeviceGetMemoryInfo(h).used
        proc = start(args.server, args.model, args.port, flags, log)
        time.sleep(1.0)
        mib = pid_mib(h, proc.pid)
        used_after = pynvml.nvmlDeviceGetMemoryInfo(h).used
        stop(proc)
        lines = [ln for ln in log.read_text(errors="replace").splitlines()
                 if "buffer size" in ln or "n_ctx" in ln or "offload" in ln or "KV" in ln]
        result["configs"][name] = {"flags": flags, "pid_mib": mib,
                                   "used_delta_mib": (used_after - used_before) >> 20, "log_lines": lines}
        print(f"{name:12} pid {mib} MiB, used delta {(used_after - used_before) >> 20} MiB", flush=True)
    # Flash attention on/off (a quantized V cache needs it on, so the A/B uses an f16 cache).
    f16 = ["-ngl", "99", "-c", "8192", "-np", "1", "-b", "512", "-ub", "256"]
    bench_flags = {"reference": REFERENCE, "f16_fa_on": [*f16, "-fa", "on"], "f16_fa_off": [*f16, "-fa", "off"]}
    for name, flags in bench_flags.items():
        proc = start(args.server, args.model, args.port, flags, args.out / f"bench_{name}.log")
        try:
            chat(args.port, 16)  # warm-up
            runs = [chat(args.port, args.tokens) for _ in range(args.runs)]
        finally:
            stop(proc)
        eval_tps = [r["predicted_per_second"] for r in runs]
        result["bench"][name] = {"flags": flags, "runs": runs, "median_eval_tps": statistics.median(eval_tps)}
        print(f"bench {name}: median {statistics.median(eval_tps):.1f} eval tok/s", flush=True)
    (args.out / "vram_measure.json").write_text(json.dumps(result, indent=1))
    pynvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
