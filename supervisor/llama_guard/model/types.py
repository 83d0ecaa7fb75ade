"""The policy's vocabulary: phases, parameters and the state (its inputs are in :mod:`.inputs`, its
actions in :mod:`.actions`).

Kept apart from the transitions (:mod:`llama_guard.model.policy`) so that watchers and the daemon
can speak the policy's language without importing its rules (the model: supervisord's
``states.py``). Everything here is a frozen dataclass or an enum; nothing does I/O.

One module: the State's fields are the policy's memory, each with the one line that says
what it holds; splitting them would hide one from the others.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field, replace

from llama_guard.config.gpu import GpuConfig
from llama_guard.config.listen import FrontConfig
from llama_guard.config.sections import HealthConfig, RecoveryConfig, ScheduleConfig, SlotsConfig, UpgradeConfig
from llama_guard.model.phase_state import PHASE_DATA, IllegalMove, PhaseData, Stopping
from llama_guard.vocab.events import EventName
from llama_guard.vocab.phases import MOVES, Phase
from llama_guard.vocab.triggers import ResetTrigger


class AfterStop(enum.Enum):
    """What happens once the child being stopped has exited."""

    RESTART = "restart"    # planned: start again at once, not a failure
    FAILURE = "failure"    # count a failure, then back off (or give up: crash loop)
    EXIT = "exit"          # the daemon exits (State.exit: its status and why)
    RESET = "reset"        # reset the GPU (for the stop's Stopping.reset_trigger), then start again
    VRAM_CHECK = "vram_check"  # an OOM at load: wait for VRAM if another process holds it, else as RESET/FAILURE
    LEND = "lend"          # lend the GPU to `llama-guard tune` (State.lend), then start again


class GpuFaultKind(enum.Enum):
    """What a :class:`GpuFault` reports."""

    GPU_LOST = "gpu_lost"  # NVML lost the GPU (or the kernel says it fell off the bus)
    XID = "xid"            # an Xid error (NVML event or kernel log)


class XidAction(enum.Enum):
    """What the Xid table (gpu/xid.py, from NVIDIA's Xid documentation) says to do about an Xid."""

    RESTART = "restart"  # app-level fault: restart the server
    RESET = "reset"  # stop the server, reset the GPU
    RESET_ONCE_THEN_ESCALATE = "reset_once_then_escalate"  # try one reset; if it fails, escalate
    FOLLOW_RECOVERY_ACTION = "follow_recovery_action"  # Xid 154: read the recovery action
    REBOOT = "reboot"  # the GPU cannot come back without a reboot: stop, no reset, advise a reboot
    EVENT_ONLY = "event_only"  # report, nothing else


class RecoveryAction(enum.Enum):
    """What the driver says the GPU needs (NVML's ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` field, and
    the text of Xid 154); the values are NVML's ``NVML_GPU_RECOVERY_ACTION_*`` codes."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5
    BUS_RESET = 6
    SYSTEM_REBOOT = 7


class XidScope(enum.Enum):
    """Whom an Xid is about (the Xid table, gpu/xid.py)."""

    APP = "app"        # one application's fault (the process named by the kernel's ``pid=``)
    DEVICE = "device"  # the GPU itself, whoever was running on it


class XidOrigin(enum.Enum):
    """Which report of an Xid the policy judged."""

    NVML = "nvml"                # NVML's event alone (it carries no pid)
    KMSG = "kmsg"                # the kernel-log line (``pid=``, ``name=``)
    NVML_AND_KMSG = "nvml+kmsg"  # NVML's event matched with the kernel-log line of the same Xid


class ResetOutcome(enum.Enum):
    """How a GPU reset ended (the ``outcome`` of the ``gpu_reset`` event)."""

    SUCCEEDED = "succeeded"  # the command ran, exited 0, and the GPU answers and is idle
    SKIPPED = "skipped"      # a precondition failed; nothing was run (the budget is not spent)
    FAILED = "failed"        # the command failed or timed out, or the GPU did not verify
    REFUSED = "refused"      # the reset budget of the window is spent
    TIMED_OUT = "timed out"  # the whole sequence passed its deadline


class RestartCause(enum.Enum):
    """Why the server is restarted: set by the policy when it decides the stop (or counts the
    failure) and carried on ``server_restart`` as ``restart_cause`` (journald ``RESTART_CAUSE``;
    the ``cause`` label of ``llama_guard_restarts_total``). The last four are planned restarts, the
    causes a :class:`RestartRequest` carries; the policy names the request's event from them."""

    CRASH = "crash"                      # the server exited on its own (a signal, an exit status)
    OOM = "oom"                          # out of GPU (or host) memory: an OOM line, an allocation failure
    CUDA_ERROR = "cuda_error"            # a fatal CUDA/GPU error line or an abort after one
    HANG = "hang"                        # liveness: probes failed with no progress, hang_strikes rounds
    COMPLETION_ERROR = "completion_error"  # /health answers but the canary completion answers HTTP 5xx
    LOAD_STALLED = "load_stalled"        # loading showed no progress signal for load_stall_s
    LOAD_TIMEOUT = "load_timeout"        # not ready within load_timeout_s
    GPU_UNAVAILABLE = "gpu_unavailable"  # the server is not on the GPU it must use
    GPU_LOST = "gpu_lost"                # NVML or the kernel lost the GPU
    XID = "xid"                          # an Xid that calls for a restart or a reset
    SPAWN_FAILED = "spawn_failed"        # the start itself failed (a hung model file, before_spawn refused)
    VRAM_WAIT = "vram_wait"              # another process kept the VRAM past vram_wait_timeout_s
    OPERATOR = "requested"               # SIGUSR1, ``llama-guard restart``
    SCHEDULE = "scheduled"               # the cron schedule
    DECAY = "decay"                      # a decay trigger (VRAM/RSS growth, speed drop)
    CONFIG_CHANGE = "reload"             # a reload changed the server's flags
    TRIAL = "trial"                      # a new build's trial failed: back to the last good build
    PORT_TAKEN = "port_taken"            # another process held the server's port (retried within port_wait_s)
    LEND_CANCELLED = "lend_cancelled"    # tune's window was cancelled (its peer gone) once the server's stop began


class TrialStage(enum.Enum):
    """Which build a planned window's trial measures next (:mod:`llama_guard.model.policy.window`)."""

    OLD = "old"  # the serving build, once drained and before its stop
    NEW = "new"  # the new build, once it answers /health and before the front door is released


@dataclass(frozen=True)
class Trial:
    """A planned window's trial of a new llama-server build: decode tokens/s of the old build and of
    the new one, measured the way ``llama-guard bench`` does (the server's own ``timings``, median),
    compared against ``Params.max_slowdown_pct``."""

    stage: TrialStage
    old_tps: float | None = None  # the old build's median decode tokens/s (None: not measured, or it failed)
    old_error: str = ""           # why the old build's figure is missing ("" when measured or not asked)
    spawned: bool = False         # the new build's server was spawned (a second spawn ends the trial)
    answered_at: float | None = None  # when the new build answered /health (its load's end; monotonic s)

    def at_spawn(self) -> Trial | None:
        """The trial as a server is spawned: a NEW stage's first spawn is the new build's; any other
        spawn (a roll-back, a restart after a failure, before the old build was measured) ends it."""
        if self.stage is TrialStage.NEW and not self.spawned:
            return replace(self, spawned=True)
        return None


@dataclass(frozen=True)
class TrialResult:
    """The last trial's outcome (``status``, ``/metrics``, the upgrade events): the two figures in
    decode tokens/s (None: not measured), whether the new build was kept, and the cause of a roll-back."""

    old_tps: float | None
    new_tps: float | None
    kept: bool
    cause: str = ""  # why it was rolled back ("slower: ..."), or why it was kept without a comparison
    max_slowdown_pct: float = 0.0

    @property
    def slowdown_pct(self) -> float | None:
        """How much slower the new build decodes, percent of the old figure (negative: faster)."""
        if self.old_tps is None or self.new_tps is None or self.old_tps <= 0:
            return None
        return (self.old_tps - self.new_tps) / self.old_tps * 100.0
class LendEnd(enum.Enum):
    """How a window lent to ``llama-guard tune`` ended (the ``end`` of ``lend_returned``)."""

    DONE = "done"            # tune returned it after its search (its --apply, if any, written)
    STOPPED = "stopped"      # tune was stopped (Ctrl-C, SIGTERM) and returned it
    FAILED = "failed"        # tune ended with an error and returned it
    EXITED = "exited"        # the tune process ended without returning it (kill -9, a crash): seen by its pidfd
    TIMED_OUT = "timed_out"  # the window's bound passed (tune was sent SIGTERM, then SIGKILL)


@dataclass(frozen=True)
class Lend:
    """A window asked for by, or lent to, ``llama-guard tune``: its process ``pid``, its bound
    (``bound_s`` seconds from the grant), and once granted the monotonic time it ends at the latest
    (``until``); ``asked_to_stop``: the bound passed and tune was sent SIGTERM."""

    pid: int
    bound_s: float
    until: float | None = None
    asked_to_stop: bool = False


@dataclass(frozen=True)
class Exit:
    """The daemon's exit, once decided: its exit status (vocab/exitcodes.py) and why, in words
    (:class:`~llama_guard.model.actions.ExitDaemon`'s reason: ``daemon_exit``'s). Set with
    ``AfterStop.EXIT`` while a drain, stop or reset finishes first, and as the daemon enters EXITED."""

    code: int
    reason: str


@dataclass(frozen=True)
class Failure:
    """Why the current or last server failed, typed: set by the policy where it decides the stop or
    counts the failure (:func:`llama_guard.model.policy.steps.fail`), read by the restart event
    (``restart_cause``), the repeat verdicts (:mod:`llama_guard.model.policy.repeat`), the crash-loop
    and backoff events (``last_failure``) and ``status``."""

    cause: RestartCause = RestartCause.CRASH  # why the next restart happens (a plan sets it too)
    text: str = ""  # the failure in words ("exited: killed by SIGSEGV", "load timeout" …); "" before any
    line: str = ""  # the server's own line that decided it (a fatal GPU line, no GPU); "" when none did


# The policy's defaults are a default configuration's (the config package's section models are the one truth);
# what depends on the host (a watched GPU, its index, a possible reset) defaults to "none".
# [schedule]'s defaults unvalidated: its default cron is parsed (APScheduler loaded) only where a
# configuration uses it.
_HEALTH, _GPU, _RECOVERY, _FRONT = HealthConfig(), GpuConfig(), RecoveryConfig(), FrontConfig()
_SCHEDULE = ScheduleConfig.model_construct()
_SLOTS = SlotsConfig()
_UPGRADE = UpgradeConfig()


#: Seconds added to a reset's waits for the command's own checks (see :func:`reset_deadline_s`).
RESET_DEADLINE_MARGIN_S = 30.0


def reset_deadline_s(recovery: RecoveryConfig, gpu: GpuConfig) -> float:
    """How long one GPU reset may take in all, seconds: the reset command, the VRAM release, the
    wait for other processes to leave, the server's stop, and :data:`RESET_DEADLINE_MARGIN_S`."""
    # The command may run twice (once more with persistence mode off): its own timeout must fire
    # before this deadline, so that a stop waiting for it never outlasts it.
    runs = 2 if recovery.reset_toggles_persistence else 1
    return (recovery.reset_timeout_s * runs + gpu.vram_release_timeout_s + recovery.foreign_wait_s
            + recovery.stop_grace_s + RESET_DEADLINE_MARGIN_S)


@dataclass(frozen=True)
class Params:
    """The policy's knobs (from ``[health]``, ``[recovery]``, ``[gpu]`` and ``[schedule]``), in
    seconds; the defaults are those of the configuration's defaults. A key marked
    :class:`~llama_guard.config.base.Policy` in its section's model fills the field of its name
    (:func:`llama_guard.model.params.params_from`); a new policy setting is that key plus its field here."""

    load_timeout_s: float = _HEALTH.load_timeout_s
    hang_strikes: int = _HEALTH.hang_strikes
    backoff_initial_s: float = _RECOVERY.backoff_initial_s
    backoff_factor: float = _RECOVERY.backoff_factor
    backoff_max_s: float = _RECOVERY.backoff_max_s
    max_restarts: int = _RECOVERY.max_restarts
    restart_window_s: float = _RECOVERY.restart_window_s
    stable_after_s: float = _RECOVERY.stable_after_s
    stop_grace_s: float = _RECOVERY.stop_grace_s
    kill_wait_s: float = 10.0  # after SIGKILL, how long to wait for the exit (not configurable)
    exit_drain_s: float = 0.0  # s a stop drains first: [front].stop_drain_s with the front door on, else 0
    # s the slots may take to be saved before the stop for a GPU reset of a healthy server:
    # [slots].reset_save_timeout_s with the carry-over on, else 0 (no save)
    reset_save_s: float = _SLOTS.reset_save_timeout_s
    drain_timeout_s: float = _SCHEDULE.drain_timeout_s
    require_gpu: bool = False
    reset_possible: bool = False
    reset_on: frozenset[ResetTrigger] = frozenset(_RECOVERY.reset_on)
    max_resets: int = _RECOVERY.max_resets
    reset_window_s: float = _RECOVERY.reset_window_s
    reset_deadline_s: float = reset_deadline_s(_RECOVERY, _GPU)
    # The steps of a reset, for the event that announces it: [gpu].vram_release_timeout_s,
    # [recovery].foreign_wait_s, reset_timeout_s and whether the command may run twice
    # (reset_toggles_persistence). reset_deadline_s bounds them all.
    vram_release_s: float = _GPU.vram_release_timeout_s
    foreign_wait_s: float = _RECOVERY.foreign_wait_s
    reset_timeout_s: float = _RECOVERY.reset_timeout_s
    reset_retry: bool = _RECOVERY.reset_toggles_persistence
    gpu_index: int | None = None  # [gpu].index, named in reset events until NVML has said which
    vram_admission: bool = False  # the GPU is watched: check its free VRAM before each start
    vram_wait_timeout_s: float = _GPU.vram_wait_timeout_s  # how long to wait for another process to free VRAM
    vram_poll_s: float = 1.0  # how often VRAM is looked at again while waiting (not configurable)
    # A start with no progress signal (line, CPU time, HTTP answer) for this long is stalled; 0: off.
    load_stall_s: float = _HEALTH.load_stall_s
    # CPU seconds of the server's process tree within one liveness round that count as progress.
    progress_cpu_s: float = _HEALTH.progress_cpu_s
    model_path: str = ""  # [server].model, named in a boot failure about the model file
    offload_layers: int = 0  # [server].n_gpu_layers: layers llama-server is asked to put on a GPU
    # The same failure on this many consecutive starts (before ready, or before stable_after_s) is
    # a verdict (exit 78) instead of a restart (model/policy/repeat.py).
    identical_failures: int = 3
    # ... and the confirming start waits until this long after the chain's first failure, seconds.
    repeat_confirm_s: float = _RECOVERY.repeat_confirm_s
    port: int = 8080            # [server].port
    port_wait_s: float = _RECOVERY.port_wait_s  # a port taken by another process is retried this long, then exit 78
    port_retry_s: float = 2.0   # ... every this many seconds
    silent_limit_s: float = _HEALTH.silent_limit_s  # no HTTP answer this long: hung, whatever the CPU does
    # 5xx client answers in a row (no request completed between) that are reported and, with the canary on,
    # hold new requests while a liveness round confirms ([front].hold_after_errors; 0: off).
    hold_after_errors: int = _FRONT.hold_after_errors
    canary: bool = _HEALTH.canary  # [health].canary: the liveness rounds may send the canary completion
    # A planned window that changes the build measures both ([upgrade]): completions per build (0: no
    # trial), tokens each, how much slower (percent of the old figure) the new build may decode, and the
    # bound on one build's measurement (seconds: what /readyz's Retry-After counts for it).
    trial_runs: int = _UPGRADE.trial_runs
    trial_tokens: int = _UPGRADE.trial_tokens
    max_slowdown_pct: float = _UPGRADE.max_slowdown_pct
    trial_timeout_s: float = _UPGRADE.trial_timeout_s


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
    exit: Exit | None = None  # the daemon's exit once decided (with AfterStop.EXIT, and in EXITED); None: none
    # The current phase's own state (:data:`PHASE_DATA`): set as the phase is entered, gone when it is left.
    phase_data: PhaseData = None
    killed: bool = False
    grace_s: float = 0.0         # the stop under way: seconds between its SIGTERM and its SIGKILL
    saving: bool = False        # STOPPING: the slots are being saved before SIGTERM (``deadline`` bounds it)
    failures: tuple[tuple[float, int | None], ...] = ()  # (when, server pid) of the failures counted in the window
    next_backoff_s: float = 1.0
    stable: bool = False
    strikes: int = 0
    pending_event: tuple[EventName, str] | None = None  # (name, cause) still to report at exit
    failure: Failure = field(default_factory=Failure)  # why the last server failed, why the next restart happens
    restarts: int = 0
    resets: tuple[float, ...] = ()
    gpu_lost: bool = False
    reported_limits: frozenset[str] = frozenset()
    on_cpu_reported: bool = False  # server_on_cpu was reported for the current server
    gpu_index: int | None = None  # the GPU a reset acts on, as the last ResetFacts named it
    last_progress_at: float | None = None  # the last progress signal of a loading server
    alloc_failure: str = ""     # an allocation failure line not yet judged (recovered or fatal)
    last_error: str = ""        # the last error/abort line of the current server
    boot_signature: str = ""    # how the previous failed start ended, if it says something about the binary
    identical: int = 0          # how many consecutive starts ended that way
    identical_since: float = 0.0  # when the first of them failed (monotonic seconds)
    last_line: str = ""         # the last line the failed server printed (Exited)
    exit_signal: int | None = None  # the signal that ended the last server (None: it exited, or not yet)
    fault_signals: frozenset[int] = frozenset()  # CPU-fault signals (SIGILL, SIGSEGV …) of the current chain
    build: str = ""             # the binary's `--version` (BuildInfo), named in verdicts
    port_taken: bool = False    # the current server said its port is taken
    port_taken_since: float | None = None  # since when starts find the port taken (None: it was free)
    port_holder: tuple[int | None, str] | None = None  # (pid, name) holding it, as last found
    watchdog_hits: tuple[float, ...] = ()  # when a launch-watchdog timeout stopped a server (window)
    crashes: tuple[tuple[float, str], ...] = ()  # (when, signature) of crashes after ready (window)
    last_request_at: float | None = None  # when the front door last saw a request completed (progress)
    stalls: int = 0             # stalled streams since the last progress of the current server
    http_errors: int = 0        # 5xx answers in a row (no 2xx in between) from the current server
    # An operator's restart asked for while the server loads (or restores its slots): (cause, reason), carried
    # out once it is ready; a new spawn meanwhile (a crash, changed flags) fulfils it (None: none asked).
    deferred_restart: tuple[RestartCause, str] | None = None
    # When the last serving server stopped serving (its stop began, or its exit was seen): the start
    # of the restart that server_ready's restart_to_ready_s and restart_first_token time (None: the
    # first start, or the restart's first token was reported).
    restart_at: float | None = None
    # The last server's load: seconds from its spawn to its /health answer (its slots restored), as
    # server_ready's load_s (None: no server was ready yet); /readyz's Retry-After estimates the next load by it.
    load_s: float | None = None
    trial: Trial | None = None  # a planned window's trial of a new build under way (None: none)
    last_trial: TrialResult | None = None  # how the last trial ended (None: none yet)
    # TRIAL of a new build: the (pid, name) its HealthOk named as the port's owner, for server_ready
    ready_owner: tuple[int | None, str] | None = None
    # The window asked for by or lent to `llama-guard tune` (None: none): pending while the server
    # drains and stops for it (``until`` None), granted in LENT.
    lend: Lend | None = None

    def __post_init__(self) -> None:
        held = self.phase_data
        if held is not None and PHASE_DATA.get(self.phase) is not type(held):
            raise IllegalMove(f"{self.phase.value} cannot hold {type(held).__name__}: a phase's own state "
                              "is set as it is entered and dropped when it is left")

    @property
    def stopping(self) -> Stopping | None:
        """DRAINING's, STOPPING's (or TRIAL's) own state; None in any other phase."""
        return self.phase_data if isinstance(self.phase_data, Stopping) else None

    @property
    def stop_reason(self) -> str:
        """Why the server is being stopped (DRAINING, STOPPING; TRIAL before the old build's stop), in
        words; "" in any other phase."""
        return self.phase_data.reason if isinstance(self.phase_data, Stopping) else ""

    def request_completed_since(self, since: float) -> bool:
        """Whether the front door saw a client request completed at or after monotonic ``since``
        (the liveness rounds send no canary then: real traffic already showed progress)."""
        return self.last_request_at is not None and self.last_request_at >= since

    @property
    def confirming(self) -> bool:
        """The front door saw ``hold_after_errors`` 5xx answers in a row from the ready server: it holds
        new requests until a liveness round confirms (a failing canary: a verdict) or clears it."""
        runs = self.params.hold_after_errors
        return (self.params.canary and runs > 0 and self.http_errors >= runs
                and self.phase is Phase.READY and self.pid is not None)

    def next_deadline(self) -> float | None:
        """When the daemon must send a Tick at the latest (None: no timer is running)."""
        if self.phase is Phase.READY and not self.stable and self.ready_at is not None:
            return self.ready_at + self.params.stable_after_s
        if (self.phase is Phase.STARTING and self.last_progress_at is not None
                and self.params.load_stall_s > 0):
            stall = self.last_progress_at + self.params.load_stall_s
            return stall if self.deadline is None else min(stall, self.deadline)
        return self.deadline


def initial_state(params: Params) -> State:
    """A STOPPED state with a fresh backoff."""
    return State(params=params, next_backoff_s=params.backoff_initial_s)


def exit_signal(returncode: int | None) -> int | None:
    """The signal number in a waitpid status (``-11`` → 11), None for an exit or an unknown status."""
    return -returncode if returncode is not None and returncode < 0 else None


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


def enter(state: State, to: Phase) -> Phase:
    """``to``, once :data:`~llama_guard.vocab.phases.MOVES` allows ``state.phase`` → ``to``; every
    phase change of the policy goes through it (``replace(state, phase=enter(state, Phase.X),
    phase_data=…, …)``: the new phase's own state, :data:`PHASE_DATA`, or None). Raises
    :class:`IllegalMove` otherwise."""
    if to not in MOVES[state.phase]:
        raise IllegalMove(f"{state.phase.value} -> {to.value} is not in the phase table")
    return to
