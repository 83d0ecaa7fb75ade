"""Faults of public reports (2025–2026), replayed through the classifier, the kernel-log parser, the
Xid table and the policy: each fixture of tests/fixtures/public_reports/ as a report showed it, and
one more input of the same kind in a wording the report did not show (``*_kind.*``).

The kinds: the launch watchdog on one channel (restart, no reset, said when it repeats); "reset
required" (Xid 119 then Xid 154, our GPU only; NVML's recovery-action field before each start);
off the bus (no reset, exit 69 with reboot advice, never the CPU); a server that outlives SIGKILL
(no new server, no reset, exit 69); an exception the server handled (nothing) or did not (restart,
the request kind named when it repeats); other backends' wordings (Vulkan OOM at load, device lost).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from fake_nvml import FakeGpu, FakeNvml
from llama_guard.gpu.kmsg import AdapterInitFailed, KmsgParser, UnparsedXid, XidRecord
from llama_guard.gpu.nvml import Nvml
from llama_guard.gpu.nvml_errors import NotSupported
from llama_guard.gpu.nvml_session import DeviceSelector
from llama_guard.gpu.xid import XidMatcher, recovery_action_of, xid_info
from llama_guard.model.actions import Action, CheckVram, Emit, ExitDaemon, InspectGpu, Kill, RunReset, Spawn, Terminate
from llama_guard.model.inputs import Boot, Exited, GpuFault, HealthOk, Line, Spawned, StopRequest, Tick, VramFacts
from llama_guard.model.policy import decide
from llama_guard.model.server_log import ERROR_FAMILIES, Family, classify_line
from llama_guard.model.types import (
    AfterStop,
    GpuFaultKind,
    Params,
    RecoveryAction,
    State,
    XidAction,
    XidScope,
    initial_state,
)
from llama_guard.vocab.exitcodes import EXIT_GPU_UNRECOVERABLE, EXIT_OK
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "public_reports"
H200 = Path(__file__).resolve().parents[1] / "fixtures" / "h200_recovery" / "field_values.json"

P = Params(load_timeout_s=30, hang_strikes=2, backoff_initial_s=1, backoff_factor=2, backoff_max_s=5,
           max_restarts=5, restart_window_s=100, stable_after_s=10, stop_grace_s=4, kill_wait_s=2,
           drain_timeout_s=20, reset_possible=True,
           reset_on=frozenset({ResetTrigger.GPU_LOST, ResetTrigger.XID, ResetTrigger.OOM, ResetTrigger.CUDA_ERROR}),
           max_resets=2, reset_window_s=1000, reset_deadline_s=50, vram_admission=True)
PID = 4242


def lines(name: str) -> list[str]:
    return [x for x in (FIX / name).read_text().splitlines() if x.strip()]


def names(actions: list[Action]) -> list[str]:
    return [a.name for a in actions if isinstance(a, Emit)]


def emitted(actions: list[Action], name: str) -> Emit:
    found = [a for a in actions if isinstance(a, Emit) and a.name == name]
    assert len(found) == 1, (name, actions)
    return found[0]


def ready(params: Params = P, pid: int = PID, now: float = 1.0) -> State:
    s, acts = decide(initial_state(params), Boot(), now - 1.0)
    if params.vram_admission:
        assert acts == [CheckVram()]
        s, acts = decide(s, VramFacts(0, 100_000, 1000), now - 1.0)
    assert acts == [Spawn()]
    s, _ = decide(s, Spawned(pid, ("llama-server",)), now - 1.0)
    s, _ = decide(s, HealthOk(pid), now)
    assert s.phase is Phase.READY
    return s


def feed_log(s: State, name: str, now: float, pid: int = PID) -> tuple[State, list[Action]]:
    """Every line of fixture ``name`` as the daemon feeds it (non-harmless lines only)."""
    out: list[Action] = []
    for text in lines(name):
        verdict = classify_line(text)
        if verdict.family is not Family.HARMLESS:
            s, acts = decide(s, Line(pid, verdict, text), now)
            out += acts
    return s, out


def kmsg_faults(name: str, pci: str, *, gpu_index: int = 0) -> list[GpuFault]:
    """The fixture's kernel lines through the parser, the Xid matcher and the table, as the GPU
    source posts them (gpu/watcher.py)."""
    parser, matcher = KmsgParser(pci), XidMatcher(window_s=2.0)
    out: list[GpuFault] = []
    for i, text in enumerate(lines(name)):
        for rec in parser.feed(text):
            assert not isinstance(rec, UnparsedXid), rec
            if isinstance(rec, AdapterInitFailed):
                out.append(GpuFault(GpuFaultKind.GPU_LOST, f"the driver cannot initialise GPU {rec.pci} "
                                    "(RmInitAdapter failed)", XidAction.REBOOT, gpu_index=gpu_index, line=rec.text))
                continue
            for rep in matcher.kmsg(rec, float(i)):
                info = xid_info(rep.xid)
                recovery = recovery_action_of(rep.text) if info.action is XidAction.FOLLOW_RECOVERY_ACTION else None
                out.append(GpuFault(GpuFaultKind.XID, f"Xid {rep.xid}: {info.meaning}", info.action, rep.xid,
                                    info.scope, rep.pid, rep.name, rep.origin, gpu_index, rep.text,
                                    recovery=recovery, watchdog=info.watchdog))
    return out


# ============================================================ 9: the launch watchdog on one channel

@pytest.mark.parametrize("log", ["watchdog_server.log", "watchdog_kind_server.log"])
def test_watchdog_lines_are_their_own_family(log: str) -> None:
    families = [classify_line(x).family for x in lines(log)]
    assert Family.GPU_WATCHDOG in families and Family.GPU_FATAL not in families


@pytest.mark.parametrize(("kmsg", "log"), [("watchdog_kmsg.txt", "watchdog_server.log"),
                                           ("watchdog_kind_kmsg.txt", "watchdog_kind_server.log")])
@pytest.mark.parametrize("xid_first", [True, False])
def test_watchdog_restarts_without_a_reset_and_says_when_it_repeats(kmsg: str, log: str, xid_first: bool) -> None:
    # Even with cuda_error in reset_on (P), a watchdog timeout never resets the GPU.
    s = ready()
    now = 5.0
    seen: list[Action] = []
    for round_ in range(2):
        pid = PID + round_
        [xid8] = kmsg_faults(kmsg, "0000:01:00.0")
        xid8 = replace(xid8, faulting_pid=pid)  # the kernel names the server of this round
        assert (xid8.xid, xid8.scope, xid8.action, xid8.watchdog) == (8, XidScope.APP, XidAction.RESTART, True)
        line_first = not xid_first
        for step in ("line", "xid") if line_first else ("xid", "line"):
            s, acts = decide(s, xid8, now) if step == "xid" else feed_log(s, log, now + 0.1, pid)
            seen += acts
        assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.FAILURE, s
        s, acts = decide(s, Exited(pid, -6), now + 0.5)
        seen += acts
        assert not [a for a in acts if isinstance(a, InspectGpu)] and s.phase is Phase.BACKOFF
        s, acts = decide(s, Tick(), s.deadline or now + 1)
        s, acts = decide(s, VramFacts(0, 100_000, 1000), now + 2)
        s, _ = decide(s, Spawned(pid + 1, ()), now + 2)
        s, _ = decide(s, HealthOk(pid + 1), now + 3)
        now += 10.0
    assert not [a for a in seen if isinstance(a, (InspectGpu, RunReset))]
    repeated = emitted(seen, "gpu_watchdog_repeated")
    assert repeated.fields["count"] == 2 and "watchdog" in str(repeated.fields["cause"]).lower()
    # Whichever report comes first stops the server: the Xid (gpu_xid) or the server's line.
    assert names(seen).count("server_cuda_error") == (0 if xid_first else 2)
    assert names(seen).count("gpu_xid") == 2


def test_another_process_watchdog_xid_changes_nothing() -> None:
    s = ready()
    [xid8] = kmsg_faults("watchdog_kmsg.txt", "0000:01:00.0")
    s2, acts = decide(s, replace(xid8, faulting_pid=999), 5.0)
    assert s2 == s and names(acts) == ["gpu_xid"] and emitted(acts, "gpu_xid").fields["action"] == "event_only"


# ============================================================ 10: "reset required", late and in new formats

def test_reset_required_burst_only_our_gpu_counts() -> None:
    faults = kmsg_faults("reset_required_kmsg.txt", "00000000:9b:00.0")
    assert [(f.xid, f.faulting_name, f.recovery) for f in faults] == [
        (119, "pt_main_thread", None), (154, None, RecoveryAction.GPU_RESET)]
    # The other GPU of the same burst is another parser's business.
    other = kmsg_faults("reset_required_kmsg.txt", "0000:1a:00.0")
    assert [f.xid for f in other] == [119, 154]
    assert kmsg_faults("reset_required_kmsg.txt", "0000:02:00.0") == []


def test_reset_required_resets_once_whoever_the_named_process() -> None:
    s = ready()
    xid119, xid154 = kmsg_faults("reset_required_kmsg.txt", "0000:9b:00.0")
    s, acts = decide(s, xid119, 5.0)  # another process's truncated name: a device Xid acts anyway
    assert emitted(acts, "gpu_xid").fields["ours"] is False and Terminate(PID) in acts
    assert s.after_stop is AfterStop.RESET
    s, acts = decide(s, xid154, 5.1)
    assert emitted(acts, "gpu_xid").fields["recovery_action"] == "gpu_reset"
    assert [a for a in acts if not isinstance(a, Emit)] == []  # already stopping for the reset
    s, acts = decide(s, Exited(PID, -15), 6.0)
    assert [a for a in acts if isinstance(a, InspectGpu)] and s.phase is Phase.RESETTING


def test_reset_required_changing_to_reboot_stops_with_advice() -> None:
    s = ready()
    xid119, xid154 = kmsg_faults("reset_required_kind_kmsg.txt", "0000:9b:00.0")
    assert xid154.recovery is RecoveryAction.NODE_REBOOT
    s, _ = decide(s, xid119, 5.0)
    s, acts = decide(s, xid154, 5.1)
    assert "reboot" in emitted(acts, "gpu_lost").fields["reason"]  # type: ignore[operator]
    assert s.after_stop is AfterStop.EXIT and s.exit.code == EXIT_GPU_UNRECOVERABLE
    s, acts = decide(s, Exited(PID, -15), 6.0)
    assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts
    assert not [a for a in acts if isinstance(a, (InspectGpu, RunReset, Spawn))]


@pytest.mark.parametrize(("text", "action"), [
    ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", RecoveryAction.GPU_RESET),
    ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x2 (Node Reboot Required)",
     RecoveryAction.NODE_REBOOT),
    ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)", RecoveryAction.DRAIN_AND_RESET),
    ("gpu recovery action changed from 0 to 3", RecoveryAction.DRAIN_P2P),
    ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", RecoveryAction.NONE),
    ("GPU recovery action changed from 0x0 (None) to 0x1f (Future)", None),
    ("GPU recovery action changed to 0x1", RecoveryAction.GPU_RESET),
    ("GPU recovery action changed from None to Node Reboot Required", RecoveryAction.NODE_REBOOT),
    ("GPU recovery action changed from GPU Reset Required to Drain and Reset", RecoveryAction.DRAIN_AND_RESET),
    ("something else", None),
])
def test_recovery_action_text(text: str, action: RecoveryAction | None) -> None:
    assert recovery_action_of(text) is action


def waiting_for_start(params: Params = P) -> State:
    s, acts = decide(initial_state(params), Boot(), 0.0)
    assert acts == [CheckVram()]
    return s


def test_nvml_reset_required_at_start_resets_before_any_server() -> None:
    s, acts = decide(waiting_for_start(), VramFacts(0, 100_000, 1000, recovery=RecoveryAction.GPU_RESET), 0.5)
    event = emitted(acts, "gpu_recovery_action")
    assert event.fields["recovery_action"] == "gpu_reset" and event.fields["source"] == "nvml"
    assert s.phase is Phase.RESETTING and InspectGpu(None, s.phase_data.trigger) in acts
    assert not [a for a in acts if isinstance(a, Spawn)]


@pytest.mark.parametrize("recovery", [RecoveryAction.NODE_REBOOT, RecoveryAction.SYSTEM_REBOOT,
                                      RecoveryAction.DRAIN_P2P, RecoveryAction.DRAIN_AND_RESET,
                                      RecoveryAction.BUS_RESET, RecoveryAction.RECOVER_IMEX_DOMAIN])
def test_nvml_reboot_or_drain_before_a_start_exits_69_with_advice(recovery: RecoveryAction) -> None:
    s, acts = decide(waiting_for_start(), VramFacts(0, 100_000, 1000, recovery=recovery), 0.5)
    advice = emitted(acts, "gpu_recovery_action").fields["advice"]
    assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts and str(advice) in s.exit.reason
    assert not [a for a in acts if isinstance(a, (Spawn, InspectGpu))]


def test_reset_required_with_the_budget_spent_or_no_reset_stops_instead_of_looping() -> None:
    s = replace(waiting_for_start(), resets=(0.1, 0.2))
    s, acts = decide(s, VramFacts(0, 100_000, 1000, recovery=RecoveryAction.GPU_RESET), 0.5)
    assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts and "spent" in s.exit.reason
    s, acts = decide(waiting_for_start(replace(P, reset_possible=False)),
                     VramFacts(0, 100_000, 1000, recovery=RecoveryAction.GPU_RESET), 0.5)
    assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts and "no reset" in s.exit.reason


def test_recovery_none_or_unreadable_starts_normally() -> None:
    for recovery in (RecoveryAction.NONE, None):
        _, acts = decide(waiting_for_start(), VramFacts(0, 100_000, 1000, recovery=recovery), 0.5)
        assert acts == [Spawn()]


def test_nvml_recovery_field_through_the_chokepoint() -> None:
    # The H200 answered 0 (none) for the field and per-field INVALID_ARGUMENT for an unknown id.
    h200 = json.loads(H200.read_text())
    assert (h200["230"]["ret"], h200["230"]["ui"], h200["99999"]["ret"]) == (0, 0, 2)
    gpu = FakeGpu()
    nvml = Nvml(DeviceSelector(0, None, None), module=FakeNvml([gpu]))
    assert nvml.recovery_action() is RecoveryAction.NONE
    gpu.values["recovery_action"] = 1
    assert nvml.recovery_action() is RecoveryAction.GPU_RESET
    gpu.values["recovery_action"] = None  # a driver that does not know the field
    with pytest.raises(NotSupported):
        nvml.recovery_action()
    nvml.close()


# ============================================================ 11: off the bus means no reset

@pytest.mark.parametrize("kmsg", ["off_bus_kmsg.txt", "off_bus_kind_kmsg.txt"])
def test_off_the_bus_parses_without_pid_and_adapter_failure_once(kmsg: str) -> None:
    parser = KmsgParser("00000000:06:00.0")
    recs = [r for text in lines(kmsg) for r in parser.feed(text)]
    assert len(recs) == 2
    fell, adapter = recs
    assert isinstance(fell, XidRecord) and fell.fallen_off_bus and fell.pid is None and fell.name is None
    assert isinstance(adapter, AdapterInitFailed) and adapter.pci == "0000:06:00.0"
    other = KmsgParser("0000:07:00.0")
    assert [r for text in lines(kmsg) for r in other.feed(text)] == []


@pytest.mark.parametrize("kmsg", ["off_bus_kmsg.txt", "off_bus_kind_kmsg.txt"])
def test_off_the_bus_stops_with_reboot_advice_and_never_resets(kmsg: str) -> None:
    s = ready()
    fell, adapter = kmsg_faults(kmsg, "0000:06:00.0")
    assert fell.action is XidAction.REBOOT
    s, acts = decide(s, fell, 5.0)
    assert "reboot" in str(emitted(acts, "gpu_lost").fields["reason"]) and Terminate(PID) in acts
    s, acts = decide(s, Exited(PID, -15), 5.5)
    assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts and "reboot" in s.exit.reason
    assert not [a for a in acts if isinstance(a, (InspectGpu, RunReset, Spawn))]
    # The adapter failure at the next start (the daemon restarted by systemd): no CPU fallback.
    s, acts = decide(initial_state(P), Boot(), 0.0)
    s, acts = decide(s, adapter, 0.2)
    assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts and not [a for a in acts
                                                                             if isinstance(a, Spawn)]


def test_adapter_failure_of_an_older_driver_names_no_bus_id() -> None:
    parser = KmsgParser("00000000:06:00.0")
    recs = [r for text in ("[  5.1] NVRM: RmInitAdapter failed! (0x25:0x65:1211)",
                           "[  5.1] NVRM: rm_init_adapter failed for device bearing minor number 0")
            for r in parser.feed(text)]
    assert recs == [AdapterInitFailed("0000:06:00.0", "NVRM: RmInitAdapter failed! (0x25:0x65:1211)")]


def test_adapter_failure_while_the_server_falls_back_to_the_cpu() -> None:
    # The server prints "failed to initialize CUDA" and would run on the CPU; the kernel says why.
    s, _ = decide(initial_state(replace(P, require_gpu=True, vram_admission=False)), Boot(), 0.0)
    s, _ = decide(s, Spawned(PID, ()), 0.0)
    s, acts = feed_log(s, "off_bus_server.log", 0.5)
    assert "server_gpu_unavailable" in names(acts) and s.phase is Phase.STOPPING
    [_, adapter] = kmsg_faults("off_bus_kmsg.txt", "0000:06:00.0")
    s, acts = decide(s, adapter, 0.6)
    s, acts = decide(s, HealthOk(PID), 0.7)  # the CPU server answers: never READY
    assert s.phase is Phase.STOPPING
    s, acts = decide(s, Exited(PID, -15), 1.0)
    assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts


# ============================================================ 12: a server stuck in the driver

@pytest.mark.parametrize("cause", ["oom", "hang"])
def test_server_outliving_sigkill_is_a_reboot_verdict(cause: str) -> None:
    s = ready()
    if cause == "oom":
        s, _ = decide(s, Line(PID, classify_line("CUDA error: out of memory"), "CUDA error: out of memory"), 5.0)
        assert s.after_stop is AfterStop.RESET
    else:
        s, _ = decide(s, GpuFault(GpuFaultKind.XID, "Xid 13", XidAction.RESTART, 13, XidScope.APP, PID), 5.0)
    s, acts = decide(s, Tick(), 5.0 + P.stop_grace_s)
    assert Kill(PID) in acts
    s, acts = decide(s, Tick(), 5.0 + P.stop_grace_s + P.kill_wait_s)
    event = emitted(acts, "server_unkillable")
    assert event.fields["server_pid"] == PID and event.fields["advice"] == "reboot the host"
    assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts and "reboot the host" in s.exit.reason
    assert not [a for a in acts if isinstance(a, (InspectGpu, RunReset, Spawn))]


def test_server_outliving_sigkill_on_a_requested_stop_keeps_exit_0() -> None:
    s, _ = decide(ready(), StopRequest("SIGTERM"), 5.0)
    s, _ = decide(s, Tick(), 5.0 + P.stop_grace_s)
    s, acts = decide(s, Tick(), 5.0 + P.stop_grace_s + P.kill_wait_s)
    assert "server_unkillable" in names(acts) and ExitDaemon(EXIT_OK, s.exit.reason) in acts


# ============================================================ 13: handled exceptions are not crashes

@pytest.mark.parametrize("log", ["handled_exception_server.log", "handled_exception_kind_server.log",
                                 "real_handled_errors.log"])
def test_handled_exceptions_change_nothing(log: str) -> None:
    verdicts = [classify_line(x) for x in lines(log)]
    assert any(v.family is Family.HANDLED_ERROR for v in verdicts)
    assert not [v for v in verdicts if v.family in ERROR_FAMILIES], verdicts
    s = ready()
    s2, acts = feed_log(s, log, 5.0)
    assert acts == [] and s2 == s


def test_handled_exception_names_the_request_kind() -> None:
    kinds = [classify_line(x).request_kind for x in lines("real_handled_errors.log")
             if classify_line(x).family is Family.HANDLED_ERROR]
    assert "malformed JSON request" in kinds and "tool-call request" in kinds
    assert any(k.startswith("grammar-constrained") for k in kinds)


@pytest.mark.parametrize(("log", "kind"), [("uncaught_exception_server.log", "grammar-constrained"),
                                           ("uncaught_exception_kind_server.log", "tool-call")])
def test_uncaught_exception_restarts_and_a_repeat_names_the_request_kind(log: str, kind: str) -> None:
    # Crashes of a server that had run stably (sporadic, under load): restarted each time, said
    # from the second within the window with the request kind; no verdict.
    s = ready()
    seen: list[Action] = []
    t = 1.0  # when the current server became ready
    for round_ in range(3):
        pid = PID + round_
        s, _ = decide(s, Tick(), t + P.stable_after_s)
        assert s.stable
        s, acts = feed_log(s, log, t + 11.0, pid)
        assert acts == [] and s.phase is Phase.READY  # the lines alone: the process decides
        s, acts = decide(s, Exited(pid, -6), t + 12.0)
        seen += acts
        assert s.phase is Phase.BACKOFF and "server_exited" in names(acts)
        if round_ == 0:
            assert "server_crash_repeated" not in names(acts)
        s, _ = decide(s, Tick(), s.deadline or 0.0)
        s, _ = decide(s, VramFacts(0, 100_000, 1000), t + 12.5)
        s, _ = decide(s, Spawned(pid + 1, ()), t + 12.5)
        s, _ = decide(s, HealthOk(pid + 1), t + 13.0)
        t += 13.0
    repeats = [a for a in seen if isinstance(a, Emit) and a.name == "server_crash_repeated"]
    assert [r.fields["count"] for r in repeats] == [2, 3]
    assert str(repeats[0].fields["request_kind"]).startswith(kind)
    assert "what():" in str(repeats[0].fields["line"])
    assert not [a for a in seen if isinstance(a, ExitDaemon)]  # a crash is restarted, never a verdict here


def test_crashes_further_apart_than_the_window_are_not_a_repeat() -> None:
    s = ready()
    for round_, t in enumerate((5.0, 5.0 + P.restart_window_s + 1)):
        pid = PID + round_
        s, _ = feed_log(s, "uncaught_exception_server.log", t, pid)
        s, acts = decide(s, Exited(pid, -6), t + 0.1)
        assert "server_crash_repeated" not in names(acts)
        s, _ = decide(s, Tick(), s.deadline or 0.0)
        s, _ = decide(s, VramFacts(0, 100_000, 1000), t + 0.3)
        s, _ = decide(s, Spawned(pid + 1, ()), t + 0.3)
        s, _ = decide(s, HealthOk(pid + 1), t + 0.4)


def test_sigkill_is_not_a_crash_of_the_server() -> None:
    s = ready()
    for round_ in range(2):
        pid = PID + round_
        s, _ = feed_log(s, "uncaught_exception_server.log", 5.0 + round_, pid)
        s, acts = decide(s, Exited(pid, -9), 5.1 + round_)
        assert "server_crash_repeated" not in names(acts)
        s, _ = decide(s, Tick(), s.deadline or 0.0)
        s, _ = decide(s, VramFacts(0, 100_000, 1000), 5.3 + round_)
        s, _ = decide(s, Spawned(pid + 1, ()), 5.3 + round_)
        s, _ = decide(s, HealthOk(pid + 1), 5.4 + round_)


# ============================================================ 15: other backends

@pytest.mark.parametrize("log", ["vulkan_oom_server.log", "vulkan_oom_kind_server.log"])
def test_vulkan_oom_at_load_is_an_oom(log: str) -> None:
    s, _ = decide(initial_state(replace(P, vram_admission=False)), Boot(), 0.0)
    s, _ = decide(s, Spawned(PID, ()), 0.0)
    s, acts = feed_log(s, log, 0.5)
    oom = emitted(acts, "server_oom")
    assert oom.fields["phase"] == "loading" and "out of memory" in str(oom.fields["cause"])
    assert s.phase is Phase.STOPPING
    # The glibc abort that follows names itself, not a second fault.
    assert classify_line(lines(log)[-1]).cause.startswith("glibc heap check aborted")


def test_vulkan_allocation_failure_then_exit_is_a_fatal_oom() -> None:
    # Only the allocation line, then the process dies: judged by what follows, like CUDA's.
    text = "ggml_vulkan: Device memory allocation of size 4563402752 failed."
    s, _ = decide(initial_state(replace(P, vram_admission=False, reset_possible=False)), Boot(), 0.0)
    s, _ = decide(s, Spawned(PID, ()), 0.0)
    s, acts = decide(s, Line(PID, classify_line(text), text), 0.5)
    assert acts == [] and classify_line(text).family is Family.ALLOC_FAILED
    s, acts = decide(s, Exited(PID, -6), 0.6)
    assert "4563402752" in str(emitted(acts, "server_oom").fields["cause"])


@pytest.mark.parametrize("log", ["vulkan_lost_server.log", "vulkan_lost_kind_server.log"])
def test_vulkan_device_lost_is_a_lost_device(log: str) -> None:
    s, acts = feed_log(ready(), log, 5.0)
    lost = emitted(acts, "gpu_lost")
    assert lost.fields["server_pid"] == PID and "device was lost" in str(lost.fields["reason"])
    assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.RESET  # gpu_lost is in reset_on
    no_reset = replace(P, reset_on=frozenset({ResetTrigger.OOM}))
    s, _ = feed_log(ready(no_reset), log, 5.0)
    assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.FAILURE
