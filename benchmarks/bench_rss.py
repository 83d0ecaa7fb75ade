#!/usr/bin/env python3
"""The daemon's memory: RSS of ``llama-guard run`` 12 s after ``server_ready``, GPU watch on and off, and what
of it is the NVIDIA library's own mapping.

Rows, each ``--rounds`` times (interleaved, one port), for every code tree (``--code NAME=DIR``):

- ``python (bare)``: a Python interpreter that only sleeps (the floor of any Python daemon);
- ``python + asyncio``: the event loop's modules (with ``ssl``, which asyncio imports: libssl, libcrypto);
- ``python + aiohttp`` / ``python + aiohttp + httpx``: the HTTP stack the daemon serves and speaks with
  (its server, and a client session made), alone and with httpx's client beside it (what a second client
  stack cost the daemon);
- ``python + aiohttp + pydantic``: that, and the configuration's libraries (pydantic, pydantic-settings);
- ``[tree] python + the daemon's imports``: a process that imports every module the tree's daemon (GPU
  watch off) imported, taken from its ``-X importtime`` log, and nothing else: ``llama-guard run`` started on
  a configuration with an error (its imports at start made its own way; then exit 78, caught), then the
  rest of the list; what the daemon's code costs before it runs (running adds threads, buffers, objects);
- ``python + pynvml imported`` and ``python + NVML opened`` (``--nvml real`` only): a bare process that
  imports pynvml (the Python bindings), then one that also calls ``nvmlInit`` and takes the GPU's handle:
  what the NVIDIA library maps and allocates by itself;
- ``daemon, GPU watch off`` / ``daemon, GPU watch on``: ``/proc/<pid>/status`` VmRSS of the daemon
  (``--arena-max N``: also GPU watch on with ``MALLOC_ARENA_MAX=N``);
- per process, ``/proc/<pid>/smaps`` split into the NVIDIA libraries and devices (``libnvidia-ml``,
  ``libcuda``, ``/dev/nvidia*``),
  other shared objects, and anonymous memory (the Python heap: modules, objects);
- ``CPU ms`` (the ``python + …`` rows): the CPU time the process took to import what it imports (its
  start-up included), what those imports add to the daemon's start before it can spawn the server.

The daemon runs with ``PYTHONPROFILEIMPORTTIME=1`` in one extra pass per tree and GPU mode (first), so the
heavy modules it imported (numpy, gguf, aiohttp, pydantic, apscheduler, prometheus_client, httpx, structlog)
are listed from its own import log, and the import-only row above is built from it.

    . .work/real/env && .venv/bin/python benchmarks/bench_rss.py                      # fake NVML
    python3 benchmarks/bench_rss.py --nvml real --ngl 99 --binary B --model M --json out.json   # a GPU host
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_start import Tree, sections, wait_port_free  # noqa: E402
from benchlib import sized  # noqa: E402
from harness import DaemonRun, free_port  # noqa: E402

KIB = 1024
HEAVY = ("numpy", "gguf", "aiohttp", "pydantic", "pydantic_core", "pydantic_settings", "apscheduler",
         "prometheus_client", "httpx", "structlog", "psutil", "pynvml", "tzlocal", "logging_journald", "asyncio",
         "uvloop")
NVIDIA = re.compile(r"lib(nvidia-ml|cuda)\b|/dev/nvidia")


def rss_parts(pid: int) -> dict[str, float]:
    """MiB: ``rss`` (VmRSS), and smaps' Rss summed per kind of mapping."""
    status = Path(f"/proc/{pid}/status").read_text()
    vmrss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * KIB  # type: ignore[union-attr]
    parts = {"nvidia": 0, "other .so": 0, "anon": 0, "other": 0}
    kind = "other"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and re.match(r"^[0-9a-f]+-[0-9a-f]+$", fields[0]):
            path = fields[5] if len(fields) > 5 else ""
            kind = ("nvidia" if NVIDIA.search(path) else "other .so" if ".so" in path
                    else "anon" if not path or path.startswith("[") else "other")
        elif fields and fields[0] == "Rss:":
            parts[kind] += int(fields[1]) * KIB
    return {"rss": vmrss / 2**20, **{k: v / 2**20 for k, v in parts.items()}}


