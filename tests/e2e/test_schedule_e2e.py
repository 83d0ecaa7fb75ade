"""End to end, against the REAL llama-server: planned restarts drain first.

One daemon serves the whole module, so the model loads once and the cron minute is waited for
once. ``restart_cron`` is a real 5-field expression for the first minute boundary at least
``LEAD_S`` seconds after the module starts (time zone UTC): no test clock, no test hook. The
requested-restart scenarios (the crontab command, a drain timeout) run while that minute
approaches; if it is too close for them, the scheduled one runs first (``Planned.fire``).
Worst case the module takes about 80 s, typically about 50 s.

(a) the schedule fires while a long completion runs → the restart waits for it (the client gets
    its full answer), then happens; ``scheduled_restart`` and ``planned_restart_done`` carry
    the figures;
(b) a drain timeout (``drain_timeout_s = 1`` set by a reload) → restarted anyway, reported;
(c) the command of ``deploy/crontab`` run by hand → the same drained restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import ROOT, DaemonRun, base_sections, config_text, free_port, merge, server_pids_of

pytestmark = pytest.mark.real

LEAD_S = 15.0        # the fire is at least this far after the module starts (the model loads meanwhile)
BEFORE_FIRE_S = 2.5  # the long completion starts this long before the cron minute
NEEDS_S = 24.0       # what one requested-restart scenario needs before the fire must be prepared
CRONTAB = ROOT / "deploy" / "crontab"


def _stamp(event: dict[str, Any]) -> float:
    """An event's wall-clock time (structlog's local ISO timestamp) as a Unix time."""
    return datetime.fromisoformat(str(event["timestamp"])).timestamp()


@dataclass
class Completion:
    """One long completion in a thread, with its wall-clock start and end.

    Its length is set in time, not tokens (``t_max_predict_ms``: generation stops at the first
    newline after that long), so that it spans the restart request on a fast or a loaded box;
    the prompt makes newlines frequent.
    """

    port: int
    seconds: float
    answer: dict[str, Any] | None = None
    error: str = ""
    started: float = 0.0
    ended: float = 0.0
    thread: threading.Thread | None = None

    def start(self) -> Completion:
        def go() -> None:
            self.started = time.time()
            try:
                resp = httpx.post(f"http://127.0.0.1:{self.port}/completion", timeout=120, json={
                    "prompt": "Count from 1 to 2000, one number per line.\n1\n2\n3\n", "n_predict": 1500,
                    "ignore_eos": True, "cache_prompt": False, "t_max_predict_ms": int(self.seconds * 1000)})
                resp.raise_for_status()
                self.answer = resp.json()
            except (httpx.HTTPError, ValueError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
            self.ended = time.time()

        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()
        wait_busy(self.port)
        return self

    def join(self) -> Completion:
        assert self.thread is not None
        self.thread.join(120)
        return self

    @property
    def full(self) -> bool:
        """The client got a complete answer (not a connection cut by a restart)."""
        return (self.answer is not None and self.answer.get("stop") is True
                and self.answer["timings"]["predicted_n"] == self.answer["tokens_predicted"] > 0)


def wait_busy(port: int, timeout: float = 10.0) -> None:
    """Until a slot of the server on ``port`` is processing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            slots = httpx.get(f"http://127.0.0.1:{port}/slots", timeout=2).json()
            if any(s.get("is_processing") for s in slots):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no slot of port {port} became busy within {timeout} s")


def first_minute_after(now: datetime, lead_s: float) -> datetime:
    """The first whole minute at least ``lead_s`` seconds after ``now``."""
    fire = (now + timedelta(seconds=lead_s + 60)).replace(second=0, microsecond=0)
    return fire - timedelta(minutes=1) if (fire - now).total_seconds() >= lead_s + 60 else fire


def cron_for(fire: datetime) -> str:
    """A daily 5-field cron expression for ``fire``'s UTC minute."""
    return f"{fire.minute} {fire.hour} * * *"


def crontab_argv(config: Path) -> list[str]:
    """The active entry of deploy/crontab, as it would run here: this Python and this config."""
    entries = [line.split() for line in CRONTAB.read_text().splitlines()
               if line.strip() and not line.lstrip().startswith("#") and "=" not in line.split()[0]]
    assert len(entries) == 1, f"expected one active entry in {CRONTAB}: {entries}"
    command = entries[0][6:]  # minute hour dom month dow USER command...
    assert Path(command[0]).name == "llama-guard", command
    argv = [sys.executable, "-m", "llama_guard", *command[1:]]
    argv[argv.index("--config") + 1] = str(config)
    return argv


