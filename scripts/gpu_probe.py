#!/usr/bin/env python3
"""Read-only probe of the real GPU through llama_guard.gpu (the fixture tests/fixtures/h200_gpu_watch.json).

What it does, all READ-ONLY (no reset, no persistence/clock/power-limit change — the only writing
call of the chokepoint, ``Nvml.set_persistence``, is never called here):

1. opens the GPU by index, by uuid and by PCI bus id (the three must agree);
2. takes ``--samples`` samples every ``--interval`` s, timing each (µs wall, µs CPU) and the
   watcher's ``observe``; then ``--bench`` back-to-back samples for the CPU cost per hour at
   the default ``[gpu].sample_interval_s`` (10 s);
3. starts a second process that allocates ``--alloc-gib`` GiB with torch and shows it reported as
   ``gpu_foreign_process`` (pid, MiB), and not reported once it is told to be the server;
4. stops it and measures how long until its VRAM is released (``vram_released``);
5. registers for NVML Xid events and waits 200 ms (NVML's Timeout is the normal answer);
6. opens /dev/kmsg at its end (only new records) and parses the NVRM lines already in the
   buffer (read separately) with the kernel-log parser.

Run on the device (see scripts/README-gpu-probe.md)::

    PYTHONUNBUFFERED=1 PYTHONPATH=supervisor python3 scripts/gpu_probe.py --out $OUT/h200_gpu_watch.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from llama_guard.gpu.kmsg import KmsgOff, KmsgParser, open_kmsg, strip_prefix
from llama_guard.gpu.nvml import Nvml
from llama_guard.gpu.nvml_errors import NvmlError
from llama_guard.gpu.nvml_session import DeviceSelector
from llama_guard.gpu.readings import GpuSample, sample_to_dict
from llama_guard.gpu.rules import GpuWatch, WatchSettings, server_on_gpu, vram_released

CHILD = r"""
import os, sys, torch
n = int(sys.argv[1]) << 30
x = torch.empty(n, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print("ready", os.getpid(), flush=True)
sys.stdin.readline()
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_sample(nvml: Nvml) -> tuple[GpuSample, float, float]:
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    sample = nvml.sample()
    w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    return sample, (w1 - w0) / 1000, (c1 - c0) / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--bench", type=int, default=500)
    ap.add_argument("--alloc-gib", type=int, default=4)
    ap.add_argument("--index", type=int, default=0)
    args = ap.parse_args()
    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "host": {"python": sys.version.split()[0], "platform": platform.platform(), "euid": os.geteuid(),
                 "pid": os.getpid()},
        "writes": "none (read-only probe)",
    }
    try:
        import pynvml  # only for its version string; all calls go through llama_guard.gpu.nvml

        result["host"]["pynvml_file"] = getattr(pynvml, "__file__", "?")
    except ImportError as exc:
        result["host"]["pynvml_file"] = f"missing: {exc}"
    settings = WatchSettings()
    nvml = Nvml(DeviceSelector(index=args.index))
    try:
        ident = nvml.open()
    except NvmlError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        return write(args.out, result)
    result["identity"] = sample_to_dict(nvml.sample())["identity"]

    # 1. selection by uuid and by PCI bus id must find the same GPU.
    sel: dict[str, Any] = {}
    for label, selector in (("uuid", DeviceSelector(uuid=ident.uuid)),
                            ("pci_bus_id", DeviceSelector(pci_bus_id=ident.pci_bus_id)),
                            ("pci_bus_id_nvml_form", DeviceSelector(pci_bus_id="0000" + ident.pci_bus_id))):
        other = Nvml(selector)
        try:
            sel[label] = {"selector": selector.describe(), "uuid": other.open().uuid}
        except NvmlError as exc:
            sel[label] = {"selector": selector.describe(), "error": f"{type(exc).__name__}: {exc}"}
        finally:
            other.close()
    result["selection"] = sel

    # 2. paced samples through the watcher, then a back-to-back benchmark.
    watch = GpuWatch(settings)
    start = time.monotonic()
    samples, wall, cpu, observe_us, events = [], [], [], [], []
    for i in range(args.samples):
        s, w, c = timed_sample(nvml)
        t0 = time.perf_counter_ns()
        evs = watch.observe(s, time.monotonic() - start)
        observe_us.append((time.perf_counter_ns() - t0) / 1000)
        samples.append(sample_to_dict(s))
        wall.append(w)
        cpu.append(c)
        events += [{"t": round(time.monotonic() - start, 3), "name": n, "fields": f} for n, f in evs]
        if i + 1 < args.samples:
            time.sleep(args.interval)
    bench_wall, bench_cpu = [], []
    p0 = time.process_time()
    for _ in range(args.bench):
        _, w, c = timed_sample(nvml)
        bench_wall.append(w)
        bench_cpu.append(c)
    proc_cpu_per_sample_us = (time.process_time() - p0) / max(1, args.bench) * 1e6
    per_hour = 3600.0 / 10.0
    cpu_us = statistics.mean(bench_cpu) + statistics.mean(observe_us)
    result["timing"] = {
        "paced": {"n": len(wall), "interval_s": args.interval, "wall_us": [round(x, 1) for x in wall],
                  "cpu_us": [round(x, 1) for x in cpu], "observe_us": [round(x, 1) for x in observe_us]},
        "bench": {"n": args.bench, "wall_us_median": round(statistics.median(bench_wall), 1),
                  "wall_us_p90": round(pct(bench_wall, 0.9), 1), "wall_us_max": round(max(bench_wall), 1),
                  "thread_cpu_us_mean": round(statistics.mean(bench_cpu), 1),
                  "process_cpu_us_per_sample": round(proc_cpu_per_sample_us, 1)},
        "observe_us_median": round(statistics.median(observe_us), 1),
        "default_interval_s": 10.0,
        "cpu_s_per_hour_at_default_interval": round(cpu_us * per_hour / 1e6, 4),
        "wall_s_per_hour_at_default_interval": round(
            (statistics.median(bench_wall) + statistics.median(observe_us)) * per_hour / 1e6, 4),
    }
    result["baseline"] = {"samples": samples, "events": events,
                          "unsupported": list(samples[-1]["unsupported"]) if samples else []}
    print(json.dumps(result["timing"]["bench"]), flush=True)

    # 3. a foreign process holding VRAM.
    result["foreign"] = foreign_phase(nvml, settings, args.alloc_gib, start)

    # 5. Xid events: register and wait briefly (read-only).
    xid: dict[str, Any] = {}
    try:
        es = nvml.xid_event_set()
        t0 = time.perf_counter()
        got = es.wait(200)
        xid = {"registered": True, "wait_ms": round((time.perf_counter() - t0) * 1000, 1), "xid": got}
        es.close()
    except NvmlError as exc:
        xid = {"registered": False, "error": f"{type(exc).__name__}: {exc}"}
    result["xid"] = xid

    # 6. kernel log.
    result["kmsg"] = kmsg_phase(ident.pci_bus_id)
    nvml.close()
    return write(args.out, result)


