"""End to end: the public-report faults through the real daemon. The real llama-server (CPU build,
SmolLM2) where this machine can produce the fault (requests the server answers with an error); the
fake llama-server replaying a report's lines, the NVML double and a kernel-log file where it cannot
(CUDA/Vulkan faults, Xids, NVML's recovery action). The unit-level replay is test_public_reports.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_reset_e2e
from harness import RunPool, server_pids_of
from needs import unavailable
from test_reset_e2e import GpuRun, MakeRun

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "public_reports"
OUR_PCI = "PCI:0000:02:00"  # the NVML double's GPU (00000000:02:00.0)

pytestmark = [pytest.mark.timeout(90)]

gpu_run = test_reset_e2e.gpu_run  # the fixture: daemon + fake llama-server + NVML double + stub reset


def replaying(gpu_run: MakeRun, fault: str, fixture: str, *, kmsg: Path | None = None,
              extra: dict[str, dict[str, object]] | None = None, nvml: dict[str, object] | None = None) -> GpuRun:
    env = {"FAKE_LLAMA_FAULT": fault, "FAKE_LLAMA_LOAD_S": "0.2", "FAKE_LLAMA_REPLAY": str(FIX / fixture)}
    sections: dict[str, dict[str, object]] = {"server": {"n_gpu_layers": 99, "env": env}}
    if kmsg is not None:
        kmsg.write_text("6,1,0,-;an old line\n")
        sections["gpu"] = {"kmsg_path": str(kmsg)}
    for key, value in (extra or {}).items():
        sections.setdefault(key, {}).update(value)
    return gpu_run(fault, extra=sections, nvml=nvml)


def completion(port: int) -> None:
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "x", "n_predict": 1}, timeout=10.0)


def kernel(kmsg: Path, text: str) -> None:
    with kmsg.open("a") as handle:
        handle.write(f"4,{int(time.time())},1,-;{text}\n")


def test_launch_watchdog_restarts_without_a_reset_and_says_it_repeats(gpu_run: MakeRun, tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    run = replaying(gpu_run, "replay_request_abort", "watchdog_server.log", kmsg=kmsg,
                    extra={"recovery": {"reset_on": ["gpu_lost", "xid", "oom", "cuda_error"]}}).start()
    for round_ in range(2):
        pid = run.wait_event("server_ready", 20, skip=round_)["server_pid"]
        # The kernel's Xid 8 and the server's own "launch timed out" come together, in either order.
        kernel(kmsg, f"NVRM: Xid ({OUR_PCI}): 8, pid={pid}, name=llama-server, Channel 0x00000018")
        completion(run.port)
        run.wait_event("server_stopped", 20, skip=round_)
        xid = run.wait_event("gpu_xid", 10, skip=round_)
        assert xid["xid"] == 8 and xid["xid_pid"] == pid and xid["action"] in ("restart", "event_only")
    run.wait_event("server_ready", 20, skip=2)
    repeated = run.wait_event("gpu_watchdog_repeated", 5)
    assert repeated["count"] == 2
    causes = {e["restart_cause"] for e in run.events() if e["event"] == "server_restart"}
    assert causes and causes <= {"cuda_error", "xid"}, causes  # the line's or the Xid's, whichever came first
    assert run.records() == []  # even with cuda_error in reset_on: no GPU reset
    assert "gpu_reset" not in run.names()


def test_reset_required_at_start_resets_before_the_first_server(gpu_run: MakeRun) -> None:
    run = gpu_run(nvml={"values": {"recovery_action": 1}}).start()
    action = run.wait_event("gpu_recovery_action", 20)
    assert action["recovery_action"] == "gpu_reset" and action["source"] == "nvml"
    run.wait_event("server_ready", 30)
    assert run.wait_event("gpu_reset")["outcome"] == "succeeded" and len(run.records()) == 1
    assert run.order("gpu_recovery_action", "gpu_reset", "server_starting", "server_ready") == [
        "gpu_recovery_action", "gpu_reset", "server_starting", "server_ready"]


@pytest.mark.parametrize(("code", "name"), [(2, "node_reboot"), (4, "drain_and_reset")])
def test_reboot_or_drain_required_at_start_starts_nothing_and_exits_69(gpu_run: MakeRun, code: int,
                                                                        name: str) -> None:
    run = gpu_run(nvml={"values": {"recovery_action": code}}).start()
    assert run.wait_exit(30) == 69
    assert run.wait_event("gpu_recovery_action")["recovery_action"] == name
    lost = run.wait_event("gpu_lost")
    assert "reboot" in lost["reason"] and run.wait_event("daemon_exit")["exit_code"] == 69
    assert "server_starting" not in run.names() and run.records() == []


def test_xid_154_asking_for_a_reset_in_the_kernel_log_resets(gpu_run: MakeRun, tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    run = replaying(gpu_run, "", "watchdog_server.log", kmsg=kmsg).start()
    first = run.wait_event("server_ready", 20)["server_pid"]
    # Another process's GSP timeout on our GPU, another GPU's in the same burst, then "reset required".
    for text in (FIX / "reset_required_kmsg.txt").read_text().splitlines():
        kernel(kmsg, text.split(";", 1)[1].replace("PCI:0000:9b:00", OUR_PCI))
    second = run.wait_event("server_ready", 30, skip=1)["server_pid"]
    assert second != first and run.wait_event("gpu_reset")["outcome"] == "succeeded"
    xids = [e for e in run.events() if e["event"] == "gpu_xid"]
    assert [x["xid"] for x in xids] == [119, 154]  # our GPU's two lines only
    assert xids[0]["ours"] is False and xids[1]["recovery_action"] == "gpu_reset"
    assert len(run.records()) == 1


def test_xid_154_from_nvml_alone_follows_the_recovery_field(gpu_run: MakeRun) -> None:
    # No kernel log: NVML's event has only the number; the field read with it says "node reboot".
    run = gpu_run().start()
    run.wait_event("server_ready", 20)
    run.set_nvml(values={"recovery_action": 2}, xids=[154])
    assert run.wait_exit(30) == 69
    xid = run.wait_event("gpu_xid")
    assert (xid["xid"], xid["source"], xid["recovery_action"], xid["action"]) == (154, "nvml", "node_reboot",
                                                                                   "reboot")
    assert "reboot" in run.wait_event("gpu_lost")["reason"] and run.records() == []


def test_off_the_bus_stops_without_a_reset_and_exits_69(gpu_run: MakeRun, tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    run = replaying(gpu_run, "", "watchdog_server.log", kmsg=kmsg).start()
    run.wait_event("server_ready", 20)
    kernel(kmsg, f"NVRM: Xid ({OUR_PCI}): 79, GPU has fallen off the bus.")
    assert run.wait_exit(30) == 69
    lost = run.wait_event("gpu_lost")
    assert "reboot" in lost["reason"] and "not attempted" in lost["reset"]
    assert run.records() == [] and "gpu_reset" not in run.names() and "server_restart" not in run.names()


def test_adapter_failure_at_start_never_runs_the_server_on_the_cpu(gpu_run: MakeRun, tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    # The server says it found no usable GPU (and would go on on the CPU); the kernel says why.
    run = replaying(gpu_run, "gpu_unavailable", "watchdog_server.log", kmsg=kmsg,
                    extra={"server": {"env": {"FAKE_LLAMA_FAULT": "gpu_unavailable", "FAKE_LLAMA_LOAD_S": "2"}}}
                    ).start()
    run.wait_event("server_starting", 20)
    kernel(kmsg, "NVRM: GPU 0000:02:00.0: RmInitAdapter failed! (0x22:0x56:884)")
    kernel(kmsg, "NVRM: GPU 0000:02:00.0: rm_init_adapter failed, device minor number 0")
    assert run.wait_exit(30) == 69
    assert "server_ready" not in run.names() and run.records() == []
    assert [e["event"] for e in run.events()].count("gpu_lost") == 1
    assert "RmInitAdapter" in run.wait_event("gpu_lost")["reason"]


def test_uncaught_exception_restarts_and_a_repeat_names_the_request_kind(gpu_run: MakeRun) -> None:
    run = replaying(gpu_run, "replay_request_abort", "uncaught_exception_server.log").start()
    for round_ in range(2):
        run.wait_event("server_ready", 20, skip=round_)
        completion(run.port)
        run.wait_event("server_exited", 20, skip=round_)
    run.wait_event("server_ready", 20, skip=2)
    repeated = run.wait_event("server_crash_repeated", 5)
    assert repeated["count"] == 2 and repeated["request_kind"].startswith("grammar-constrained")
    assert {e["restart_cause"] for e in run.events() if e["event"] == "server_restart"} == {"crash"}
    assert "empty grammar stack" in repeated["line"]
    assert run.records() == []


def test_vulkan_oom_at_load_is_reported_as_an_oom(gpu_run: MakeRun) -> None:
    run = replaying(gpu_run, "replay_load_abort", "vulkan_oom_server.log").start()
    oom = run.wait_event("server_oom", 20)
    assert oom["phase"] == "loading" and "Vulkan" in oom["cause"]


# ------------------------------------------------------------------ the real llama-server

@pytest.fixture
def real(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> Any:
    pool = RunPool()
    yield lambda extra=None: pool.new(tmp_path, str(llama_server_bin), str(real_model), extra)
    leftovers = pool.finish()
    if leftovers:
        pytest.fail(f"llama-server pids {leftovers} outlived their daemon")


BAD_REQUESTS: list[tuple[str, object]] = [
    ("/completion", {"prompt": "hi", "n_predict": 2, "grammar": "root ::= ("}),
    ("/completion", '{"prompt":"hi","n_predict":2,'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"schema": {"type": "bogus"}}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "tools": [{"type": "function", "function": {"name": "x",
                                                                          "parameters": {"type": "object"}}}],
                              "tool_choice": "bogus"}),
]


@pytest.mark.real
def test_real_server_handled_exceptions_change_nothing(real: Any) -> None:
    run = real({"health": {"canary": False}}).start()
    pid = run.wait_event("server_ready", 60)["server_pid"]
    for path, body in BAD_REQUESTS:
        data = body if isinstance(body, str) else json.dumps(body)
        resp = httpx.post(f"http://127.0.0.1:{run.port}{path}", content=data, timeout=30.0,
                          headers={"Content-Type": "application/json"})
        assert 400 <= resp.status_code < 600, resp.text
    rounds = run.count("server_probe")
    ok = httpx.post(f"http://127.0.0.1:{run.port}/completion", json={"prompt": "hi", "n_predict": 2}, timeout=60)
    assert ok.status_code == 200
    run.wait_event("server_probe", 60, skip=rounds + 2)  # three liveness rounds after the last request
    lines = [e for e in run.events() if e["event"] == "server_line"]
    handled = [e["line"] for e in lines if e["family"] == "handled_error"]
    assert any("got exception" in x for x in handled) and any("grammar" in x for x in handled), handled
    assert not [e for e in lines if e["family"] in ("error", "gpu_fatal", "oom")], lines
    for name in ("server_exited", "server_restart", "server_stopped", "server_hang", "server_crash_repeated"):
        assert name not in run.names()
    assert server_pids_of(run.port) == [pid]


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.mark.real
def test_real_server_stuck_in_the_kernel_gets_no_successor_and_a_reboot_verdict(real: Any, tmp_path: Path) -> None:
    """A server that SIGKILL cannot end: the real llama-server put in a frozen cgroup-v1 freezer
    group, where it sits in state D as a process inside the GPU driver does. The liveness rounds
    call it hung; SIGTERM, SIGKILL do nothing; then no new server, no reset: exit 69 naming a reboot."""
    if os.geteuid() != 0 or not (FREEZER / "cgroup.procs").exists():
        unavailable("needs root and the cgroup-v1 freezer (/sys/fs/cgroup/freezer) to hold a process in state D")
    group = FREEZER / f"llama-guard-test-{os.getpid()}"
    group.mkdir()
    pid = 0
    try:
        run = real({"health": {"canary": False}}).start()
        pid = run.wait_event("server_ready", 60)["server_pid"]
        (group / "cgroup.procs").write_text(str(pid))
        (group / "freezer.state").write_text("FROZEN")
        assert run.wait_exit(60) == 69
        assert "State:\tD" in Path(f"/proc/{pid}/status").read_text()  # SIGKILLed, still there
        stuck = run.wait_event("server_unkillable")
        assert stuck["server_pid"] == pid and stuck["advice"] == "reboot the host"
        exit_event = run.wait_event("daemon_exit")
        assert exit_event["exit_code"] == 69 and "reboot the host" in exit_event["reason"]
        wanted = ("server_hang", "server_stop_timeout", "server_unkillable", "daemon_exit")
        assert [n for n in run.names() if n in wanted] == list(wanted)
        assert run.names().count("server_starting") == 1  # no second server
        assert "gpu_reset" not in run.names()
    finally:
        (group / "freezer.state").write_text("THAWED")  # the pending SIGKILL then ends it
        deadline = time.monotonic() + 10
        while pid and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        group.rmdir()
