"""The policy's inputs: every observation the daemon and the watchers feed to
:func:`llama_guard.model.policy.decide` (frozen dataclasses; nothing here does I/O).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llama_guard.model.server_log import LineClass
from llama_guard.model.types import (
    GpuFaultKind,
    LendEnd,
    Params,
    RecoveryAction,
    RestartCause,
    XidAction,
    XidOrigin,
    XidScope,
)


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
    """The GPU is lost (``kind`` GPU_LOST) or reported an Xid (``kind`` XID).

    ``action`` and ``scope`` are the Xid table's row; a lost GPU is RESET_ONCE_THEN_ESCALATE.
    The policy acts on an APP-scope Xid only when ``faulting_pid`` is its server.
    """

    kind: GpuFaultKind
    reason: str
    action: XidAction = XidAction.RESET_ONCE_THEN_ESCALATE
    xid: int | None = None
    scope: XidScope = XidScope.DEVICE
    faulting_pid: int | None = None   # the kernel's ``pid=`` (None: NVML alone, or not named)
    faulting_name: str | None = None  # the kernel's ``name=``
    origin: XidOrigin = XidOrigin.NVML
    gpu_index: int | None = None
    line: str = ""                    # the kernel-log text, when there is one
    # Xid 154 (FOLLOW_RECOVERY_ACTION): what the driver asks for, from the kernel line or NVML's
    # recovery-action field (None: neither said).
    recovery: RecoveryAction | None = None
    watchdog: bool = False  # the Xid is a channel watchdog timeout (the Xid table says so)
    kv_readable: bool = False  # the GPU still answers, its memory intact: the slots may be saved (the Xid table)


@dataclass(frozen=True)
class GpuHolder:
    """A process other than our server holding memory on the GPU: ``pid``, its VRAM in MiB
    (None when NVML does not say), its name ("?" when unreadable)."""

    pid: int
    used_mib: int | None
    name: str


@dataclass(frozen=True)
class ResetFacts(Input):
    """The answer to :class:`InspectGpu`: what stands between us and a GPU reset (facts only; the
    policy decides to skip, run, refuse or escalate).

    ``gpu_index``: NVML's index of the GPU (None when unknown). ``previous_released``: the server
    that was stopped has left the GPU (True when there was none), after ``waited_s`` seconds.
    ``holders``: other processes still on the GPU after ``[recovery].foreign_wait_s``.
    ``can_run``: the reset command can run under our credentials; ``cannot_run`` says why not.
    """

    gpu_index: int | None
    previous_released: bool
    waited_s: float
    holders: tuple[GpuHolder, ...]
    can_run: bool
    cannot_run: str = ""


@dataclass(frozen=True)
class ResetDone(Input):
    """The answer to :class:`RunReset`: what the reset command did (facts; the policy judges).

    ``exit_status`` None when it could not be started or was killed at its timeout;
    ``output`` what it printed (one line, trimmed); ``verified``: afterwards NVML answers and no
    process holds the GPU; ``detail`` one line saying all that; ``fields`` extra event fields.
    """

    gpu_index: int | None
    command: str
    exit_status: int | None
    output: str
    verified: bool
    detail: str
    fields: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """The command exited 0 and the GPU verified."""
        return self.exit_status == 0 and self.verified


@dataclass(frozen=True)
class VramFacts(Input):
    """The answer to :class:`CheckVram`: the GPU's free VRAM (MiB), what this server needs (MiB:
    its measured use at the last good start, else ``[gpu].expected_vram_mib``; None when unknown)
    and the other processes holding VRAM. All None/empty when the GPU cannot be read; ``error``
    says why when the check failed or did not answer within its deadline (then already reported
    as ``gpu_vram_check_failed``)."""

    gpu_index: int | None
    free_mib: int | None
    need_mib: int | None
    holders: tuple[GpuHolder, ...] = ()
    error: str = ""
    # NVML's recovery-action field read with the sample (None: not readable on this driver/GPU).
    recovery: RecoveryAction | None = None


@dataclass(frozen=True)
class Line(Input):
    """One classified line of the server's stdout/stderr."""

    pid: int
    verdict: LineClass
    text: str


@dataclass(frozen=True)
class PortHolder(Input):
    """The answer to :class:`FindPortHolder`: who listens on TCP ``port`` — ``pid`` (None: nobody
    any more, or it cannot be told) and its process ``name`` ("" when unknown)."""

    port: int
    pid: int | None
    name: str = ""


