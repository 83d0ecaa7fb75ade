"""The policy's vocabulary: phases, parameters, inputs (observations), actions and the state.

Kept apart from the transitions (:mod:`llama_guard.core.policy`) so that watchers and the daemon
can speak the policy's language without importing its rules (the model: supervisord's
``states.py``). Everything here is a frozen dataclass or an enum; nothing does I/O.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field

from llama_guard.core.server_log import LineClass
from llama_guard.exitcodes import EXIT_OK


class Phase(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    RESETTING = "resetting_gpu"
    EXITED = "exited"


class AfterStop(enum.Enum):
    """What happens once the child being stopped has exited."""

    RESTART = "restart"    # planned: start again at once, not a failure
    FAILURE = "failure"    # count a failure, then back off (or give up: crash loop)
    EXIT = "exit"          # the daemon exits with State.exit_code
    RESET = "reset"        # reset the GPU (State.reset_reason), then start again


@dataclass(frozen=True)
class Params:
    """The policy's knobs (from ``[health]``, ``[recovery]`` and ``[schedule]``), in seconds."""

    load_timeout_s: float = 900.0
    hang_strikes: int = 3
    backoff_initial_s: float = 1.0
    backoff_factor: float = 2.0
    backoff_max_s: float = 60.0
    max_restarts: int = 5
    restart_window_s: float = 600.0
    stable_after_s: float = 60.0
    stop_grace_s: float = 15.0
    kill_wait_s: float = 10.0
    drain_timeout_s: float = 300.0
    require_gpu: bool = False
    reset_possible: bool = False
    reset_on: frozenset[str] = frozenset({"gpu_lost", "xid", "oom"})
    max_resets: int = 2
    reset_window_s: float = 3600.0
    reset_deadline_s: float = 180.0


# ---------------------------------------------------------------- inputs (observations)

class Input:
    """Base of every observation the daemon feeds to :func:`decide`."""


@dataclass(frozen=True)
class Boot(Input):
    """The daemon has passed its preflight and wants a server."""


@dataclass(frozen=True)
class Spawned(Input):
    """The executor started llama-server as ``pid`` (its own process group) with ``argv``."""

    pid: int
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpawnFailed(Input):
    """llama-server could not be started: ``exec`` failed (binary missing, not executable …;
    ``fatal``: a configuration error, exit 78), or a precondition refused this start (``fatal``
    False: counted as a failure, retried after the backoff)."""

    reason: str
    fatal: bool = True


@dataclass(frozen=True)
class NotOnGpu(Input):
    """Server ``pid`` answers /health but never appeared on the GPU: it silently runs on the CPU."""

    pid: int
    reason: str


@dataclass(frozen=True)
class GpuFault(Input):
    """The GPU is lost (``kind`` "gpu_lost") or reported an Xid (``kind`` "xid").

    ``action`` is the Xid table's verdict: "restart", "reset", "reset_once_then_escalate",
    "follow_recovery_action" or "event_only"; a lost GPU is "reset_once_then_escalate".
    """

    kind: str
    reason: str
    action: str = "reset_once_then_escalate"
    xid: int | None = None


@dataclass(frozen=True)
class ResetDone(Input):
    """The GPU reset sequence ended: ``outcome`` "succeeded", "skipped" (a precondition failed;
    nothing was reset) or "failed" (the command failed or timed out, or the GPU did not verify)."""

    outcome: str
    reason: str
    fields: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Line(Input):
    """One classified line of the server's stdout/stderr."""

    pid: int
    verdict: LineClass
    text: str


@dataclass(frozen=True)
class HealthOk(Input):
    """``GET /health`` answered 200 for server ``pid`` (and, with a GPU, it runs there).
    ``port_pid``/``port_comm``: the process listening on the port when it is not ``pid`` itself
    but a descendant (``binary`` is a wrapper that forks the real llama-server)."""

    pid: int
    port_pid: int | None = None
    port_comm: str = ""


@dataclass(frozen=True)
class Probe(Input):
    """One liveness round against a ready server.

    ``health_ok``: /health answered 200 in time. ``canary_ok``: a 1-token completion finished
    in time (None when not attempted). ``busy``: a slot is processing. ``progressed``: the
    server's decode counters moved since the previous round.
    """

    pid: int
    health_ok: bool
    canary_ok: bool | None
    busy: bool
    progressed: bool
    detail: str = ""


