"""The supervisor's phases: where the policy stands with the one llama-server it owns (``status``,
``llama_guard_phase``, the front door's gate). The policy's state machine moves between them
(:mod:`llama_guard.core.policy`); everyone else reads them."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    RESETTING = "resetting_gpu"
    EXITED = "exited"
    WAITING_VRAM = "waiting_for_vram"  # another process holds the VRAM this server needs
