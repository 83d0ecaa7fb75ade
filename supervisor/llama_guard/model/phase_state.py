"""Each phase's own state: what only means something in one phase of the policy (the boot cause of a
start, the reason and reset trigger of a stop, the VRAM wait, the trigger of a GPU reset), held in
``State.phase_data`` (:mod:`llama_guard.model.types`) — set as the phase is entered, dropped when it
is left; a State holding another phase's data is refused (:class:`IllegalMove`). Frozen dataclasses;
their text is a human message carried as data (the events' ``reason`` and ``trigger``), never a
control field. docs/phases.md prints which phase holds what.
"""

from __future__ import annotations

from dataclasses import dataclass

from llama_guard.vocab.phases import Phase


class IllegalMove(Exception):
    """A phase change the phase table (:data:`~llama_guard.vocab.phases.MOVES`) does not allow, or a
    phase holding another phase's own state (:data:`PHASE_DATA`): a bug in the policy, never an
    input's fault."""


@dataclass(frozen=True)
class Starting:
    """STARTING's own state: what the loading server's lines said about its configuration so far."""

    # The first configuration cause a line named (a boot-configuration line; a resource limit but
    # RLIMIT_MEMLOCK), in the server's words: the cause of server_boot_failure should the start end
    # ("": none yet).
    boot_cause: str = ""


@dataclass(frozen=True)
class Stopping:
    """DRAINING's and STOPPING's own state (TRIAL's too while the drained old build is measured
    before its stop): why the server is being stopped, and the fault a GPU reset after it is for."""

    reason: str  # in words: server_stopped's, server_restart's and drain_timeout's ``reason``
    # With AfterStop.RESET or VRAM_CHECK: the fault the reset after the stop is for (gpu_reset's
    # ``trigger``), in words; "" when no reset may follow.
    reset_trigger: str = ""


@dataclass(frozen=True)
class WaitingVram:
    """WAITING_VRAM's own state: the VRAM check before a start, and the wait while another process holds
    VRAM the server needs."""

    # The OOM at load this start follows, in words: unless another process holds the VRAM it goes on as
    # it would have without the check (a reset for it: gpu_reset's ``trigger``; or a failure). "": a
    # plain start.
    after_oom: str = ""
    until: float | None = None  # when the wait gives up (monotonic s; None: not waiting)
    short: str = ""  # who holds what is missing, from the latest facts (the VRAM wait's failure names it)
    facts_at: float | None = None  # when ``short`` was read (monotonic s)


@dataclass(frozen=True)
class Resetting:
    """RESETTING's own state."""

    trigger: str  # the fault the reset is for, in words (gpu_reset_started's and gpu_reset's ``trigger``)
    command_at: float | None = None  # when the reset command was started (monotonic s; None: not yet)


#: A phase's own state: what only means something in that phase, dropped when it is left.
PhaseData = Starting | Stopping | WaitingVram | Resetting | None

#: Which phase may hold which own state (any other holds none); :class:`State` refuses anything else.
PHASE_DATA: dict[Phase, type[Starting | Stopping | WaitingVram | Resetting]] = {
    Phase.STARTING: Starting,
    Phase.DRAINING: Stopping,
    Phase.STOPPING: Stopping,
    Phase.TRIAL: Stopping,
    Phase.WAITING_VRAM: WaitingVram,
    Phase.RESETTING: Resetting,
}

__all__ = ["PHASE_DATA", "IllegalMove", "PhaseData", "Resetting", "Starting", "Stopping", "WaitingVram"]
