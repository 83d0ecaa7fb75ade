"""``[server]``: the llama-server binary, the model, its typed knobs, the account it runs as and its
API key file. The flag lists the validators check ``extra_args`` against live in
:mod:`llama_guard.vocab.server_flags`; the key file is read by :mod:`llama_guard.config.api_key`."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from llama_guard.config.base import HOSTNAME, Policy, Reload, Section, path_problem
from llama_guard.vocab.server_flags import (
    OWNED_FLAGS,
    QUANTIZED_CACHE_TYPES,
    ROUTER_FLAGS,
    SECRET_FLAGS,
    SECRET_NAME,
    CacheType,
)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ACCOUNT = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?|[0-9]{1,10}")


class ServerConfig(Section):
    """``[server]``: the llama-server binary, the model and its typed knobs."""

    reload: ClassVar[Reload] = Reload.SERVER_RESTART

    binary: str = Field("llama-server", min_length=1)
    model: Annotated[Path, Policy("model_path", str)] = Path("/var/lib/llama-guard/model.gguf")
    host: str = Field("127.0.0.1", min_length=1)
    port: Annotated[int, Field(ge=1, le=65535), Policy()] = 8080
    n_gpu_layers: Annotated[int, Field(ge=0), Policy("offload_layers")] = 999
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
        if not HOSTNAME.fullmatch(value):
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
        for name, path in (("binary", self.binary), ("model", str(self.model)), ("api_key_file", self.api_key_file)):
            problem = path_problem(name, path)
            if problem:
                raise ValueError(problem)
        for arg in self.extra_args:  # passed verbatim by exec: a newline is a chat template's own
            if "\0" in arg:
                raise ValueError("extra_args contains a NUL byte")
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
            if flag in ROUTER_FLAGS:
                raise ValueError(f"extra_args has {flag!r}, a flag of llama-server's router mode (no --model: a "
                                 "child server per model, loaded on demand), which llama-guard cannot run: it "
                                 "supervises one llama-server on one [server].model (run one llama-guard per model)")
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
