"""llama-guard's configuration: a TOML file plus ``LLAMA_GUARD_<SECTION>__<KEY>`` overrides.

The file is read by pydantic-settings' TOML source; environment variables win over the file.
Every section forbids unknown keys. :func:`load_config` turns every problem (missing file,
invalid TOML, unknown key, bad value) into a :class:`ConfigError` whose lines each name the
file, the key and the reason.

One pydantic model per TOML section with its validators and the units of every key in its field
description, and the loading. What the models lean on lives beside: the ``[limits]`` value syntax
(:mod:`llama_guard.limit_values`), llama-server's flag lists (:mod:`llama_guard.server_flags`), the
cron syntax (:mod:`llama_guard.cron`); the API key file is read by :mod:`llama_guard.api_key`.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import re
import stat
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from llama_guard.cron import validate_cron, validate_timezone
from llama_guard.limit_values import normalize_config_value
from llama_guard.server_flags import OWNED_FLAGS, QUANTIZED_CACHE_TYPES, SECRET_FLAGS, SECRET_NAME, CacheType
from llama_guard.vocab.triggers import ResetTrigger

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from llama_guard.paths import (
    DEFAULT_CONFIG_PATH as DEFAULT_CONFIG_PATH,
)
from llama_guard.paths import (
    DEFAULT_RUNTIME_DIR,
    ENV_CONFIG_PATH,
    ENV_PREFIX,
    os_reason,
)
from llama_guard.paths import resolve_config_path as resolve_config_path

_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class GpuWatchMode(str, enum.Enum):
    """``[gpu].enabled``: watch the GPU when one answers NVML, always (else refuse to run), never."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class ForeignProcesses(str, enum.Enum):
    """``[gpu].foreign_processes``: another process holding VRAM at a start is reported, or refuses it."""

    WARN = "warn"
    REFUSE = "refuse"


DEFAULT_RESET_ON: tuple[ResetTrigger, ...] = (ResetTrigger.GPU_LOST, ResetTrigger.XID, ResetTrigger.OOM)
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]

_ACCOUNT = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?|[0-9]{1,10}")