@dataclass
class Planned:
    """The module's daemon, its scheduled minute, and the scheduled scenario's results."""

    run: DaemonRun
    port: int
    sections: dict[str, dict[str, object]]
    fire: datetime          # the cron minute, UTC
    fired: dict[str, Any] = field(default_factory=dict)

    def count(self, name: str, where: Callable[[dict[str, Any]], bool] = lambda e: True) -> int:
        return len([e for e in self.run.events() if e["event"] == name and where(e)])

    def next(self, name: str, timeout: float = 30.0,
             where: Callable[[dict[str, Any]], bool] = lambda e: True) -> Callable[[], dict[str, Any]]:
        """Remember how many ``name`` events exist now; the returned call waits for the next one."""
        skip = self.count(name, where)
        return lambda: self.run.wait_event(name, timeout, skip=skip, where=where)

    def reload(self, schedule: dict[str, object]) -> None:
        self.sections = merge(self.sections, {"schedule": schedule})
        self.run.config.write_text(config_text(self.sections))
        reloaded = self.next("config_reloaded", 15)
        self.run.signal(signal.SIGHUP)
        reloaded()

    def warm(self) -> None:
        """A short completion: a measured speed window for the "before" figures."""
        httpx.post(f"http://127.0.0.1:{self.port}/completion", timeout=60,
                   json={"prompt": "Hello", "n_predict": 24, "ignore_eos": True}).raise_for_status()

    def prepare_fire_if_near(self) -> None:
        """Run the scheduled scenario now if the cron minute is too close for another scenario."""
        if not self.fired and (self.fire.timestamp() - time.time()) < NEEDS_S:
            self.run_fire()

    def run_fire(self) -> None:
        """Scenario (a): a long completion across the cron minute."""
        if self.fired:
            return
        old = self.run.wait_event("server_ready", 5, skip=self.count("server_ready") - 1)["server_pid"]
        scheduled = self.next("scheduled_restart", 15)
        done = self.next("planned_restart_done", 90)
        for _ in range(3):
            if self.fire.timestamp() - time.time() < BEFORE_FIRE_S + 6.0:
                # A slow box: the other scenarios took longer than planned. The next minute, by a reload.
                self.fire = first_minute_after(datetime.now(timezone.utc), BEFORE_FIRE_S + 8.0)
                self.reload({"restart_cron": cron_for(self.fire)})
            self.warm()  # a speed window for the "before" figures
            if self.fire.timestamp() - time.time() > BEFORE_FIRE_S:
                break
        time.sleep(max(0.0, self.fire.timestamp() - time.time() - BEFORE_FIRE_S))
        job = Completion(self.port, BEFORE_FIRE_S + 6.0).start()
        self.fired["scheduled"] = scheduled()
        self.fired["completion"] = job.join()
        self.fired["done"] = done()
        self.fired["old_pid"] = old
        self.fired["events"] = self.run.events()


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path, real_model: Path) -> Iterator[Planned]:
    tmp = tmp_path_factory.mktemp("schedule_e2e")
    port = free_port()
    fire = first_minute_after(datetime.now(timezone.utc), LEAD_S)
    sections = merge(base_sections(tmp, str(llama_server_bin), str(real_model), port), {
        "server": {"ctx_size": 2048},
        "schedule": {"restart_cron": cron_for(fire), "timezone": "UTC",
                     "min_uptime_s": 0.0, "drain_timeout_s": 60.0, "decay_warmup_s": 0.0,
                     "decay_baseline_samples": 1, "speed_window_tokens": 16},
    })
    run = DaemonRun(tmp, sections).start()
    try:
        run.wait_event("server_ready", 60)
        yield Planned(run, port, sections, fire)
    finally:
        run.stop()
        for pid in server_pids_of(port):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"llama-server pid {pid} outlived its daemon")


