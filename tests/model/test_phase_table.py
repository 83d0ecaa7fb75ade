"""The phase table (vocab/phases.py MOVES) is the only way the policy changes phase: every edge of
it is driven through the real policy (``decide``), no step takes a move outside it, ``enter``
rejects every other move, and docs/phases.md prints the table."""

from __future__ import annotations

import ast
import importlib.util
from collections import deque
from dataclasses import replace
from pathlib import Path

import pytest
from harness import line
from llama_guard.model.inputs import (
    Boot,
    Drained,
    Exited,
    GpuFault,
    GpuHolder,
    HealthOk,
    Input,
    LendAsked,
    LendReturned,
    ParamsChanged,
    Probe,
    ResetDone,
    ResetFacts,
    RestartRequest,
    SlotsSaved,
    Spawned,
    SpawnFailed,
    SpeedMeasured,
    StopRequest,
    Tick,
    TrialAsked,
    VramFacts,
)
from llama_guard.model.phase_state import IllegalMove
from llama_guard.model.policy import decide
from llama_guard.model.types import AfterStop, GpuFaultKind, LendEnd, Params, State, XidAction, enter, initial_state
from llama_guard.vocab.phases import MOVES, Phase, render_moves

ROOT = Path(__file__).resolve().parents[2]
EDGES = {(a, b) for a, targets in MOVES.items() for b in targets}
OOM = "CUDA error: out of memory"
ALLOC = "cudaMalloc failed: out of memory"  # an allocation failure, judged when the server exits
ABORT = "/src/ggml-cuda.cu:88: CUDA error"  # the abort line: the fault's message may come after it
WATCHDOG = "CUDA error: the launch timed out and was terminated"  # the launch watchdog: a restart
TUNE = 4242  # the pid of a `llama-guard tune` asking for the GPU
LATER = 100_000.0  # a Tick this many seconds on: every wait of the state has run out


def _inputs(s: State) -> list[Input]:
    """What the daemon could hand the policy in state ``s`` (the server's pid where one is named)."""
    pid = s.pid if s.pid is not None else 100
    holder = (GpuHolder(7, 9000, "other"),)
    return [
        Boot(), Spawned(pid), SpawnFailed("no model"), SpawnFailed("hung", fatal=False), HealthOk(pid),
        Exited(pid, 1), Exited(pid, -9), line(pid, OOM), line(pid, ALLOC), line(pid, ABORT), line(pid, WATCHDOG),
        GpuFault(GpuFaultKind.GPU_LOST, "lost"), GpuFault(GpuFaultKind.XID, "xid 79", action=XidAction.RESET),
        GpuFault(GpuFaultKind.XID, "xid 13", action=XidAction.RESTART),
        StopRequest("stop"), StopRequest("stop now", immediate=True),
        RestartRequest("planned"), RestartRequest("at once", drain=False), Drained(pid), SlotsSaved(pid),
        Probe(pid, False, False, False, False),
        VramFacts(0, free_mib=80000, need_mib=1000), VramFacts(0, free_mib=100, need_mib=1000, holders=holder),
        ResetFacts(0, True, 0.0, (), True), ResetDone(0, "reset", 0, "", True, "verified"),
        ResetDone(0, "reset", 1, "", False, "failed"), ParamsChanged(s.params, server_changed=True),
        ParamsChanged(s.params, server_changed=True, new_build=True),  # a trial of the new build
        SpeedMeasured(pid, 100.0), SpeedMeasured(pid, 1.0), SpeedMeasured(pid, None, "HTTP 500"),
        TrialAsked(100.0),  # a build found replaced at a start
        LendAsked(TUNE, 60.0), LendReturned(TUNE, LendEnd.DONE),
    ]


def _timed(s: State, now: float) -> list[tuple[Input, float]]:
    """Each input at a time just after ``now``, and a Tick at the state's deadline and much later."""
    deadline = s.deadline if s.deadline is not None else now + 1.0
    return [(event, now + 0.5) for event in _inputs(s)] + [(Tick(), max(now, deadline) + 0.001),
                                                           (Tick(), now + LATER)]