class ConfigError(Exception):
    """A configuration that cannot be used. ``lines`` are one human line per problem."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ServerConfig(_Section):
    """``[server]``: the llama-server binary, the model and its typed knobs."""

    binary: str = Field("llama-server", min_length=1)
    model: Path = Path("/var/lib/llama-guard/model.gguf")
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8080, ge=1, le=65535)
    n_gpu_layers: int = Field(999, ge=0)
    ctx_size: int = Field(8192, ge=0)
    parallel: int = Field(1, ge=1, le=256)
    batch_size: int = Field(512, ge=1)
    ubatch_size: int = Field(256, ge=1)
    cache_type_k: CacheType = "q8_0"
    cache_type_v: CacheType = "q8_0"
    flash_attn: Literal["on", "off", "auto"] = "on"
    threads: int | None = Field(8, ge=1)
    threads_batch: int | None = Field(None, ge=1)
    mlock: bool = False
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    # The unprivileged account llama-server runs as ("" = llama-guard's own; see docs/systemd.md).
    user: str = ""
    group: str = ""
    supplementary_groups: list[str] = Field(default_factory=list)
    # A file holding llama-server's API key(s), one per line: passed as --api-key-file, and the
    # first key is what llama-guard's own probes send (Authorization: Bearer).
    api_key_file: str = ""

    @field_validator("user", "group")
    @classmethod
    def _account(cls, value: str) -> str:
        if value and not _ACCOUNT.fullmatch(value):
            raise ValueError(f"{value!r} is not a user/group name or number")
        return value

    @field_validator("supplementary_groups")
    @classmethod
    def _groups(cls, value: list[str]) -> list[str]:
        for item in value:
            if not _ACCOUNT.fullmatch(item):
                raise ValueError(f"{item!r} is not a group name or number")
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            pass
        if not _HOSTNAME.fullmatch(value):
            raise ValueError(f"{value!r} is not an IP address or a host name (no port, no brackets)")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if "\0" in item:
                raise ValueError(f"the value of {key} contains a NUL byte")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ServerConfig:
        for name, text in (("binary", self.binary), ("model", str(self.model)), *(("extra_args", a)
                                                                              for a in self.extra_args)):
            if "\0" in text:
                raise ValueError(f"{name} contains a NUL byte")
        if str(self.model) in ("", "."):
            raise ValueError("model must name a GGUF file")
        if self.ubatch_size > self.batch_size:
            raise ValueError(
                f"ubatch_size ({self.ubatch_size}) must not exceed batch_size ({self.batch_size})")
        if self.cache_type_v in QUANTIZED_CACHE_TYPES and self.flash_attn == "off":
            raise ValueError(
                f"cache_type_v = {self.cache_type_v!r} needs flash_attn = 'on' or 'auto': "
                "llama-server refuses a quantized V cache without flash attention")
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in OWNED_FLAGS:
                hint = " (api_key_file)" if flag == "--api-key-file" else ""
                raise ValueError(f"extra_args repeats {flag!r}, which is set by a typed [server] key{hint}")
        for key in self.env:
            if key == "NOTIFY_SOCKET" or key.startswith("WATCHDOG_"):
                raise ValueError(f"env may not set {key}: it belongs to llama-guard's service manager")
        for key in self.env:
            if SECRET_NAME.search(key):
                raise ValueError(f"env may not set {key}: a secret in llama-server's environment can be read "
                                 "from /proc/PID/environ and lands in core dumps and crash reports; put an API key in "
                                 "[server].api_key_file")
        for i, arg in enumerate(self.extra_args):
            flag = arg.split("=", 1)[0]
            if flag in SECRET_FLAGS:
                raise ValueError(f"extra_args[{i}] is {flag!r}: a secret on llama-server's command line shows in "
                                 "events, journald, status.json and ps; put the API key in [server].api_key_file "
                                 "(a file readable by [server].user), and tokens in a file of their own")
        if (self.group or self.supplementary_groups) and not self.user:
            raise ValueError("group and supplementary_groups need user")
        if "\0" in self.api_key_file:
            raise ValueError("api_key_file contains a NUL byte")
        return self

    @property
    def loopback(self) -> bool:
        """Whether ``host`` is a loopback address (or ``localhost``): the API is not reachable from outside."""
        if self.host.rstrip(".").lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the server, with an IPv6 host bracketed and 0.0.0.0 as loopback."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


class HealthConfig(_Section):
    """``[health]``: readiness and liveness probes."""

    interval_s: PositiveFloat = 5.0
    timeout_s: PositiveFloat = 3.0
    load_timeout_s: PositiveFloat = 900.0
    startup_poll_s: PositiveFloat = 0.1
    canary: bool = True
    canary_timeout_s: PositiveFloat = 30.0
    hang_strikes: int = Field(3, ge=1)
    load_stall_s: float = Field(60.0, ge=0.0)
    progress_cpu_s: PositiveFloat = 0.05
    silent_limit_s: PositiveFloat = 60.0


class GpuConfig(_Section):
    """``[gpu]``: which GPU to watch and the thresholds of its events."""

    enabled: GpuWatchMode = GpuWatchMode.AUTO
    index: int = Field(0, ge=0)
    uuid: str = ""
    pci_bus_id: str = ""
    sample_interval_s: PositiveFloat = 10.0
    temperature_warn_c: int = Field(85, ge=1, le=150)
    power_warn_fraction: float = Field(0.95, gt=0, le=1.5)
    foreign_processes: ForeignProcesses = ForeignProcesses.WARN
    require_server_on_gpu: bool = True
    server_on_gpu_timeout_s: PositiveFloat = 10.0
    vram_release_timeout_s: PositiveFloat = 30.0
    driver_version: str = ""
    enable_persistence: bool = False
    slowdown_margin_c: int = Field(5, ge=0, le=50)
    temperature_hysteresis_c: int = Field(5, ge=0, le=50)
    power_sustain_s: float = Field(60.0, ge=0)
    throttle_sustain_s: float = Field(30.0, ge=0)
    reminder_interval_s: PositiveFloat = 3600.0
    kmsg_path: str = "/dev/kmsg"
    expected_vram_mib: int = Field(0, ge=0)
    vram_wait_timeout_s: PositiveFloat = 300.0
    # Memory bandwidth for `bench`'s ceiling, GB/s (1e9 bytes/s); unset = from NVML (bus width x clock).
    memory_bandwidth_gbs: float | None = Field(None, gt=0, allow_inf_nan=False)
    # VRAM size for `check`'s budget instead of NVML's free memory, MiB (a stated card; tests).
    vram_total_mib: int | None = Field(None, gt=0)


class RecoveryConfig(_Section):
    """``[recovery]``: restart backoff, crash-loop limit and GPU reset."""

    # Waits 0, 2, 4, 8, 16, 32, 60 s: a fault that clears within ~2 min of its first failure is ridden
    # out; one that fails the same way before ready is a verdict (exit 78) long before that.
    # core.types.Params carries the same defaults.
    backoff_initial_s: PositiveFloat = 2.0
    backoff_factor: float = Field(2.0, ge=1.0)
    backoff_max_s: PositiveFloat = 60.0
    max_restarts: int = Field(7, ge=0)
    restart_window_s: PositiveFloat = 600.0
    stable_after_s: PositiveFloat = 60.0
    stop_grace_s: PositiveFloat = 15.0
    reset_on: list[ResetTrigger] = Field(default_factory=lambda: list(DEFAULT_RESET_ON))
    reset_command: list[str] = Field(
        default_factory=lambda: ["nvidia-smi", "--gpu-reset", "-i", "{index}"])
    reset_timeout_s: PositiveFloat = 60.0
    foreign_wait_s: float = Field(5.0, ge=0)
    reset_toggles_persistence: bool = True
    max_resets: int = Field(2, ge=0)
    reset_window_s: PositiveFloat = 3600.0
    # A port taken by another process is retried (every 2 s, no crash counted) this long, then exit 78.
    port_wait_s: float = Field(30.0, ge=0)
    # The start that would confirm a failure repeated identically (the verdict, exit 78) waits until
    # this long after the chain's first failure: a fault that prints the same line for a while and
    # then goes away (a driver reloading, a mount coming back) is ridden out; 0: confirm at once.
    repeat_confirm_s: float = Field(45.0, ge=0)

    @field_validator("reset_command")
    @classmethod
    def _argv(cls, value: list[str]) -> list[str]:
        if not value or not value[0]:
            raise ValueError("reset_command must be a non-empty list of argv words")
        return value


class LimitsConfig(_Section):
    """``[limits]``: rlimits the server gets, and when their use is reported."""

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


class ScheduleConfig(_Section):
    """``[schedule]``: planned restarts (see ``llama_guard.cron`` and ``llama_guard.restarts.decay``).

    ``restart_cron``: standard 5-field cron ("" disables); ``timezone``: IANA name ("" = the
    host's). Durations in seconds. The decay thresholds are opt-in: 0 disables each.
    """

    restart_cron: str = "30 4 * * *"
    timezone: str = ""
    jitter_s: float = Field(0.0, ge=0)
    drain_timeout_s: PositiveFloat = 300.0
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


class LogConfig(_Section):
    """``[log]``: where events and the server's own lines go."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "console", "json", "journald"] = "auto"
    server_log_file: str = ""


class RuntimeConfig(_Section):
    """``[runtime]``: where the daemon keeps its pid file and status snapshot."""

    dir: Path = DEFAULT_RUNTIME_DIR

    @field_validator("dir")
    @classmethod
    def _dir(cls, value: Path) -> Path:
        if str(value) in ("", "."):
            raise ValueError("dir must name a directory")
        return value


class _Listener(_Section):
    """A section with a ``listen`` address: ``"PORT"`` (bound to 127.0.0.1), ``"HOST:PORT"`` or
    ``"[IPv6]:PORT"``; "" = off."""

    listen: str = ""

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        if value:
            parse_listen(value)  # ValueError names the problem
        return value

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)`` to bind, or None when off."""
        return parse_listen(self.listen) if self.listen else None


class MetricsConfig(_Listener):
    """``[metrics]``: the Prometheus endpoint (off unless ``listen`` is set)."""


class FrontConfig(_Listener):
    """``[front]``: the front door, a reverse proxy that holds requests while llama-server is not
    ready (off unless ``listen`` is set; see docs/front.md).

    ``listen``: ``"HOST:PORT"`` (or ``"PORT"``, bound to 127.0.0.1) where clients connect; then
    ``[server].host``/``port`` are llama-server's private address. ``hold_timeout_s``: how long a
    request may wait for a ready server (seconds) before it gets 503 with ``Retry-After``.
    ``max_held``: requests held at once (more get 503 at once). ``max_body_bytes``: the largest request
    body (413 above it). ``max_buffered_bytes``: request bodies kept in memory at once, held and in
    flight together (each is kept until its answer began, for a replay; it counts the bytes received,
    never a declared ``Content-Length``); past it, 503.
    ``header_timeout_s``: a connection must deliver a request's head within this many seconds of
    connecting or of its previous answer (else closed); ``body_timeout_s``: the whole body within
    this many seconds (else 408). ``stall_timeout_s``: a response that had begun and then gets no
    byte for this long is reported to the policy as stalled (0 = off). ``max_connections``: client
    connections open at once (more are closed at once; the daemon's RLIMIT_NOFILE must allow them).
    ``stop_drain_s``: on SIGTERM/SIGINT, how long the requests in flight may finish before llama-server
    is stopped, while new ones get 503 at once (0 = stop at once).
    ``crash_refuse_s``: a request (method, target, body) in flight at two llama-server crashes is
    answered 422 for this many seconds after the second (docs/front.md, "Requests that crash the server").
    """

    hold_timeout_s: PositiveFloat = 120.0
    max_held: int = Field(256, ge=1)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    max_buffered_bytes: int = Field(512 * 1024 * 1024, ge=1024)
    header_timeout_s: PositiveFloat = 15.0
    body_timeout_s: PositiveFloat = 60.0
    stall_timeout_s: float = Field(120.0, ge=0.0)
    max_connections: int = Field(16384, ge=1)
    stop_drain_s: float = Field(120.0, ge=0.0, allow_inf_nan=False)
    crash_refuse_s: PositiveFloat = 600.0


class SlotsConfig(_Section):
    """``[slots]``: each slot's KV cache carried across restarts (see docs/slots.md).

    ``enabled``: save each slot that holds tokens before a planned restart, save idle slots as they
    change (for crashes) and restore them into the next server, verified. ``dir``: where the files go
    ("" = ``<[runtime].dir>/slots``); llama-server is started with ``--slot-save-path`` on it unless
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
        if "\0" in value or value == ".":
            raise ValueError("dir must name a directory (or be empty for <[runtime].dir>/slots)")
        return value


def parse_listen(value: str) -> tuple[str, int]:
    """``"9400"`` → ``("127.0.0.1", 9400)``; ``"0.0.0.0:9400"``; ``"[::1]:9400"``. Raises ValueError."""
    text = value.strip()
    host = "127.0.0.1"
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1:end + 2] != ":":
            raise ValueError(f"{value!r}: expected [IPv6]:PORT")
        host, port_text = text[1:end], text[end + 2:]
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
    else:
        port_text = text
        if not text.isdigit():
            raise ValueError(f"{value!r}: expected PORT, HOST:PORT or [IPv6]:PORT")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{value!r}: the port must be a number from 1 to 65535")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.fullmatch(host):
            raise ValueError(f"{value!r}: {host!r} is not an IP address or host name") from None
    return host, int(port_text)


