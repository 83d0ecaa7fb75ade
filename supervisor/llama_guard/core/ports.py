"""The daemon's ports besides the GPU's (:mod:`.gpu_port`): what the daemon and one server's tasks
ask of a watcher, each handed to the daemon by name (one or none), never searched for among the
watchers.

- :class:`ChildSetupPort`: the child set-up of each start (the limits watcher): a bounded check
  before the spawn and the rlimits set between fork and exec.
- :class:`SlotPort`: the KV cache carried across restarts (the slots watcher): the slot store made
  ready before each spawn, the slots restored and verified once the server answers ``/health``,
  saved after a planned restart's drain.
- :class:`Listening` and :class:`FrontPort`: what this daemon itself serves on (the front door, the
  metrics exporter: the reload's port-clash check); the front door's count of requests in flight
  (the drain).
- :class:`BuildPort`: llama-server builds (the upgrade watcher): a reload's new build preflighted
  before it replaces the running configuration, and which executable each start runs (the
  configured one once it passed preflight, or the last good build), and a build's decode speed
  measured for a planned window's trial.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llama_guard.config import Config
from llama_guard.model.inputs import SpeedMeasured
from llama_guard.model.watcher import Context

RlimitSettings = tuple[tuple[int, tuple[int, int]], ...]
"""``(resource, (soft, hard))`` pairs: ``resource`` a ``resource.RLIMIT_*`` number, limits in that
resource's unit (bytes, count), ``resource.RLIM_INFINITY`` for unlimited."""


class ChildSetupPort(Protocol):
    """The child set-up as the spawner uses it (:class:`llama_guard.limits.watcher.LimitsSource`)."""

    async def before_spawn(self, ctx: Context, previous_pid: int | None) -> str | None:
        """Bounded preparation before each spawn (the plan of the child's limits); a reason to
        refuse this start (retried after backoff), else None."""

    def child_rlimits(self) -> RlimitSettings:
        """The rlimits to set on the next llama-server before its exec (by the parent, with
        prlimit(2): :class:`llama_guard.core.child.ChildSetup`); empty for none."""


class SlotPort(Protocol):
    """The KV slot carry-over as the daemon uses it (:class:`llama_guard.slots.watcher.SlotsSource`).
    None of its steps refuses a start: llama-server serves without the carry-over."""

    async def before_spawn(self, ctx: Context, binary: Path, env: Mapping[str, str]) -> None:
        """Before each spawn: the slot store for the configuration the server is started from, and the
        build it runs (``binary``, the executable started — a kept copy too — and its environment ``env``)."""

    async def restore(self, ctx: Context, pid: int) -> None:
        """After ``/health`` 200 of server ``pid`` (and the GPU's ready check), before it is called
        ready while clients are held: restore and verify the saved slots, within
        ``[slots].restore_timeout_s``."""

    async def after_drain(self, ctx: Context, pid: int) -> None:
        """A planned restart drained server ``pid`` (no slot processing, clients held): save its
        changed slots, within ``[slots].save_timeout_s``; the server is stopped when this returns."""

    async def before_reset_stop(self, ctx: Context, pid: int) -> None:
        """Server ``pid`` is about to be stopped for a GPU reset while it can still answer (the policy
        asked, :class:`~llama_guard.model.actions.SaveSlots`): save its changed idle slots; the server is
        stopped when this returns, or when the policy's bound (``[slots].reset_save_timeout_s``) passed."""


class Listening(Protocol):
    """A listener of this daemon (the front door, the metrics exporter)."""

    @property
    def listening(self) -> tuple[str, int] | None:
        """The ``(host, port)`` it serves on once started; None while it serves nothing."""


class FrontPort(Listening, Protocol):
    """The front door as the daemon uses it (:class:`llama_guard.front.source.FrontSource`)."""

    async def wait_requests_done(self) -> bool:
        """When the front door is on (it sees every client request): wait until none is in flight,
        then return True. Off: return False at once (the drain asks llama-server's ``/slots``)."""


class ReloadBuild(enum.Enum):
    """What a reload's llama-server build is to the running one (:meth:`BuildPort.vet_reload`)."""

    SAME = "same"  # the serving build (flags preflighted when [server] changed)
    NEW = "new"  # another build that passed preflight: the server is restarted on it (drained)
    REFUSED = "refused"  # it failed preflight: the running configuration stays


@dataclass(frozen=True)
class BuildChoice:
    """The executable a start runs, and the directory of its shared libraries when they are not
    where it was built (a kept copy: put first on ``LD_LIBRARY_PATH``)."""

    binary: Path
    library_dir: Path | None = None


@dataclass(frozen=True)
class BuildRefused:
    """No build can be started: the configured one failed and no last good build is at hand."""

    cause: str


class BuildPort(Protocol):
    """llama-server builds as the daemon uses them (:class:`llama_guard.upgrade.watcher.UpgradeSource`)."""

    async def vet_reload(self, old: Config, new: Config) -> ReloadBuild:
        """Whether ``new`` may replace ``old``: its build (the path, or new content at the path) and
        flags preflighted (bounded) while the running server serves; a refusal is reported by the port."""

    async def before_spawn(self, ctx: Context, binary: Path) -> BuildChoice | BuildRefused:
        """Which executable this start runs, ``binary`` being the configured one (bounded)."""

    async def measure_speed(self, ctx: Context, pid: int, runs: int, tokens: int) -> SpeedMeasured:
        """Server ``pid``'s decode speed for a trial (:class:`~llama_guard.model.actions.MeasureSpeed`),
        bounded by ``[upgrade].trial_timeout_s``; a failure is the answer's ``error``, never raised."""