def foreign_phase(nvml: Nvml, settings: WatchSettings, gib: int, start: float) -> dict[str, Any]:
    out: dict[str, Any] = {"alloc_gib": gib}
    before = nvml.sample()
    out["before"] = sample_to_dict(before)
    t0 = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(gib)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out["child_pid"] = child.pid
    try:
        line = ""
        deadline = time.monotonic() + 150
        assert child.stdout is not None
        while time.monotonic() < deadline and not line.startswith("ready"):
            line = child.stdout.readline()
            if not line and child.poll() is not None:
                break
        out["child_ready_after_s"] = round(time.monotonic() - t0, 2)
        if not line.startswith("ready"):
            out["error"] = f"child never ready (rc={child.poll()}): {child.stderr.read() if child.stderr else ''}"
            return out
        # Our "server" is this probe (no CUDA context): the child is foreign.
        elsewhere = GpuWatch(settings)
        elsewhere.set_server_pid(os.getpid(), 0.0)
        # The child declared as the server: nothing foreign.
        as_server = GpuWatch(settings)
        as_server.set_server_pid(child.pid, 0.0)
        during, ev_else, ev_server = [], [], []
        for _ in range(8):
            s = nvml.sample()
            now = time.monotonic() - start
            during.append(sample_to_dict(s))
            ev_else += [{"name": n, "fields": f} for n, f in elsewhere.observe(s, now)]
            ev_server += [{"name": n, "fields": f} for n, f in as_server.observe(s, now)]
            time.sleep(0.25)
        out.update(samples=during, events_server_is_probe=ev_else, events_server_is_child=ev_server,
                   server_on_gpu_child=server_on_gpu(s, child.pid),
                   server_on_gpu_probe=server_on_gpu(s, os.getpid()))
        # 4. stop it and wait (bounded) for its VRAM to come back.
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.flush()
        t_stop = time.monotonic()
        released = None
        polls = 0
        while time.monotonic() - t_stop < 30:
            s = nvml.sample()
            polls += 1
            released = vram_released(s, child.pid, baseline_used_bytes=before.memory_used_bytes)
            if released:
                break
            time.sleep(0.05)
        out["release"] = {"released": released, "after_s": round(time.monotonic() - t_stop, 3), "polls": polls,
                          "child_rc": child.wait(timeout=30), "sample": sample_to_dict(s)}
        return out
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def kmsg_phase(pci: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reader = open_kmsg()
    if isinstance(reader, KmsgOff):
        out["reader"] = reader.message
    else:
        out["reader"] = "open at end"
        out["new_records_in_0_2_s"] = len(reader.poll(0.2))
        reader.close()
    # The records already in the buffer, read separately (not seeking to the end), NVRM only.
    records: list[str] = []
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        try:
            while len(records) < 5000:
                try:
                    chunk = os.read(fd, 8192)
                except BlockingIOError:
                    break
                except BrokenPipeError:
                    continue
                if not chunk:
                    break
                records.append(chunk.decode("utf-8", "replace").rstrip("\n"))
        finally:
            os.close(fd)
    except OSError as exc:
        out["buffer_error"] = str(exc)
    nvrm = [r for r in records if "NVRM" in r]
    parser = KmsgParser(pci)
    parsed = [rec.__dict__ for line in nvrm for rec in parser.feed(line)]
    out.update(buffer_records=len(records), nvrm_records=nvrm[-40:],
               nvrm_stripped=[strip_prefix(r) for r in nvrm[-40:]], parsed_xids=parsed)
    return out


def write(path: str, result: dict[str, Any]) -> int:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    print(json.dumps({k: result.get(k) for k in ("identity", "timing", "xid")}, default=str)[:6000])
    print("foreign events:", json.dumps(result.get("foreign", {}).get("events_server_is_probe"), default=str))
    print("release:", json.dumps({k: v for k, v in result.get("foreign", {}).get("release", {}).items()
                                  if k != "sample"}, default=str))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
