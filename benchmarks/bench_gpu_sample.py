#!/usr/bin/env python3
"""Cost of one GPU sample and of the GPU watch per hour (µs wall, µs CPU, CPU s/hour).

Here it runs against the fake NVML of tests/fake_nvml.py (pure Python overhead of the chokepoint and
the rules). With ``--real`` it uses the real pynvml on this host's GPU, READ-ONLY. The numbers of the
real H200 come from scripts/gpu_probe.py (tests/fixtures/h200_gpu_watch.json, key "timing"); this
script prints them beside the local ones when that fixture is present.

    PYTHONPATH=supervisor:tests .venv/bin/python benchmarks/bench_gpu_sample.py [--n 2000] [--real]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests")]

from llama_guard.gpu.nvml import Nvml  # noqa: E402
from llama_guard.gpu.nvml_session import DeviceSelector  # noqa: E402
from llama_guard.gpu.rules import GpuWatch  # noqa: E402


def measure(nvml: Nvml, n: int) -> dict[str, float]:
    watch = GpuWatch(proc_name=lambda pid: None)
    watch.set_server_pid(1, 0.0)
    nvml.sample()  # warm: init, static readings
    wall, cpu, obs = [], [], []
    for i in range(n):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        s = nvml.sample()
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        watch.observe(s, float(i))
        obs.append((time.perf_counter_ns() - w1) / 1000)
        wall.append((w1 - w0) / 1000)
        cpu.append((c1 - c0) / 1000)
    per_sample_cpu = statistics.mean(cpu) + statistics.mean(obs)
    return {"sample_wall_us_median": statistics.median(wall),
            "sample_wall_us_p90": sorted(wall)[int(0.9 * n)],
            "sample_cpu_us_mean": statistics.mean(cpu),
            "observe_us_median": statistics.median(obs),
            "cpu_s_per_hour_at_10s": per_sample_cpu * 360 / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description="GPU sample cost")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--real", action="store_true", help="use the real pynvml (read-only)")
    args = ap.parse_args()
    if args.real:
        label, nvml = "this host (real NVML)", Nvml(DeviceSelector())
    else:
        from fake_nvml import FakeNvml

        fake = FakeNvml()
        fake.gpus[0].values["processes"] = [(1, 1 << 30), (2, 1 << 30)]
        label, nvml = "fake NVML (Python overhead only)", Nvml(module=fake)
    rows = [(label, measure(nvml, args.n))]
    fixture = ROOT / "tests" / "fixtures" / "h200_gpu_watch.json"
    if fixture.exists():
        t = json.loads(fixture.read_text())["timing"]
        paced_cpu = statistics.mean(t["paced"]["cpu_us"])
        rows.append(("NVIDIA H200, back-to-back (fixture)", {
            "sample_wall_us_median": t["bench"]["wall_us_median"], "sample_wall_us_p90": t["bench"]["wall_us_p90"],
            "sample_cpu_us_mean": t["bench"]["thread_cpu_us_mean"], "observe_us_median": t["observe_us_median"],
            "cpu_s_per_hour_at_10s": t["cpu_s_per_hour_at_default_interval"]}))
        rows.append(("NVIDIA H200, paced 0.25 s (fixture)", {
            "sample_wall_us_median": statistics.median(t["paced"]["wall_us"]),
            "sample_wall_us_p90": sorted(t["paced"]["wall_us"])[int(0.9 * len(t["paced"]["wall_us"]))],
            "sample_cpu_us_mean": paced_cpu, "observe_us_median": t["observe_us_median"],
            "cpu_s_per_hour_at_10s": (paced_cpu + t["observe_us_median"]) * 360 / 1e6}))
    cols = ["sample_wall_us_median", "sample_wall_us_p90", "sample_cpu_us_mean", "observe_us_median",
            "cpu_s_per_hour_at_10s"]
    heads = ["wall µs (median)", "wall µs (p90)", "CPU µs/sample", "observe µs", "CPU s/hour @10 s"]
    width = max(len(r[0]) for r in rows)
    print(f"{'where':<{width}}  " + "  ".join(f"{h:>16}" for h in heads))
    for name, m in rows:
        print(f"{name:<{width}}  " + "  ".join(f"{m[c]:>16.3f}" if c.startswith("cpu_s") else f"{m[c]:>16.1f}"
                                              for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