def test_crontab_command_drains_like_the_schedule(planned: Planned) -> None:
    """(c) deploy/crontab's command, run by hand: waits for the running completion, then restarts."""
    planned.prepare_fire_if_near()
    run = planned.run
    old = run.wait_event("server_ready", 5, skip=planned.count("server_ready") - 1)["server_pid"]
    requested = planned.next("restart_requested")
    done = planned.next("planned_restart_done")
    planned.warm()
    job = Completion(planned.port, 3.0).start()
    out = subprocess.run(crontab_argv(run.config), capture_output=True, text=True, timeout=30, check=False,
                         env={k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")})
    assert out.returncode == 0, out.stderr
    assert f"pid {run.pid}" in out.stdout
    asked = requested()
    job.join()
    assert job.full, f"the client did not get its full answer: {job.error or job.answer}"
    record = done()
    stopped = run.wait_event("server_stopped", 5, where=lambda e: e["server_pid"] == old)
    assert asked["server_pid"] == old
    assert _stamp(asked) < job.ended <= _stamp(stopped) + 0.5, "the restart did not wait for the completion"
    assert record["kind"] == "requested" and record["outcome"] == "drained" and record["drained"] is True
    assert record["server_pid"] != old
    assert 0 < record["unavailable_s"] < 30
    assert not [e for e in run.events() if e["event"] == "drain_timeout" and e["server_pid"] == old]


def test_drain_timeout_restarts_anyway(planned: Planned) -> None:
    """(b) drain_timeout_s = 1 (by a reload) and a completion that needs longer: restarted anyway."""
    planned.prepare_fire_if_near()
    run = planned.run
    planned.reload({"drain_timeout_s": 1.0})
    try:
        old = run.wait_event("server_ready", 5, skip=planned.count("server_ready") - 1)["server_pid"]
        requested = planned.next("restart_requested")
        timed_out = planned.next("drain_timeout", 15)
        done = planned.next("planned_restart_done")
        planned.warm()
        job = Completion(planned.port, 6.0).start()
        subprocess.run(crontab_argv(run.config), capture_output=True, text=True, timeout=30, check=True)
        asked, timeout_event, record = requested(), timed_out(), done()
        job.join()
        assert timeout_event["server_pid"] == old and timeout_event["drain_timeout_s"] == 1.0
        waited = _stamp(timeout_event) - _stamp(asked)
        assert 0.9 <= waited < 3.0, f"drain_timeout after {waited:.2f} s"
        assert _stamp(timeout_event) < job.started + 6.0 * 0.8, "it waited for the completion after all"
        assert record["kind"] == "requested" and record["outcome"] == "drain_timeout"
        assert record["drained"] is False and 0 < record["unavailable_s"] < 30
        assert record["server_pid"] != old
        assert timeout_event["level"] == "warning"
    finally:
        planned.reload({"drain_timeout_s": 60.0})


def test_schedule_fires_during_a_completion_and_waits_for_it(planned: Planned) -> None:
    """(a) restart_cron fires while a long completion runs: drained restart, figures reported."""
    planned.run_fire()
    fired, run = planned.fired, planned.run
    job: Completion = fired["completion"]
    scheduled, record, old = fired["scheduled"], fired["done"], fired["old_pid"]
    assert job.full, f"the client did not get its full answer: {job.error or job.answer}"
    # It fired in the cron minute, while the completion ran, and named the schedule.
    assert planned.fire.timestamp() <= _stamp(scheduled) < planned.fire.timestamp() + 5
    assert job.started < _stamp(scheduled) < job.ended
    assert scheduled["server_pid"] == old
    assert f"'{cron_for(planned.fire)}'" in scheduled["reason"]
    assert scheduled["uptime_s"] > 0
    # The old server was stopped only after the answer was complete; a new one is serving.
    events = fired["events"]
    stopped = [e for e in events if e["event"] == "server_stopped" and e["server_pid"] == old]
    assert stopped and _stamp(stopped[0]) + 0.5 >= job.ended
    assert not [e for e in events if e["event"] == "drain_timeout" and e["server_pid"] == old]
    assert record["kind"] == "scheduled" and record["outcome"] == "drained" and record["drained"] is True
    assert record["server_pid"] != old
    assert record["uptime_s"] == pytest.approx(scheduled["uptime_s"], abs=0.01)
    assert 0 < record["unavailable_s"] < 30
    assert record["tokens_per_s_before"] > 0  # the old server's last measured window
    assert "tokens/s" in record["summary"]
    # `llama-guard status` shows the record and the next fire (the same minute tomorrow).
    out = subprocess.run([sys.executable, "-m", "llama_guard", "status", "--config", str(run.config), "--json"],
                         capture_output=True, text=True, timeout=30, check=True)
    snap = json.loads(out.stdout)["planned_restarts"]
    assert snap["cron"] == cron_for(planned.fire)
    assert datetime.fromisoformat(snap["next_fire"]) == planned.fire + timedelta(days=1)
    kinds = [(r["kind"], r["drained"]) for r in snap["history"]]
    assert ("scheduled", True) in kinds
    text = subprocess.run([sys.executable, "-m", "llama_guard", "status", "--config", str(run.config)],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    assert "next planned restart" in text and "last planned restart" in text
