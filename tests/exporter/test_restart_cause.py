"""The restart cause of every restart path, as it reaches metrics and journald.

Each case drives the pure policy from a server's start through one failure (or one plan) to the
``server_restart`` it leads to; that event goes through the real emitter into the Prometheus
source (``llama_guard_restarts_total{cause=…}``) and the journald field mapping
(``RESTART_CAUSE=…``). The cause is the one the policy recorded for that failure, never one left
over from an earlier server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from harness import line
from harness import ready as policy_ready
from harness import started as policy_started
from llama_guard.model.actions import Emit
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
    NotOnGpu,
    ParamsChanged,
    PortHolder,
    Probe,
    RestartRequest,
    Spawned,
    SpawnFailed,
    SpeedMeasured,
    StreamStalled,
    Tick,
    VramFacts,
)
from llama_guard.model.policy import decide
from llama_guard.model.types import (
    GpuFaultKind,
    LendEnd,
    Params,
    RestartCause,
    State,
    XidAction,
    XidScope,
    initial_state,
)
from llama_guard.output.eventlog import Emitter
from llama_guard.output.journal import journal_fields
from llama_guard.vocab.phases import Phase
from test_metrics import make as make_metrics
from test_metrics import scrape

P = Params(load_timeout_s=30, hang_strikes=2, backoff_initial_s=1, max_restarts=50, restart_window_s=100,
           stable_after_s=10, stop_grace_s=4, kill_wait_s=2, load_stall_s=0, port=8080, port_wait_s=60)
PID = 100
BIND = "0.00.002.798 E srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080"


def _probe(**kw: Any) -> Probe:
    base: dict[str, Any] = {"health_ok": True, "canary_ok": True, "busy": False, "progressed": False}
    return Probe(PID, **{**base, **kw})


def ready(params: Params = P) -> State:
    return policy_ready(params, PID, 1.0)


def starting(params: Params = P) -> State:
    return policy_started(params, PID, 0.0)


def booted(params: Params = P) -> State:
    """Just booted: the first start asked for (its spawn, or the VRAM check before it), no failure yet."""
    return decide(initial_state(params), Boot(), 0.0)[0]


#: (restart path, the state it begins in, what happens, the cause expected on server_restart)
Case = tuple[str, Callable[[], State], list[Input], RestartCause]
CASES: list[Case] = [
    ("crash while serving", ready, [Exited(PID, -11)], RestartCause.CRASH),
    ("crash while loading", starting, [Exited(PID, 1)], RestartCause.CRASH),
    ("OOM line", ready, [line(PID, "E CUDA error: out of memory")], RestartCause.OOM),
    ("CUDA error line", ready, [line(PID, "CUDA error: an illegal memory access was encountered")],
     RestartCause.CUDA_ERROR),
    ("abort line, then the OOM message", ready,
     [line(PID, "/src/ggml-cuda.cu:88: CUDA error"), line(PID, "CUDA error: out of memory")], RestartCause.OOM),
    ("abort line, then a lost device", ready,
     [line(PID, "/src/ggml-cuda.cu:88: CUDA error"), line(PID, "ggml_vulkan: vk::Queue::submit: ErrorDeviceLost")],
     RestartCause.GPU_LOST),
    ("lost device line", ready, [line(PID, "ggml_vulkan: vk::Queue::submit: ErrorDeviceLost")],
     RestartCause.GPU_LOST),
    ("hang", ready, [_probe(health_ok=False, canary_ok=None)] * 2, RestartCause.HANG),
    ("stalled streams", ready, [StreamStalled(PID, 30.0)] * 2, RestartCause.HANG),
    ("completion errors", ready, [_probe(canary_ok=False, canary_status=500, canary_error="boom")] * 2,
     RestartCause.COMPLETION_ERROR),
    ("load timeout", starting, [Tick()], RestartCause.LOAD_TIMEOUT),
    ("load stalled", lambda: starting(replace(P, load_stall_s=5)), [Tick()], RestartCause.LOAD_STALLED),
    ("not on the GPU", lambda: starting(replace(P, require_gpu=True)), [NotOnGpu(PID, "no CUDA device")],
     RestartCause.GPU_UNAVAILABLE),
    ("Xid of the server", ready,
     [GpuFault(GpuFaultKind.XID, "Xid 13", XidAction.RESTART, 13, XidScope.APP, PID)], RestartCause.XID),
    ("spawn failed", booted, [SpawnFailed("model file hangs", fatal=False)],
     RestartCause.SPAWN_FAILED),
    ("port taken", booted, [Spawned(PID), line(PID, BIND), PortHolder(8080, 4242, "nc"), Exited(PID, 1)],
     RestartCause.PORT_TAKEN),
    ("VRAM held by another process", lambda: booted(replace(P, vram_admission=True, vram_wait_timeout_s=5)),
     [VramFacts(0, 150, 20_000, (GpuHolder(5151, 19_000, "python3"),)), Tick(), Tick()], RestartCause.VRAM_WAIT),
    ("operator", ready, [RestartRequest("SIGUSR1", cause=RestartCause.OPERATOR), Drained(PID)], RestartCause.OPERATOR),
    ("schedule", ready, [RestartRequest("nightly", cause=RestartCause.SCHEDULE), Drained(PID)], RestartCause.SCHEDULE),
    ("decay", ready, [RestartRequest("decay: rss_growth", cause=RestartCause.DECAY), Drained(PID)], RestartCause.DECAY),
    ("reload", ready, [RestartRequest("flags changed", cause=RestartCause.CONFIG_CHANGE), Drained(PID)],
     RestartCause.CONFIG_CHANGE),
    ("trial", lambda: _new_build_on_trial(), [SpeedMeasured(PID + 1, 1.0)], RestartCause.TRIAL),
    ("lend cancelled", ready, [LendAsked(4242, 180.0), Drained(PID), LendReturned(4242, LendEnd.EXITED)],
     RestartCause.LEND_CANCELLED),
]


def _new_build_on_trial() -> State:
    """A reload named a new build: the old one measured at 100 tokens/s, the new one (PID + 1) loaded and
    measured next."""
    s = ready(replace(P, trial_runs=1))
    for event in (ParamsChanged(s.params, server_changed=True, new_build=True), Drained(PID),
                  SpeedMeasured(PID, 100.0), Exited(PID, 0), Spawned(PID + 1), HealthOk(PID + 1)):
        s, _ = decide(s, event, 3.0)
    assert s.phase is Phase.TRIAL and s.pid == PID + 1
    return s


def _restart(state: State, inputs: list[Input]) -> Emit:
    """Feed ``inputs`` (far enough apart for every deadline), then end the stop and the backoff it
    leads to, until the policy announces the restart; that ``server_restart``."""
    now, found = 2.0, []
    todo = list(inputs)
    for _ in range(20):
        if todo:
            event = todo.pop(0)
            if isinstance(event, Tick):
                now = max(now, (state.next_deadline() or now))
        elif state.phase is Phase.STOPPING and state.pid is not None:
            event = Exited(state.pid, -15)
        elif state.phase in (Phase.BACKOFF, Phase.STARTING, Phase.WAITING_VRAM) and state.next_deadline() is not None:
            now, event = max(now, state.next_deadline() or now), Tick()
        else:
            break
        state, actions = decide(state, event, now)
        found += [a for a in actions if isinstance(a, Emit) and a.name == "server_restart"]
        if found:
            return found[0]
        now += 0.5
    raise AssertionError(f"no server_restart; ended in {state.phase}")


class _Records:
    """An event sink keeping what the emitter hands every sink (the journald sink gets the same)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))


@pytest.mark.parametrize(("begin", "inputs", "cause"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_the_cause_of_each_restart_path_reaches_metrics_and_journald(
        begin: Callable[[], State], inputs: list[Input], cause: RestartCause, tmp_path: Path) -> None:
    restart = _restart(begin(), inputs)
    assert restart.fields["restart_cause"] == cause.value
    metrics, metrics.ctx, _, _ = make_metrics(tmp_path)
    records = _Records()
    emitter = Emitter(min_level="critical", fmt="json", sinks=[records, metrics])
    emitter.emit(restart.name, **restart.fields)
    (record,) = [r for r in records.records if r.get("event") == "server_restart"]
    assert ("RESTART_CAUSE", cause.value) in journal_fields(record)
    counted = {labels: n for (name, labels), n in scrape(metrics).items() if name == "llama_guard_restarts_total"}
    assert counted == {(("cause", cause.value),): 1.0}


def test_every_restart_cause_has_a_path() -> None:
    """Each restart cause is driven by a case above (a new cause needs its case)."""
    assert {c[3] for c in CASES} == set(RestartCause)
