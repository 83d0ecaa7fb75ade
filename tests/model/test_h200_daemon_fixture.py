"""Replays what the real daemon recorded on a real NVIDIA H200 (scripts/gpu_e2e.py, read-only).

tests/fixtures/h200_daemon/ holds the JSON events of two real runs: A (GPU watch, bench, a foreign
torch process, kill -9) and B (a real CUDA OOM at context creation). The real server lines go
through today's classifier and policy; the expectations follow from the facts, not from the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llama_guard.gpu.readings import GpuIdentity, GpuProcess, GpuSample
from llama_guard.gpu.rules import GpuWatch, server_on_gpu
from llama_guard.model.actions import Emit, InspectGpu, RunReset, Spawn
from llama_guard.model.inputs import Boot, Exited, HealthOk, Line, ResetDone, ResetFacts, Spawned, Tick
from llama_guard.model.policy import decide
from llama_guard.model.server_log import Family, classify_line
from llama_guard.model.types import Params, initial_state
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger
from llama_guard.vocab.units import MIB

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "h200_daemon"


def load(name: str) -> list[dict[str, Any]]:
    out = []
    for line in (FIX / name).read_text().splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out


def test_real_oom_lines_lead_to_server_oom_and_the_reset() -> None:
    events = load("run_b_events.jsonl")
    first = next(e for e in events if e["event"] == "server_starting")["server_pid"]
    lines = [e["line"] for e in events if e["event"] == "server_line" and e["server_pid"] == first]
    families = [classify_line(text).family for text in lines]
    assert Family.OOM in families and Family.GPU_ABORT in families
    # On the H200 the abort line came before the message: the policy must still choose the reset.
    assert families.index(Family.GPU_ABORT) < families.index(Family.OOM)
    state = initial_state(Params(reset_possible=True, reset_on=frozenset({ResetTrigger.OOM})))
    state, _ = decide(state, Boot(), 0.0)
    state, _ = decide(state, Spawned(first), 0.0)
    emitted = []
    for i, text in enumerate(lines):
        state, actions = decide(state, Line(first, classify_line(text), text), 0.01 * i)
        emitted += [a.name for a in actions if hasattr(a, "name")]
    assert emitted.count("server_oom") == 1
    state, actions = decide(state, Exited(first, -15), 2.0)
    assert state.phase is Phase.RESETTING
    assert any(isinstance(a, InspectGpu) and a.previous_pid == first for a in actions)


LIFECYCLE = ("server_ready", "server_exited", "server_backoff", "server_oom", "server_stopped", "gpu_reset")


def _lifecycle(names: list[str]) -> list[str]:
    return [n for n in names if n in LIFECYCLE]


def _emits(actions: list[Any]) -> list[str]:
    return [a.name for a in actions if isinstance(a, Emit)]


def test_run_a_replayed_through_todays_policy_and_gpu_rules() -> None:
    """Run A's server lines, readiness and kill -9 through today's classifier and policy, and its
    foreign torch process through today's GPU rules: the same events the daemon recorded then."""
    events = load("run_a_events.jsonl")
    first, second = [e["server_pid"] for e in events if e["event"] == "server_starting"]
    killed = next(e for e in events if e["event"] == "server_exited")
    state = initial_state(Params(require_gpu=True))
    state, _ = decide(state, Boot(), 0.0)
    state, _ = decide(state, Spawned(first), 0.0)
    emitted: list[str] = []
    for i, e in enumerate(x for x in events if x["event"] == "server_line" and x["server_pid"] == first):
        state, actions = decide(state, Line(first, classify_line(e["line"]), e["line"]), 0.01 * (i + 1))
        emitted += _emits(actions)
    state, actions = decide(state, HealthOk(first), 2.0)
    emitted += _emits(actions)
    assert state.phase is Phase.READY
    state, actions = decide(state, Exited(first, -int(killed["signal"])), 10.0)
    emitted += _emits(actions)
    now = 10.0
    while not any(isinstance(a, Spawn) for a in actions) and now < 100:
        now += 0.5
        state, actions = decide(state, Tick(), now)
        emitted += _emits(actions)
    assert any(isinstance(a, Spawn) for a in actions)
    state, _ = decide(state, Spawned(second), now)
    state, actions = decide(state, HealthOk(second), now + 1)
    emitted += _emits(actions)
    recorded = [e["event"] for e in events]
    assert _lifecycle(emitted) == _lifecycle(recorded[:recorded.index("daemon_stopping")])
    assert emitted.count("server_ready") == 2 and "server_exited" in emitted

    foreign = next(e for e in events if e["event"] == "gpu_foreign_process")
    ident = GpuIdentity(index=0, uuid=foreign["gpu_uuid"], pci_bus_id="0000:00:00.0", name="NVIDIA H200")
    watch = GpuWatch(proc_name=lambda pid: foreign["foreign_name"])
    watch.set_server_pid(first, 0.0)
    sample = GpuSample(identity=ident, processes=(GpuProcess(first, 790 * MIB),
                                                  GpuProcess(foreign["foreign_pid"], foreign["foreign_bytes"])))
    found = [fields for name, fields in watch.observe(sample, 1.0) if name == "gpu_foreign_process"]
    assert [(f["foreign_pid"], f["foreign_mib"]) for f in found] == [(foreign["foreign_pid"], foreign["foreign_mib"])]
    assert server_on_gpu(sample, first)


def test_run_b_oom_replayed_through_todays_policy_reaches_the_reset_and_a_new_server() -> None:
    """Run B: the CUDA OOM lines, the exit, the GPU inspection and the (stub) reset's success through
    today's policy lead to a fresh start, as the daemon recorded (once, with this GPU's index)."""
    events = load("run_b_events.jsonl")
    first = next(e for e in events if e["event"] == "server_starting")["server_pid"]
    reset = next(e for e in events if e["event"] == "gpu_reset")
    state = initial_state(Params(reset_possible=True, reset_on=frozenset({ResetTrigger.OOM}), gpu_index=0))
    state, _ = decide(state, Boot(), 0.0)
    state, _ = decide(state, Spawned(first), 0.0)
    state, _ = decide(state, HealthOk(first), 0.5)
    for i, e in enumerate(x for x in events if x["event"] == "server_line" and x["server_pid"] == first):
        state, _ = decide(state, Line(first, classify_line(e["line"]), e["line"]), 1.0 + 0.01 * i)
    state, actions = decide(state, Exited(first, -6), 3.0)
    (inspect,) = [a for a in actions if isinstance(a, InspectGpu)]
    assert inspect.previous_pid == first
    state, actions = decide(state, ResetFacts(gpu_index=0, previous_released=True, waited_s=0.5, holders=(),
                                              can_run=True), 4.0)
    (run,) = [a for a in actions if isinstance(a, RunReset)]
    assert run.gpu_index == reset["gpu_index"] == 0
    state, actions = decide(state, ResetDone(gpu_index=0, command="stub", exit_status=0, output="",
                                             verified=True, detail=str(reset["reason"])), 5.0)
    assert "gpu_reset" in _emits(actions)
    now = 5.0
    while not any(isinstance(a, Spawn) for a in actions) and now < 100:
        now += 0.5
        state, actions = decide(state, Tick(), now)
    assert any(isinstance(a, Spawn) for a in actions)
    assert len(state.resets) == 1
    record = (FIX / "run_b_reset_argv.txt").read_text().splitlines()
    assert len(record) == 1 and record[0].endswith("'0']")
