"""The daemon's own sections: ``[health]`` (probes), ``[recovery]`` (restarts, crash loops, GPU
reset), ``[limits]`` (rlimits), ``[schedule]`` (planned restarts), ``[log]``, ``[runtime]``,
``[slots]`` (the KV cache carried across restarts) and ``[upgrade]`` (new llama-server builds).
Durations in seconds; what the validators lean
on lives beside: the ``[limits]`` value syntax (:mod:`llama_guard.config.limit_values`) and the cron
syntax (:mod:`llama_guard.config.cron`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from llama_guard.config.base import Policy, PositiveFloat, Reload, Section, path_problem
from llama_guard.config.cron import validate_cron, validate_timezone
from llama_guard.config.limit_values import normalize_config_value
from llama_guard.host.paths import DEFAULT_RUNTIME_DIR
from llama_guard.vocab.triggers import ResetTrigger

DEFAULT_RESET_ON: tuple[ResetTrigger, ...] = (ResetTrigger.GPU_LOST, ResetTrigger.XID, ResetTrigger.OOM)


class HealthConfig(Section):
    """``[health]``: readiness and liveness probes."""

    interval_s: Annotated[PositiveFloat, Reload.LIVE] = 5.0
    timeout_s: Annotated[PositiveFloat, Reload.NEXT_SERVER] = 3.0
    load_timeout_s: Annotated[PositiveFloat, Reload.LIVE, Policy()] = 900.0
    startup_poll_s: Annotated[PositiveFloat, Reload.LIVE] = 0.1
    canary: Annotated[bool, Reload.NEXT_SERVER, Policy()] = True
    canary_timeout_s: Annotated[PositiveFloat, Reload.NEXT_SERVER] = 30.0
    hang_strikes: Annotated[int, Field(ge=1), Reload.LIVE, Policy()] = 3
    load_stall_s: Annotated[float, Field(ge=0.0), Policy()] = 60.0
    progress_cpu_s: Annotated[PositiveFloat, Policy()] = 0.05
    silent_limit_s: Annotated[PositiveFloat, Policy()] = 60.0

class RecoveryConfig(Section):
    """``[recovery]``: restart backoff, crash-loop limit and GPU reset."""

    reload: ClassVar[Reload] = Reload.LIVE

    # Waits 0, 2, 4, 8, 16, 32, 60 s: a fault that clears within ~2 min of its first failure is ridden
    # out; one that fails the same way before ready is a verdict (exit 78) long before that.
    # model.types.Params takes these defaults (the keys marked Policy).
    backoff_initial_s: Annotated[PositiveFloat, Policy()] = 2.0
    backoff_factor: Annotated[float, Field(ge=1.0), Policy()] = 2.0
    backoff_max_s: Annotated[PositiveFloat, Policy()] = 60.0
    max_restarts: Annotated[int, Field(ge=0), Policy()] = 7
    restart_window_s: Annotated[PositiveFloat, Policy()] = 600.0
    stable_after_s: Annotated[PositiveFloat, Policy()] = 60.0
    stop_grace_s: Annotated[PositiveFloat, Policy()] = 15.0
    reset_on: Annotated[list[ResetTrigger], Policy(convert=frozenset)] = Field(
        default_factory=lambda: list(DEFAULT_RESET_ON))
    reset_command: list[str] = Field(
        default_factory=lambda: ["nvidia-smi", "--gpu-reset", "-i", "{index}"])
    reset_timeout_s: Annotated[PositiveFloat, Policy()] = 60.0
    foreign_wait_s: Annotated[float, Field(ge=0), Policy()] = 5.0
    reset_toggles_persistence: Annotated[bool, Policy("reset_retry")] = True
    max_resets: Annotated[int, Field(ge=0), Policy()] = 2
    reset_window_s: Annotated[PositiveFloat, Policy()] = 3600.0
    # A port taken by another process is retried (every 2 s, no crash counted) this long, then exit 78.
    port_wait_s: Annotated[float, Field(ge=0), Policy()] = 30.0
    # The start that would confirm a failure repeated identically (the verdict, exit 78) waits until
    # this long after the chain's first failure: a fault that prints the same line for a while and
    # then goes away (a driver reloading, a mount coming back) is ridden out; 0: confirm at once.
    repeat_confirm_s: Annotated[float, Field(ge=0), Policy()] = 45.0

    @field_validator("reset_command")
    @classmethod
    def _argv(cls, value: list[str]) -> list[str]:
        if not value or not value[0]:
            raise ValueError("reset_command must be a non-empty list of argv words")
        return value


class LimitsConfig(Section):
    """``[limits]``: rlimits the server gets, and when their use is reported."""

    reload: ClassVar[Reload] = Reload.SERVER_RESTART

    nofile: int | Literal["unlimited"] | None = 1048576
    memlock: int | Literal["unlimited"] | None = None
    nproc: int | Literal["unlimited"] | None = None
    warn_fraction: float = Field(0.8, gt=0, le=1)
    sample_interval_s: PositiveFloat = 10.0
    # Below this fraction a limit_low warning re-arms (default: warn_fraction - 0.1).
    rearm_fraction: float | None = Field(None, gt=0, lt=1)
    # While a limit stays past warn_fraction, limit_low is repeated this often.
    reminder_interval_s: PositiveFloat = 3600.0

    @field_validator("nofile", "memlock", "nproc", mode="before")
    @classmethod
    def _limit_value(cls, value: Any, info: ValidationInfo) -> Any:
        # "unlimited"/"infinity"/-1, whole numbers, and for memlock sizes with units ("64M").
        if value is None or isinstance(value, bool) or not isinstance(value, (int, str)):
            return value
        return normalize_config_value(value, sizes=info.field_name == "memlock")

    @model_validator(mode="after")
    def _rearm_below_warn(self) -> LimitsConfig:
        if self.rearm_fraction is not None and self.rearm_fraction >= self.warn_fraction:
            raise ValueError(f"rearm_fraction ({self.rearm_fraction}) must be below warn_fraction "
                             f"({self.warn_fraction})")
        return self

    @property
    def rearm_at(self) -> float:
        """The fraction below which ``limit_low`` re-arms."""
        if self.rearm_fraction is not None:
            return self.rearm_fraction
        return max(self.warn_fraction - 0.1, self.warn_fraction / 2)


class ScheduleConfig(Section):
    """``[schedule]``: planned restarts (see ``llama_guard.config.cron``, ``llama_guard.restarts.schedule`` and
    ``llama_guard.restarts.decay``).

    ``restart_cron``: standard 5-field cron ("" disables); ``timezone``: IANA name ("" = the
    host's). Durations in seconds. The decay thresholds are opt-in: 0 disables each.
    """

    reload: ClassVar[Reload] = Reload.LIVE

    restart_cron: str = "30 4 * * *"
    timezone: str = ""
    jitter_s: float = Field(0.0, ge=0)
    drain_timeout_s: Annotated[PositiveFloat, Policy()] = 300.0
    min_uptime_s: float = Field(3600.0, ge=0)
    # A fire found later than this (host asleep, clock stepped) is reported missed, not run.
    misfire_grace_s: float = Field(900.0, ge=0)
    # Decay-driven restarts (opt-in, 0 = off).
    vram_growth_mib: float = Field(0.0, ge=0)
    rss_growth_mib: float = Field(0.0, ge=0)
    speed_drop_fraction: float = Field(0.0, ge=0, lt=1)
    # Samples in the first decay_warmup_s after a start are not part of any baseline.
    decay_warmup_s: float = Field(600.0, ge=0)
    # Memory baseline: median of this many samples after the warm-up.
    decay_baseline_samples: int = Field(5, ge=1)
    # A trigger fires only after this many consecutive samples/windows past its bound.
    decay_confirm: int = Field(3, ge=1)
    # Generation speed is measured over windows of at least this many predicted tokens.
    speed_window_tokens: int = Field(4096, ge=1)
    # How many planned restarts `llama-guard status` keeps (before/after figures).
    history_size: int = Field(10, ge=1, le=1000)

    @field_validator("restart_cron")
    @classmethod
    def _cron(cls, value: str) -> str:

        return validate_cron(value)  # ScheduleError is a ValueError: it names the expression

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str) -> str:

        return validate_timezone(value)


class LogConfig(Section):
    """``[log]``: where events and the server's own lines go."""

    level: Annotated[Literal["debug", "info", "warning", "error"], Reload.LIVE] = "info"
    format: Literal["auto", "console", "json", "journald"] = "auto"
    server_log_file: Annotated[str, Reload.NEXT_SERVER] = ""


class RuntimeConfig(Section):
    """``[runtime]``: where the daemon keeps its pid file and status snapshot."""

    reload: ClassVar[Reload] = Reload.LIVE

    dir: Path = DEFAULT_RUNTIME_DIR

    @field_validator("dir")
    @classmethod
    def _dir(cls, value: Path) -> Path:
        if str(value) in ("", "."):
            raise ValueError("dir must name a directory")
        problem = path_problem("dir", str(value))
        if problem:
            raise ValueError(problem)
        return value


class SlotsConfig(Section):
    """``[slots]``: each slot's KV cache carried across restarts (see docs/slots.md).

    ``enabled``: save each slot that holds tokens before a planned restart, save idle slots as they
    change (for crashes) and restore them into the next server, verified. ``dir``: where the files go
    ("" = ``$STATE_DIRECTORY/slots`` under a unit with ``StateDirectory=``, else ``<[runtime].dir>/slots``);
    llama-server is started with ``--slot-save-path`` on it unless
    ``extra_args`` gives its own (then that directory is used). ``budget_mib``: the files' total size
    (MiB); the oldest are dropped first. ``rolling_save_interval_s``: an idle slot is saved at most
    this often (seconds). ``restore_timeout_s``: the most all restores may add to a start (seconds).
    ``save_timeout_s``: the most the saves before a planned stop may take (seconds).
    ``reset_save_timeout_s``: the most the saves before the stop for a GPU reset may delay the reset
    (seconds; only a fault that leaves the server able to answer is saved for, see docs/slots.md).
    """

    enabled: bool = True
    dir: str = ""
    budget_mib: float = Field(8192.0, gt=0)
    rolling_save_interval_s: PositiveFloat = 10.0
    restore_timeout_s: PositiveFloat = 30.0
    save_timeout_s: PositiveFloat = 60.0
    reset_save_timeout_s: float = Field(5.0, gt=0, le=60)

    @field_validator("dir")
    @classmethod
    def _dir(cls, value: str) -> str:
        if value == ".":
            raise ValueError("dir must name a directory (or be empty for the state directory's slots/)")
        problem = path_problem("dir", value)
        if problem:
            raise ValueError(problem)
        return value


class UpgradeConfig(Section):
    """``[upgrade]``: new llama-server builds (see README, "Upgrading llama-server").

    ``probation_s``: how long a new build serves on probation (seconds): an exit of it the daemon did
    not ask for (a crash on its first requests, a crash loop) rolls back to the last good build; after
    it, the build is the last good one and a copy of it is kept.

    The trial (a planned window that changes the build, see README): ``trial_runs``
    completions of ``trial_tokens`` generated tokens each, after one warm-up, measured on the old build
    (drained) and on the new one (loaded, clients still held) as ``llama-guard bench`` measures (the
    server's own decode tokens/s, median); 0 runs: no trial. The new build is kept when it decodes at
    most ``max_slowdown_pct`` percent slower than the old one, else rolled back at once. The default
    is above the run-to-run spread of the same build measured this way (README, "Upgrading
    llama-server", gives the figures). ``trial_timeout_s`` bounds one build's measurement (seconds);
    a measurement that fails or runs out of time on the new build rolls it back.
    """

    reload: ClassVar[Reload] = Reload.LIVE

    probation_s: PositiveFloat = 300.0
    trial_runs: Annotated[int, Field(ge=0, le=50), Policy()] = 3
    trial_tokens: Annotated[int, Field(ge=1, le=4096), Policy()] = 32
    max_slowdown_pct: Annotated[float, Field(gt=0, lt=100), Policy()] = 25.0
    trial_timeout_s: Annotated[PositiveFloat, Policy()] = 120.0
