#!/usr/bin/env python3
"""`check`'s VRAM budget against NVML's figure for the real server, and `bench` with its ceiling.

For each context size (default 8192 and 32768) with the reference flags (``-ngl 99 -np 1 -b 512 -ub 256
-ctk q8_0 -ctv q8_0 -fa on``):

1. ``llama-guard check --json`` on a config for that context → ``check-<ctx>.json``;
2. a real llama-server started from the same config (llama-guard's own argv), one warm-up completion,
   then NVML's used memory for the server's pid → ``nvml-<ctx>.json`` (skipped with a note when NVML
   is not available: the CPU build);
3. ``llama-guard bench --json`` against that server → ``bench-<ctx>.json``; NVML read again after it;
4. the server's log → ``server-<ctx>.log``.

``summary.json`` puts the predicted total next to NVML's figure (and the error in %), the server's own
buffer sizes when its log prints them, and the bench's median, ceiling and efficiency.
READ-ONLY for the GPU: nothing is reset or reconfigured. See scripts/README-gpu-e2e.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "supervisor"))

from llama_guard.config import load_config  # noqa: E402
from llama_guard.tune.bench import BenchError, completion, spawned_server  # noqa: E402
from llama_guard.vocab.units import MIB  # noqa: E402

BUFFER_LINE = re.compile(r"(\S+)\s+(model|KV|compute|output|RS) buffer size\s*=\s*([\d.]+) MiB")
PROJECTED = re.compile(r"(\S*)\s*projected to use (\d+) MiB of (device|host) memory")


REFERENCE = {"n_gpu_layers": 99, "ctx_size": 8192, "parallel": 1, "batch_size": 512, "ubatch_size": 256,
             "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"}


def toml(value: object) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value)


def config_text(binary: str, model: str, port: int, flags: dict[str, object], runtime: Path) -> str:
    """A config with the reference ``[server]`` flags, ``flags`` overriding them."""
    keys = "\n".join(f"{k} = {toml(v)}" for k, v in {**REFERENCE, **flags}.items())
    return f"""
[server]
binary = "{binary}"
model = "{model}"
port = {port}
{keys}
threads = {min(8, os.cpu_count() or 1)}
# -lv 4: the load log then prints each buffer's size and llama.cpp's own -fit projection.
extra_args = ["-lv", "4"]

[health]
load_timeout_s = 300

