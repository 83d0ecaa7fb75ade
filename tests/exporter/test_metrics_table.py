"""docs/metrics.md's table is the one list of what ``/metrics`` serves: every family the exporter and the front
door register, with every input present (a GPU sample, the server's usage and build, a trial, a bench, the
server's slots, slot files), is a row of it with its type, and every row is such a family. Names follow
Prometheus' conventions: the ``llama_guard_`` prefix, counters end in ``_total``, ``_info`` gauges are 1."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from pathlib import Path

from llama_guard.config import Config
from llama_guard.exporter.fleet import SlotReading
from llama_guard.exporter.metrics import MetricsSource
from llama_guard.front.metrics import FrontMetrics
from llama_guard.gpu.readings import GpuIdentity, GpuProcess, GpuSample
from llama_guard.host.build import Build
from llama_guard.limits.usage import UsageSample
from llama_guard.model.inputs import Tick
from llama_guard.model.transition import Transition
from llama_guard.model.types import State, TrialResult
from llama_guard.model.watcher import Context
from llama_guard.slots.client import SlotInfo
from llama_guard.vocab.phases import Phase

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented() -> dict[str, str]:
    """Each name of the table under "## Metrics" with the type its row gives."""
    text = DOC.read_text()
    section = text[text.index("## Metrics\n"):]
    section = section[:section.index("\n## ", 1)]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`llama_guard_"):
            continue
        for name in re.findall(r"`(llama_guard_[a-z_]+)`", cells[0]):
            assert name not in rows, f"{name}: two rows"
            rows[name] = cells[1]
    return rows


def served(tmp: Path) -> dict[str, str]:
    """Every family /metrics serves with every input present: name (a counter's with ``_total``) → type."""
    cfg = Config.model_validate({"runtime": {"dir": str(tmp)}})
    state = replace(State(), phase=Phase.READY, pid=100, ready_at=0.0,
                    last_trial=TrialResult(old_tps=50.0, new_tps=49.0, kept=True))
    loop = asyncio.new_event_loop()
    try:
        ctx = Context(get_config=lambda: cfg, emit=lambda *a, **k: None,
                      post=lambda i: None, post_threadsafe=lambda i: None, clock=lambda: 10.0, loop=loop)
        sample = GpuSample(GpuIdentity(0, "GPU-0", "0000:00:00.0", "H200"), temperature_c=60, temp_slowdown_c=90,
                           power_mw=1, power_limit_mw=2, memory_used_bytes=1, memory_total_bytes=2,
                           processes=(GpuProcess(100, 1),), clock_event_reasons=0x1)
        build = Build(Path("/usr/local/bin/llama-server"), "0" * 64, "version: 1 (abc)", "b1 (abc)")
        src = MetricsSource(gpu_sample=lambda: sample, build=lambda: build, slot_files=lambda: 1,
                            usage=lambda: UsageSample(pid=100, fds=1, threads=1, nofile_limit=2, nproc_limit=2))
        FrontMetrics(src.registry, waiting=lambda: 0, in_flight=lambda: 0, connections=lambda: 0)
        loop.run_until_complete(src.start(ctx))
        src.on_transition(ctx, Transition(state, state, Tick(), (), 10.0))
        src._slots = SlotReading(100, (SlotInfo(0, False, 1, 2, False),))
        (tmp / "bench.json").write_text(json.dumps({"eval_tokens_per_s": {"median": 1.0},
                                                    "prompt_tokens_per_s": {"median": 1.0},
                                                    "ceiling": {"ceiling_tokens_per_s": 1.0}, "finished": 1.0}))
        return {fam.name + ("_total" if fam.type == "counter" else ""): fam.type for fam in src.registry.collect()}
    finally:
        loop.close()


def test_the_table_lists_exactly_what_metrics_serves(tmp_path: Path) -> None:
    doc, live = documented(), served(tmp_path)
    assert sorted(live.keys() - doc.keys()) == [], "served but not in docs/metrics.md's table"
    assert sorted(doc.keys() - live.keys()) == [], "in docs/metrics.md's table but never served"
    assert {name: doc[name] for name in live} == live, "a row's type is not what is served"


def test_names_follow_prometheus_conventions(tmp_path: Path) -> None:
    live = served(tmp_path)
    for name, kind in live.items():
        assert name.startswith("llama_guard_") and re.fullmatch(r"[a-z_]+", name), name
        assert (kind == "counter") == name.endswith("_total"), name
        assert not name.endswith(("_ms", "_mib", "_mb", "_percent", "_kb")), f"{name}: not a base unit"
    assert all(live[n] == "gauge" for n in live if n.endswith("_info"))
