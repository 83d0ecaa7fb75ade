"""One step of the daemon's loop, as the loop publishes it to its observers.

The loop feeds one input to :func:`llama_guard.model.policy.decide` and hands every observer the
frozen record of that step (the model: supervisord's ``change_state``, which sets the state *and*
notifies): the state before and after, the input, the actions asked for and the monotonic time.
Observers (the front door, the metrics, the planned-restart record) follow the records instead of
re-reading the state or watching actions made for them alone. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from llama_guard.model.actions import Action
from llama_guard.model.inputs import Drained, Input
from llama_guard.model.types import AfterStop, State
from llama_guard.vocab.phases import Phase


@dataclass(frozen=True)
class Transition:
    """One decision: ``before`` --``input``--> ``after``, asking for ``actions`` (in the order the
    loop carries them out), at ``at`` (monotonic seconds, the ``now`` the policy was given)."""

    before: State
    after: State
    input: Input
    actions: tuple[Action, ...]
    at: float

    def entered(self, phase: Phase) -> bool:
        """Whether this step moved the policy into ``phase`` (from another phase)."""
        return self.after.phase is phase and self.before.phase is not phase

    @property
    def restart_begins(self) -> bool:
        """Whether a planned restart begins with this step: the server that served (or loaded) is
        drained, or stopped at once, to start again. Its cause is ``after.failure.cause``, its
        reason ``after.stop_reason``."""
        drains_to_restart = self.entered(Phase.DRAINING) and self.after.after_stop is AfterStop.RESTART
        return self.before.phase in (Phase.READY, Phase.STARTING) and (drains_to_restart or self._stops_to_restart)

    @property
    def _stops_to_restart(self) -> bool:
        return self.entered(Phase.STOPPING) and self.after.after_stop is AfterStop.RESTART

    @property
    def planned_stop(self) -> bool:
        """Whether this step begins stopping a server (known pid) for a planned restart: after its
        drain (:attr:`drained`), at the drain's timeout, or at once."""
        return self._stops_to_restart and self.before.pid is not None

    @property
    def drained(self) -> bool:
        """Whether the server stopped by this step had gone idle first: its drain answered now, or it
        did before the trial that measured it (TRIAL is entered from a drain that answered)."""
        return isinstance(self.input, Drained) or self.before.phase is Phase.TRIAL
