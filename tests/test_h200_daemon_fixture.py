"""Replays what the real daemon recorded on a real NVIDIA H200 (scripts/gpu_e2e.py, read-only).

tests/fixtures/h200_daemon/ holds the JSON events of two real runs: A (GPU watch, bench, a foreign
torch process, kill -9) and B (a real CUDA OOM at context creation). The real server lines go
through today's classifier and policy; the expectations follow from the facts, not from the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llama_guard.core.policy import decide
from llama_guard.core.server_log import Family, classify_line
from llama_guard.core.types import Boot, Exited, InspectGpu, Line, Params, Phase, ResetTrigger, Spawned, initial_state

FIX = Path(__file__).resolve().parent / "fixtures" / "h200_daemon"


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


def test_real_run_a_server_was_ready_only_on_the_gpu_and_foreign_process_reported() -> None:
    events = load("run_a_events.jsonl")
    names = [e["event"] for e in events]
    assert "gpu_watch_off" not in names
    ready = next(e for e in events if e["event"] == "server_ready")
    foreign = next(e for e in events if e["event"] == "gpu_foreign_process")
    assert foreign["foreign_pid"] != ready["server_pid"]
    assert foreign["foreign_mib"] >= 4096  # the hog held 4 GiB plus its CUDA context
    # After kill -9 the server came back: a second ready with a new pid.
    readies = [e for e in events if e["event"] == "server_ready"]
    assert len(readies) >= 2 and readies[1]["server_pid"] != readies[0]["server_pid"]
    summary = json.loads((FIX / "summary.json").read_text())
    assert "median eval speed" in summary["run_a"]["bench"]


def test_real_oom_run_went_through_the_stub_reset_and_came_back() -> None:
    events = [e for e in load("run_b_events.jsonl") if e["event"] not in ("server_line", "server_probe")]
    names = [e["event"] for e in events]
    oom = names.index("server_oom")
    reset = names.index("gpu_reset")
    assert oom < names.index("server_stopped") < reset < names.index("server_ready")
    assert events[reset]["outcome"] == "succeeded"
    # The stub (never a real reset) was called with this GPU's index, once.
    record = (FIX / "run_b_reset_argv.txt").read_text().splitlines()
    assert len(record) == 1 and record[0].endswith("'0']")
    ready = events[names.index("server_ready")]
    assert ready["server_pid"] != events[oom]["server_pid"]