def _key(s: State) -> tuple[object, ...]:
    return (s.phase, s.pid is None, s.after_stop, s.saving, s.killed, s.gpu_lost, type(s.phase_data),
            getattr(s.phase_data, "until", None) is None, None if s.exit is None else s.exit.code,
            len(s.failures) > 1, s.stable, s.ready_at is None, bool(s.alloc_failure), s.pending_event is None,
            s.trial, s.lend is None)


def _explore(params: Params) -> set[tuple[Phase, Phase]]:
    """Every phase move the policy takes from a start with ``params``, breadth first over
    ``_inputs`` (states told apart by :func:`_key`); IllegalMove propagates, and so does a step that
    turns an exit asked for into something else."""
    first = initial_state(params)
    seen, moves = {_key(first)}, set()
    todo = deque([(first, 0.0)])
    while todo:
        state, now = todo.popleft()
        for event, at in _timed(state, now):
            after, _ = decide(state, event, at)
            # an exit once asked for (a stop request, a verdict) is never turned into a restart
            assert state.after_stop is not AfterStop.EXIT or after.after_stop is AfterStop.EXIT, \
                (state.phase, event, after.phase, after.after_stop)
            if after.phase is not state.phase:
                moves.add((state.phase, after.phase))
            if _key(after) not in seen:
                seen.add(_key(after))
                todo.append((after, at))
    return moves


@pytest.fixture(scope="module")
def driven() -> set[tuple[Phase, Phase]]:
    plain = Params(max_restarts=2)
    watched = Params(max_restarts=2, reset_possible=True, vram_admission=True, exit_drain_s=5.0, reset_save_s=5.0)
    unwatched_vram = Params(max_restarts=2, reset_possible=True)  # a reset, but no VRAM check before a start
    # a reset could be verified, but the window's budget is spent: a fault that asks for one is a failure,
    # counted wherever it comes (before the first start, while backing off)
    budget_spent = Params(max_restarts=2, reset_possible=True, vram_admission=True, max_resets=0)
    return _explore(plain) | _explore(watched) | _explore(unwatched_vram) | _explore(budget_spent)


def test_every_move_the_policy_takes_is_in_the_table(driven: set[tuple[Phase, Phase]]) -> None:
    assert driven - EDGES == set()


def test_every_edge_of_the_table_is_driven_by_the_policy(driven: set[tuple[Phase, Phase]]) -> None:
    undriven = {(a, b) for a, b in EDGES if a is not b} - driven
    assert sorted((a.value, b.value) for a, b in undriven) == []


def test_enter_allows_the_table_and_rejects_every_other_move() -> None:
    for a in Phase:
        for b in Phase:
            state = replace(initial_state(Params()), phase=a)
            if (a, b) in EDGES:
                assert enter(state, b) is b
            else:
                with pytest.raises(IllegalMove, match=f"{a.value} -> {b.value}"):
                    enter(state, b)


def test_an_illegal_move_from_the_policy_is_refused() -> None:
    """A server that is not ready cannot be drained: a READY-only step run on a STARTING state."""
    from llama_guard.model.policy.phases import on_serving

    starting, _ = decide(initial_state(Params()), Boot(), 0.0)
    starting, _ = decide(starting, Spawned(100), 0.1)
    assert starting.phase is Phase.STARTING
    with pytest.raises(IllegalMove, match="starting -> draining"):
        on_serving(starting, RestartRequest("planned"), 1.0)


def test_every_phase_change_goes_through_enter() -> None:
    """No ``phase=`` keyword in the policy's code but ``phase=enter(...)``."""
    bare = []
    for path in sorted((ROOT / "supervisor" / "llama_guard").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "phase" and isinstance(node.value, ast.Attribute) \
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "Phase":
                bare.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
    assert bare == []


def test_docs_print_the_current_table() -> None:
    assert render_moves() in (ROOT / "docs" / "phases.md").read_text()
    # gen_catalog's --check, in this process (the fast lane starts none; test_event_names runs the script)
    spec = importlib.util.spec_from_file_location("gen_catalog", ROOT / "scripts" / "gen_catalog.py")
    assert spec is not None and spec.loader is not None
    gen_catalog = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_catalog)
    assert gen_catalog.stale() == []