def host_port(host: str, port: int) -> str:
    """``host:port`` as :func:`parse_listen` reads it back: an IPv6 host bracketed (``[::1]:8080``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_TOML_PATH: ContextVar[Path | None] = ContextVar("llama_guard_toml_path", default=None)


class Config(BaseSettings):
    """The whole configuration. Build it with :func:`load_config`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        case_sensitive=False,
    )

    server: ServerConfig = Field(default_factory=ServerConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    gpu: GpuConfig = Field(default_factory=GpuConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    front: FrontConfig = Field(default_factory=FrontConfig)
    slots: SlotsConfig = Field(default_factory=SlotsConfig)

    @model_validator(mode="after")
    def _ports(self) -> Config:
        """llama-server, the front door and the exporter each need a port of their own: two of them
        on one port would have the second wait for the first forever (or refuse at start)."""
        front, metrics = self.front.address, self.metrics.address
        if front is not None and front[1] == self.server.port:
            raise ValueError(f"front.listen {self.front.listen!r} uses port {self.server.port}, which is "
                             "[server].port: with the front door on, [server].port is llama-server's private "
                             "port (e.g. 8081) and clients use front.listen")
        if metrics is not None and metrics[1] == self.server.port:
            raise ValueError(f"metrics.listen {self.metrics.listen!r} uses port {self.server.port}, which is "
                             "[server].port, where llama-server listens: give the exporter a port of its own "
                             "(e.g. 9400)")
        if front is not None and metrics is not None and metrics[1] == front[1]:
            raise ValueError(f"front.listen {self.front.listen!r} and metrics.listen {self.metrics.listen!r} "
                             f"use the same port {front[1]}: give each a port of its own")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _TOML_PATH.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)


# Variables with the prefix that are not overrides.
_NOT_OVERRIDES = frozenset({ENV_CONFIG_PATH})


def unknown_env_overrides(environ: Mapping[str, str]) -> list[str]:
    """``LLAMA_GUARD_*`` variables that name no section/key (a typo would otherwise be ignored).

    ``$LLAMA_GUARD_CONFIG`` and the test hooks ``LLAMA_GUARD_TEST_*`` are not overrides.
    """
    out = []
    sections = Config.model_fields
    for name in environ:
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in _NOT_OVERRIDES or upper.startswith(ENV_PREFIX + "TEST_"):
            continue
        rest = upper[len(ENV_PREFIX):]
        section, _, key = rest.partition("__")
        model = sections.get(section.lower())
        if model is None or model.annotation is None:
            out.append(name)
            continue
        if key:
            first = key.split("__", 1)[0].lower()
            fields = getattr(model.annotation, "model_fields", {})
            if first not in fields:
                out.append(name)
    return sorted(out)


def _format_loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_config(path: Path) -> Config:
    """Read and validate the config at ``path`` plus environment overrides.

    Raises :class:`ConfigError` (one line per problem, each naming ``path``, the key and the
    reason) for a missing or unreadable file, invalid TOML, unknown keys or bad values.
    """
    try:
        st = os.stat(path)  # the error as it is: a symlink loop is not "no such file"
    except OSError as exc:
        raise ConfigError([f"{path}: {os_reason(exc)}"]) from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError([f"{path}: not a regular file"])
    try:
        with path.open("rb") as handle:
            tomllib.load(handle)  # parse once up front for a precise syntax error
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: invalid TOML: {exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not valid UTF-8 text (byte {exc.start}): TOML files are UTF-8"]) from exc
    unknown = unknown_env_overrides(os.environ)
    if unknown:
        raise ConfigError([f"{path}: ${name}: unknown environment override (no such section or key)"
                           for name in unknown])
    token = _TOML_PATH.set(path)
    try:
        return Config()
    except SettingsError as exc:
        # e.g. a list or table key overridden with text that is not JSON
        raise ConfigError([f"{path}: environment override: {exc}"]) from exc
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            key = _format_loc(err["loc"])
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            elif "input" in err and err["type"] not in ("value_error", "missing"):
                msg = f"{msg} (got {_short(err['input'])})"
            env_name = ENV_PREFIX + "__".join(str(p) for p in err["loc"]).upper()
            origin = f" (from ${env_name})" if env_name in os.environ else ""
            lines.append(f"{path}: {key}: {msg}{origin}")
        raise ConfigError(lines) from exc
    finally:
        _TOML_PATH.reset(token)