[runtime]
dir = "{runtime}"
"""


def flag_set(text: str) -> tuple[str, dict[str, object]]:
    """``NAME:key=value,key=value`` (``[server]`` keys; integers as such) → (NAME, overrides)."""
    name, _, rest = text.partition(":")
    flags: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        flags[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return name, flags


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "supervisor"),
                                                                     os.environ.get("PYTHONPATH", "")]))}
    return subprocess.run([sys.executable, "-m", "llama_guard", *args], capture_output=True, text=True,
                          timeout=900, check=False, env=env)


def nvml_used_by(pid: int) -> dict[str, Any]:
    """NVML's used memory for ``pid`` (MiB) and the GPU's totals, or ``{"skipped": reason}``."""
    try:
        import pynvml
    except ImportError as exc:
        return {"skipped": f"pynvml not importable ({exc})"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"skipped": f"NVML not available here ({exc}): CPU build or no driver"}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        procs = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        used = procs.get(pid)
        return {"pid": pid, "pid_used_mib": None if used is None else used / MIB,
                "gpu_used_mib": mem.used / MIB, "gpu_total_mib": mem.total / MIB,
                "processes": {str(k): (v or 0) / MIB for k, v in procs.items()},
                "note": "" if used is not None else "the server's pid is not in NVML's process list"}
    finally:
        pynvml.nvmlShutdown()


def buffers(log_text: str) -> list[dict[str, Any]]:
    """The ``<device> <kind> buffer size = <n> MiB`` lines llama.cpp prints while loading."""
    return [{"device": m.group(1), "kind": m.group(2), "mib": float(m.group(3))}
            for m in BUFFER_LINE.finditer(log_text)]


def one_context(args: argparse.Namespace, ctx: int | str, out: Path, flags: dict[str, object] | None = None
                ) -> dict[str, Any]:
    """One flag set (``ctx``: the context size, or the set's name when ``flags`` are given)."""
    flags = {"ctx_size": ctx} if flags is None else flags
    runtime = out / f"run-{ctx}"
    runtime.mkdir(parents=True, exist_ok=True)
    cfg_path = out / f"config-{ctx}.toml"
    cfg_path.write_text(config_text(args.binary, args.model, args.port, flags, runtime))
    checked = cli("check", "--json", "--config", str(cfg_path))
    (out / f"check-{ctx}.json").write_text(checked.stdout or json.dumps({"stderr": checked.stderr}))
    row: dict[str, Any] = {"ctx_size": {**REFERENCE, **flags}["ctx_size"], "flags": {**REFERENCE, **flags},
                           "name": str(ctx), "check_exit": checked.returncode}
    try:
        vram = next(c for c in json.loads(checked.stdout)["checks"] if c["name"] == "vram budget")
        row["predicted_total_mib"] = vram["data"]["budget"]["total_mib"]
        row["predicted"] = {k: vram["data"]["budget"][f"{k}_mib"]
                            for k in ("weights_gpu", "kv_cache", "compute", "overhead")}
    except (ValueError, KeyError, StopIteration, TypeError) as exc:
        row["predicted_error"] = f"no VRAM budget in check's output: {exc!r}"
    config = load_config(cfg_path)
    log = out / f"server-{ctx}.log"
    try:
        with spawned_server(config, log) as proc:
            import httpx

            with httpx.Client(base_url=config.server.base_url, timeout=300, trust_env=False) as client:
                completion(client, 64, "Say hello.")  # warm-up: the memory pools grow on first use
            time.sleep(0.5)
            row["nvml_after_warmup"] = nvml_used_by(proc.pid)
            (out / f"nvml-{ctx}.json").write_text(json.dumps(row["nvml_after_warmup"], indent=1))
            bench = cli("bench", "--json", "--runs", str(args.runs), "--tokens", str(args.tokens),
                        "--config", str(cfg_path))
            (out / f"bench-{ctx}.json").write_text(bench.stdout or json.dumps({"stderr": bench.stderr}))
            row["bench_exit"] = bench.returncode
            row["nvml_after_bench"] = nvml_used_by(proc.pid)
            try:
                result = json.loads(bench.stdout)["results"][0]
                ceiling = result.get("ceiling") or {}
                row["bench"] = {"eval_median": result["eval_tokens_per_s"]["median"],
                                "prompt_median": result["prompt_tokens_per_s"]["median"],
                                "context": result["context"],
                                "ceiling_tokens_per_s": ceiling.get("ceiling_tokens_per_s"),
                                "efficiency": ceiling.get("efficiency"), "verdict": ceiling.get("verdict")}
            except (ValueError, KeyError, IndexError) as exc:
                row["bench_error"] = f"{exc!r}: {bench.stderr[-500:]}"
    except BenchError as exc:
        row["server_error"] = str(exc)
    text = log.read_text(errors="replace") if log.exists() else ""
    row["server_buffers"] = buffers(text)
    row["llama_cpp_projection"] = [{"where": m.group(1), "mib": int(m.group(2)), "memory": m.group(3)}
                                   for m in PROJECTED.finditer(text)]
    measured = (row.get("nvml_after_bench") or {}).get("pid_used_mib")
    if measured and row.get("predicted_total_mib"):
        row["measured_mib"] = measured
        row["error_percent"] = round(100.0 * (row["predicted_total_mib"] - measured) / measured, 1)
    elif "skipped" in (row.get("nvml_after_warmup") or {}):
        row["measured_note"] = row["nvml_after_warmup"]["skipped"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", required=True, help="llama-server (CUDA build on the GPU box)")
    parser.add_argument("--model", required=True, help="the GGUF model")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--flag-set", action="append", default=[], metavar="NAME:key=value,...",
                        help="instead of --contexts: named [server] overrides of the reference flags, e.g. "
                             "'ngl40:n_gpu_layers=40' (repeatable)")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--port", type=int, default=18093)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.flag_set:
        rows = [one_context(args, name, out, flags) for name, flags in map(flag_set, args.flag_set)]
    else:
        rows = [one_context(args, ctx, out) for ctx in args.contexts]
    summary = {"binary": args.binary, "model": args.model, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for r in rows:
        measured = r.get("measured_mib")
        line = (f"{r['name']} (ctx {r['ctx_size']}): predicted {r.get('predicted_total_mib')} MiB, "
                + (f"NVML {measured:.0f} MiB ({r['error_percent']:+.1f} %)" if measured else
                   f"NVML: {r.get('measured_note') or r.get('server_error') or 'no figure'}"))
        if r.get("bench"):
            b = r["bench"]
            line += f"; bench median {b['eval_median']:.1f} tokens/s, ceiling {b['ceiling_tokens_per_s']}"
        print(line)
    return 0 if all("server_error" not in r and r.get("bench_exit") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