def sleeper(code: str, env: dict[str, str]) -> dict[str, float]:
    """RSS parts of ``python -c code`` once it printed ``ready``, and ``cpu_ms``: the CPU time it took
    to get there (``time.process_time()``: start-up and ``code``, user and system; unlike wall time, not
    stretched by other processes on a loaded host)."""
    proc = subprocess.Popen([sys.executable, "-c", code + "\nimport time\nprint('ready', time.process_time(), "
                             "flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    try:
        assert proc.stdout is not None
        cpu_s = float(proc.stdout.readline().split()[1])
        time.sleep(0.5)
        return {**rss_parts(proc.pid), "cpu_ms": cpu_s * 1000}
    finally:
        proc.kill()
        proc.wait()


NVML_ONLY = "import pynvml\npynvml.nvmlInit()\npynvml.nvmlDeviceGetHandleByIndex(0)"
AIOHTTP = ("import asyncio\nimport aiohttp\nfrom aiohttp import web\n"
           "async def session():\n    await aiohttp.ClientSession().close()\nasyncio.run(session())")
LAYERS = {"python + asyncio": "import asyncio", "python + aiohttp": AIOHTTP,
          "python + aiohttp + httpx": AIOHTTP + "\nimport httpx\nhttpx.AsyncClient()",
          "python + aiohttp + pydantic": AIOHTTP + "\nimport pydantic\nimport pydantic_settings"}


def import_all(modules: list[str], bad_config: Path) -> str:
    """Code that starts ``llama-guard run`` on ``bad_config`` (a configuration error: the verb imports what
    it imports at its start, its own way, then exits 78), then imports the rest of ``modules`` (the names of
    one import log), skipping any that cannot be imported on its own (a test double's module)."""
    return ("import contextlib, importlib, io\nfrom llama_guard.app.cli import main\n"
            "with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):\n"
            f"    main(['run', '--config', {str(bad_config)!r}])\n"
            f"for name in {modules!r}:\n    try:\n        importlib.import_module(name)\n"
            "    except Exception:\n        pass")


def daemon_rss(tree: Tree, args: argparse.Namespace, tmp: Path, port: int, script: Path, gpu: str,
               importtime: bool = False, extra_env: dict[str, str] | None = None) -> tuple[dict[str, float], list[str]]:
    tmp.mkdir(parents=True, exist_ok=True)
    secs = sections(args, tmp, args.model, port)
    secs["gpu"]["enabled"] = gpu
    if gpu == "off":
        secs["gpu"]["require_server_on_gpu"] = False
    env = tree.env({"FAKE_NVML_SCRIPT": str(script), **({"PYTHONPROFILEIMPORTTIME": "1"} if importtime else {}),
                    **(extra_env or {})})
    run = DaemonRun(tmp, secs, env=env, command=tree.command())
    run.start()
    try:
        run.wait_event("server_ready", 600.0)
        time.sleep(args.after)
        parts = rss_parts(run.pid)
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            run.stop()
        wait_port_free(port)
    modules: list[str] = []
    if importtime:
        for line in run.log_path.read_text(errors="replace").splitlines():
            m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", line)
            if m:
                modules.append(m.group(1))
    return parts, modules


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=os.environ.get("LLAMA_SERVER_BIN", ""))
    ap.add_argument("--model", default=os.environ.get("LLAMA_GUARD_TEST_MODEL", ""))
    ap.add_argument("--nvml", choices=("fake", "real"), default="fake")
    ap.add_argument("--code", action="append", default=[], help="NAME=DIR: a tree to measure (repeatable)")
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--ctk", default="f16")
    ap.add_argument("--fa", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=sized(2, 1), help="rounds (2; CI 1)")
    ap.add_argument("--after", type=float, default=12.0, help="seconds after server_ready (default 12)")
    ap.add_argument("--arena-max", type=int, default=0,
                    help="also run GPU watch on with MALLOC_ARENA_MAX=N (glibc's per-thread malloc arenas)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not args.binary or not args.model:
        ap.error("--binary and --model (or $LLAMA_SERVER_BIN, $LLAMA_GUARD_TEST_MODEL) are required")
    pairs = [c.split("=", 1) if "=" in c else (Path(c).name, c) for c in args.code] or [("this", str(ROOT))]
    trees = [Tree(name, Path(root), args.nvml) for name, root in pairs]
    port = free_port()
    rows: dict[str, list[dict[str, float]]] = {}
    modules: dict[str, dict[str, list[str]]] = {}
    imports: dict[str, list[str]] = {}  # per tree: every module its daemon (GPU watch off) imported, in order
    with tempfile.TemporaryDirectory(prefix="bench-rss-") as tmpdir:
        tmp = Path(tmpdir)
        script = tmp / "nvml.json"
        script.write_text("{}")
        bad_config = tmp / "bad.toml"
        bad_config.write_text("[server]\nport = -1\n")
        for tree in trees:
            tree.byte_compile()
            for gpu in ("off", "on"):
                _, mods = daemon_rss(tree, args, tmp / f"{tree.name}-{gpu}-it", port, script, gpu, importtime=True)
                modules.setdefault(tree.name, {})[gpu] = sorted({m for m in mods if m in HEAVY})
                if gpu == "off":
                    imports[tree.name] = mods
        for r in range(args.rounds):
            rows.setdefault("python (bare)", []).append(sleeper("pass", {}))
            for name, code in LAYERS.items():
                rows.setdefault(name, []).append(sleeper(code, {}))
            for tree in trees:
                rows.setdefault(f"[{tree.name}] python + the daemon's imports", []).append(
                    sleeper(import_all(imports[tree.name], bad_config), tree.env({})))
            if args.nvml == "real":
                rows.setdefault("python + pynvml imported", []).append(sleeper("import pynvml", {}))
                rows.setdefault("python + NVML opened", []).append(sleeper(NVML_ONLY, {}))
                print(f"  python + NVML opened: {rows['python + NVML opened'][-1]}", flush=True)
            order = trees[r % len(trees):] + trees[:r % len(trees)]
            for tree in order:
                modes = [("off", {}), ("on", {})]
                if args.arena_max:
                    modes.append(("on", {"MALLOC_ARENA_MAX": str(args.arena_max)}))
                for gpu, extra in modes:
                    parts, _ = daemon_rss(tree, args, tmp / f"{tree.name}-{gpu}-{r}", port, script, gpu,
                                          extra_env=extra)
                    name = f"[{tree.name}] daemon, GPU watch {gpu}" + "".join(f", {k}={v}" for k, v in extra.items())
                    rows.setdefault(name, []).append(parts)
                    print(f"  {name}: {parts['rss']:.1f} MiB (NVIDIA libs {parts['nvidia']:.1f}, anon "
                          f"{parts['anon']:.1f})", flush=True)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\nhost {platform.node()} ({os.cpu_count()} cores); GPU watch through {args.nvml} NVML; "
          f"RSS {args.after:.0f} s after server_ready; MiB, median of {args.rounds}")
    head = (f"{'process':<40} {'VmRSS':>7} {'NVIDIA libs':>12} {'other .so':>10} {'anon':>7} {'other':>7} "
            f"{'CPU ms':>7}")
    print(head)
    print("-" * len(head))
    med: dict[str, dict[str, float]] = {}
    for name, samples in rows.items():
        med[name] = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        m = med[name]
        print(f"{name:<40} {m['rss']:>7.1f} {m['nvidia']:>12.1f} {m['other .so']:>10.1f} {m['anon']:>7.1f} "
              f"{m['other']:>7.1f} " + (f"{m['cpu_ms']:>7.0f}" if "cpu_ms" in m else f"{'':>7}"))
    for tree, by_gpu in modules.items():
        for gpu, mods in by_gpu.items():
            print(f"[{tree}] GPU watch {gpu}: heavy modules imported: {', '.join(mods) or 'none'}")
    if args.json:
        args.json.write_text(json.dumps({"host": platform.node(), "nvml": args.nvml, "after_s": args.after,
                                         "rounds": rows, "median": med, "modules": modules}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
