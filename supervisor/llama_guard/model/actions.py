"""The policy's actions: every effect :func:`llama_guard.model.policy.decide` asks the daemon to
carry out (frozen dataclasses; nothing here does I/O).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llama_guard.vocab.events import EventName


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

    name: EventName
    fields: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class NotifyReady(Action):
    """Tell the service manager the server is ready (sd_notify READY=1)."""


@dataclass(frozen=True)
class StartDrain(Action):
    """Answer Drained once no client request to ``pid`` is in flight (the front door's count when it
    is on, else ``/slots``: no slot processing)."""

    pid: int


@dataclass(frozen=True)
class ConfirmCompletions(Action):
    """Run a liveness round on server ``pid`` now, its canary sent whatever the traffic since the
    previous round (on any idle slot when every one holds a conversation), and answer its
    :class:`~llama_guard.model.inputs.Probe` with ``confirm`` set: the front door saw a run of 5xx answers and
    holds new requests meanwhile."""

    pid: int


@dataclass(frozen=True)
class SaveSlots(Action):
    """Save the changed idle slots of server ``pid`` before it is stopped for a GPU reset (bounded:
    ``Params.reset_save_s``); answer :class:`SlotsSaved`. Slots that are processing are left alone."""

    pid: int


@dataclass(frozen=True)
class MeasureSpeed(Action):
    """Measure server ``pid``'s decode speed as ``llama-guard bench`` does: one warm-up, then ``runs``
    completions of ``tokens`` generated tokens each, straight to llama-server (the front door holds
    the clients meanwhile); answer :class:`~llama_guard.model.inputs.SpeedMeasured` (bounded by
    ``[upgrade].trial_timeout_s``)."""

    pid: int
    runs: int
    tokens: int


@dataclass(frozen=True)
class ReadBuild(Action):
    """Run ``llama-server --version`` (bounded, off the loop); answer :class:`BuildInfo`. Asked only
    when a verdict that names the build may follow (a binary is not run for nothing)."""


@dataclass(frozen=True)
class FindPortHolder(Action):
    """Find the process listening on TCP ``port`` (from /proc); answer :class:`PortHolder`."""

    port: int


@dataclass(frozen=True)
class CheckVram(Action):
    """Read the GPU's free VRAM and who holds it (one NVML sample); answer :class:`VramFacts`."""


@dataclass(frozen=True)
class InspectGpu(Action):
    """Before a reset: wait (bounded) for ``previous_pid`` to leave the GPU and for other
    processes to let go, then answer :class:`ResetFacts`. Nothing is changed on the GPU."""

    previous_pid: int | None
    reason: str


@dataclass(frozen=True)
class RunReset(Action):
    """Run the reset command on GPU ``gpu_index`` (our NVML session released meanwhile), verify
    the GPU, and answer :class:`ResetDone`."""

    gpu_index: int | None
    reason: str


@dataclass(frozen=True)
class ExitDaemon(Action):
    """The daemon exits with ``code`` (exitcodes)."""

    code: int
    reason: str




@dataclass(frozen=True)
class AnswerLend(Action):
    """Answer tune ``pid`` on its window channel: ``granted`` (llama-server is stopped, its slots
    saved; the window lasts at most ``bound_s``), else refused with ``reason``."""

    pid: int
    granted: bool
    reason: str = ""
    bound_s: float = 0.0


@dataclass(frozen=True)
class SignalTune(Action):
    """Send ``signal`` (a ``signal.Signals`` number) to tune ``pid`` through its pidfd (the window channel):
    its window's bound passed."""

    pid: int
    signal: int