@dataclass(frozen=True)
class BuildInfo(Input):
    """The answer to :class:`ReadBuild`: what ``llama-server --version`` printed (one line; an
    explanation when it could not be read)."""

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
    server's decode counters moved since the previous round. The progress signals that do not
    depend on the server's HTTP loop: ``cpu_s``, CPU seconds (user + system) its process tree
    used since the previous round (None: unknown); ``lines``, output lines it printed since then;
    ``gpu_busy``, whether a GPU watcher saw this pid use the GPU (None: no watcher says).
    A probe that timed out is unknown, not stuck: only a round without an answer *and* without
    progress counts against the server — except that ``silent_s``, the seconds since the server
    last answered any HTTP request, is bounded (``Params.silent_limit_s``) whatever the progress
    signals say, and a canary the server answered with an error (``canary_status``, the HTTP
    status, with the server's message ``canary_error``) is a failure, not an unknown. ``loop_ok``:
    the server's main loop answered a task (``/metrics``) this round. ``confirm``: the round asked by
    :class:`~llama_guard.model.actions.ConfirmCompletions` (its canary sent whatever the traffic).
    """

    pid: int
    health_ok: bool
    canary_ok: bool | None
    busy: bool
    progressed: bool
    detail: str = ""
    cpu_s: float | None = None
    lines: int = 0
    gpu_busy: bool | None = None
    silent_s: float = 0.0
    canary_status: int | None = None
    canary_error: str = ""
    loop_ok: bool = True
    confirm: bool = False


@dataclass(frozen=True)
class LoadProgress(Input):
    """While server ``pid`` loads, a progress signal moved: ``signals`` names which ("lines",
    "cpu", "http" for any answer of /health, 503 included)."""

    pid: int
    signals: tuple[str, ...] = ()


@dataclass(frozen=True)
class Exited(Input):
    """Server ``pid`` exited: ``returncode`` as from waitpid, negative for a signal; ``last_line``
    the last line it printed ("" when none), which names a load that stalled after it."""

    pid: int
    returncode: int | None
    last_line: str = ""


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
    """A graceful (drained) restart: SIGUSR1, ``llama-guard restart``, the schedule, a decay
    trigger, a reload (``cause``; the policy names the event after it)."""

    reason: str
    cause: RestartCause = RestartCause.OPERATOR
    drain: bool = True


@dataclass(frozen=True)
class Drained(Input):
    """No slot of server ``pid`` is processing any more."""

    pid: int


@dataclass(frozen=True)
class SlotsSaved(Input):
    """The saves asked for by :class:`~llama_guard.model.actions.SaveSlots` for server ``pid`` ended
    (saved, failed or nothing to save: the slots watcher reported each)."""

    pid: int


@dataclass(frozen=True)
class ParamsChanged(Input):
    """A reload validated new parameters; ``server_changed`` when llama-server's argv changed,
    ``new_build`` when it names another llama-server build that passed preflight (the drained
    restart is a trial: :mod:`llama_guard.model.policy.window`)."""

    params: Params
    server_changed: bool
    new_build: bool = False


@dataclass(frozen=True)
class TrialAsked(Input):
    """The start under way runs a build found replaced since the last good one served (no old server
    to measure): measure it once it answers ``/health`` and compare with ``tokens_per_s``, the last good
    build's decode tokens/s recorded at its last trial on this box (the build port's figures)."""

    tokens_per_s: float


@dataclass(frozen=True)
class SpeedMeasured(Input):
    """Server ``pid``'s decode speed as :class:`~llama_guard.model.actions.MeasureSpeed` asked: the median
    of the server's own ``predicted_per_second`` in tokens/s, or None with ``error`` saying why (a
    completion failed, the measurement ran out of time)."""

    pid: int
    tokens_per_s: float | None
    error: str = ""


@dataclass(frozen=True)
class RequestCompleted(Input):
    """The front door saw a client's generation or embedding answered in full by server ``pid``, and
    the answer's own token counts (or vectors) prove the server decoded: real traffic, the first
    liveness signal (progress). Other answers (``/health``, ``/props``, any 2xx without tokens) are
    never this (``llama_guard.front.decoded``)."""

    pid: int


@dataclass(frozen=True)
class FirstToken(Input):
    """A client request the front door held while no server served got the first byte of a 2xx answer
    from server ``pid`` (for a stream: its first token)."""

    pid: int


@dataclass(frozen=True)
class StreamStalled(Input):
    """A response from server ``pid`` had begun and then got no event for ``stalled_s`` seconds
    (``[front].stall_timeout_s``), or was taken by a slot and sent no first event within
    ``[front].first_event_timeout_s``: a decode (or prefill) that stopped under a client."""

    pid: int
    stalled_s: float


@dataclass(frozen=True)
class UpstreamError(Input):
    """Server ``pid`` answered a client request with HTTP ``status`` (5xx)."""

    pid: int
    status: int


@dataclass(frozen=True)
class CrashesCharged(Input):
    """The front door charged a client request (its fingerprint) with the crashes of servers ``pids``
    (it was the one suspect sent to the last of them, and in flight at the others) and refuses it from
    now on: those crashes are that request's doing, not the server's, the build's nor the
    configuration's (:mod:`llama_guard.core.suspects`)."""

    pids: tuple[int, ...]


@dataclass(frozen=True)
class LendAsked(Input):
    """``llama-guard tune`` (process ``pid``, named by the kernel: the socket's peer credentials) asks
    for the GPU for at most ``bound_s`` seconds (its ``--minutes`` plus a margin)."""

    pid: int
    bound_s: float


@dataclass(frozen=True)
class LendReturned(Input):
    """The window of tune ``pid`` ended (``end``: it returned it, or its process ended), seen before
    or after the grant. A configuration file changed meanwhile (``--apply``) was reloaded first.
    ``detail``: how the channel saw it end ("" when by tune's own end line)."""

    pid: int
    end: LendEnd
    detail: str = ""