@dataclass(frozen=True)
class Exited(Input):
    """Server ``pid`` exited: ``returncode`` as from waitpid, negative for a signal."""

    pid: int
    returncode: int | None


@dataclass(frozen=True)
class Tick(Input):
    """Time passed: deadlines (load, backoff, stop, drain, stability) are checked."""


@dataclass(frozen=True)
class StopRequest(Input):
    """SIGTERM/SIGINT: stop the server and exit 0; ``immediate`` (a second signal) kills at once."""

    reason: str
    immediate: bool = False


@dataclass(frozen=True)
class RestartRequest(Input):
    """A graceful (drained) restart: SIGUSR1, ``llama-guard restart``, the schedule, a reload."""

    reason: str
    event: str = "restart_requested"
    drain: bool = True
    config_change: bool = False


@dataclass(frozen=True)
class Drained(Input):
    """No slot of server ``pid`` is processing any more."""

    pid: int


@dataclass(frozen=True)
class ParamsChanged(Input):
    """A reload validated new parameters; ``server_changed`` when llama-server's argv changed."""

    params: Params
    server_changed: bool


# ---------------------------------------------------------------- actions

class Action:
    """Base of every effect :func:`decide` asks for."""


@dataclass(frozen=True)
class Spawn(Action):
    """Start llama-server from the current configuration; answer Spawned or SpawnFailed."""


@dataclass(frozen=True)
class Terminate(Action):
    """SIGTERM to the server's process group."""

    pid: int


@dataclass(frozen=True)
class Kill(Action):
    """SIGKILL to the server's process group."""

    pid: int


@dataclass(frozen=True)
class Emit(Action):
    """Report health event ``name`` (events.CATALOG) with ``fields``."""

    name: str
    fields: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class NotifyReady(Action):
    """Tell the service manager the server is ready (sd_notify READY=1)."""


@dataclass(frozen=True)
class StartDrain(Action):
    """Watch ``/slots`` of ``pid`` and answer Drained once no slot is processing."""

    pid: int


@dataclass(frozen=True)
class ResetGpu(Action):
    """Run the reset sequence (wait for ``previous_pid`` to leave the GPU, check preconditions,
    reset, verify) and answer ResetDone."""

    previous_pid: int | None
    reason: str


@dataclass(frozen=True)
class ExitDaemon(Action):
    """The daemon exits with ``code`` (exitcodes)."""

    code: int
    reason: str


# ---------------------------------------------------------------- state

@dataclass(frozen=True)
class State:
    """Everything the policy remembers; times are monotonic seconds."""

    params: Params = field(default_factory=Params)
    phase: Phase = Phase.STOPPED
    pid: int | None = None
    started_at: float | None = None
    ready_at: float | None = None
    deadline: float | None = None
    after_stop: AfterStop = AfterStop.FAILURE
    exit_code: int = EXIT_OK
    exit_reason: str = ""
    killed: bool = False
    failures: tuple[float, ...] = ()
    next_backoff_s: float = 1.0
    stable: bool = False
    strikes: int = 0
    boot_cause: str = ""
    fault: str = ""             # why the current/last server is being stopped
    pending_event: tuple[str, str] | None = None  # (name, cause) still to report at exit
    last_failure: str = ""
    restarts: int = 0
    resets: tuple[float, ...] = ()
    reset_reason: str = ""
    gpu_lost: bool = False
    reported_limits: frozenset[str] = frozenset()

    def next_deadline(self) -> float | None:
        """When the daemon must send a Tick at the latest (None: no timer is running)."""
        if self.phase is Phase.READY and not self.stable and self.ready_at is not None:
            return self.ready_at + self.params.stable_after_s
        return self.deadline


def initial_state(params: Params) -> State:
    """A STOPPED state with a fresh backoff."""
    return State(params=params, next_backoff_s=params.backoff_initial_s)


def exit_text(returncode: int | None) -> str:
    """Human text for a waitpid status: ``exit status 1``, ``killed by SIGKILL`` …"""
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (likely the kernel's OOM killer, or an operator)" if -returncode == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit status {returncode}"
