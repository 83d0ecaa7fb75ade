"""llama-guard's configuration: a TOML file plus ``LLAMA_GUARD_<SECTION>__<KEY>`` overrides.

The file is read by pydantic-settings' TOML source; environment variables win over the file.
Every section forbids unknown keys. :func:`load_config` turns every problem (missing file,
invalid TOML, unknown key, bad value) into a :class:`ConfigError` whose lines each name the
file, the key and the reason.

This module holds the whole (:class:`Config`, one field per section, and the checks across
sections) and the loading. One pydantic model per TOML section, with its validators and the units
of every key, lives in a module of this package: ``[server]`` in :mod:`.server`, ``[gpu]`` in
:mod:`.gpu`, ``[metrics]`` and ``[front]`` (the ``listen`` sections) in :mod:`.listen`, the
daemon's own sections in :mod:`.sections`; llama-server's flag lists are
:mod:`llama_guard.vocab.server_flags`; the API key file is read by :mod:`llama_guard.config.api_key`.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from llama_guard.config.gpu import GpuConfig
from llama_guard.config.listen import FrontConfig, MetricsConfig
from llama_guard.config.sections import (
    HealthConfig,
    LimitsConfig,
    LogConfig,
    RecoveryConfig,
    RuntimeConfig,
    ScheduleConfig,
    SlotsConfig,
    UpgradeConfig,
)
from llama_guard.config.server import ServerConfig
from llama_guard.config.tune import TuneConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from llama_guard.host.paths import ENV_CONFIG_PATH, ENV_PREFIX, os_reason


class ConfigError(Exception):
    """A configuration that cannot be used. ``lines`` are one human line per problem."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines



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
    tune: TuneConfig = Field(default_factory=TuneConfig)
    upgrade: UpgradeConfig = Field(default_factory=UpgradeConfig)

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
