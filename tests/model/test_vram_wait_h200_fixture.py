"""Replays the VRAM-admission run on a real H200 (tests/fixtures/h200_vram_wait/, scripts/gpu_vram_wait.py,
2026-11-30): a torch process held all but 150 MiB for 20 s while llama-guard started a CUDA llama-server.

The recorded observations — the GPU's free VRAM, the server's need and the holder at the first check, and
the holder's departure (``gpu_foreign_process_gone``) — are fed to today's policy; the verdicts (wait with
the holder named, no failure counted, no reset, a start only once the memory is free) come from the code
and are then compared with what the real daemon did.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from llama_guard.model.actions import CheckVram, Emit, Spawn
from llama_guard.model.inputs import Boot, GpuHolder, Tick, VramFacts
from llama_guard.model.policy import decide
from llama_guard.model.types import Params, initial_state
from llama_guard.vocab.phases import Phase

FIX = Path(__file__).parents[1] / "fixtures" / "h200_vram_wait"


def events(run: str) -> list[dict[str, Any]]:
    out = []
    for line in (FIX / f"{run}_events.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


@pytest.mark.parametrize("run", ["v1", "v2"])
def test_the_recorded_h200_wait_replays_to_the_same_verdicts(run: str) -> None:
    recorded = events(run)
    wait = next(e for e in recorded if e["event"] == "gpu_vram_wait")
    gone = next(e for e in recorded if e["event"] == "gpu_foreign_process_gone")
    holder = GpuHolder(wait["foreign_pid"], wait["foreign_mib"], wait["foreign_name"])
    params = Params(vram_admission=True, vram_wait_timeout_s=wait["timeout_s"], reset_possible=True)
    state, actions = decide(initial_state(params), Boot(), 0.0)
    assert state.phase is Phase.WAITING_VRAM and any(isinstance(a, CheckVram) for a in actions)

    # The first check, as NVML read it on the H200.
    state, actions = decide(state, VramFacts(wait["gpu_index"], wait["free_mib"], wait["need_mib"], (holder,)), 1.0)
    emitted = [a for a in actions if isinstance(a, Emit)]
    assert [a.name for a in emitted] == ["gpu_vram_wait"]
    assert emitted[0].fields["foreign_pid"] == wait["foreign_pid"]
    assert state.phase is Phase.WAITING_VRAM and state.failures == ()
    assert not any(isinstance(a, Spawn) for a in actions)

    # Polls while the holder stays: still waiting, nothing counted.
    for t in (2.0, 3.0, 4.0):
        state, actions = decide(state, Tick(), t)
        state, actions = decide(state, VramFacts(wait["gpu_index"], wait["free_mib"], wait["need_mib"], (holder,)), t)
        assert state.phase is Phase.WAITING_VRAM and not any(isinstance(a, Spawn) for a in actions)

    # The holder gone (as the daemon saw it: gpu_foreign_process_gone): the memory is free, start.
    assert gone["foreign_pid"] == wait["foreign_pid"]
    free_after = wait["free_mib"] + wait["foreign_mib"]
    state, actions = decide(state, Tick(), 5.0)
    state, actions = decide(state, VramFacts(wait["gpu_index"], free_after, wait["need_mib"], ()), 5.0)
    assert any(isinstance(a, Spawn) for a in actions)
    assert state.failures == () and state.resets == ()

    # What the real daemon did agrees: waited before the first start, one start, ready, no failure.
    names = [e["event"] for e in recorded]
    assert names.index("gpu_vram_wait") < names.index("server_starting") < names.index("server_ready")
    assert names.count("server_starting") == 1
    assert not {"server_backoff", "crash_loop", "gpu_reset", "server_oom"} & set(names)
