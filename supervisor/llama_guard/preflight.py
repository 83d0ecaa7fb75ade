"""``llama-guard check``: what can be known before starting the server."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from llama_guard.argv import build_argv, flags_in, resolve_binary
from llama_guard.config import Config

GGUF_MAGIC = b"GGUF"
HELP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class CheckResult:
    """One line of the preflight report; ``verdict`` is OK, WARN or FAIL."""

    name: str
    verdict: str
    detail: str


def check_binary(config: Config) -> list[CheckResult]:
    """The binary exists and runs, and its ``--help`` lists every flag we would pass."""
    binary = resolve_binary(config.server.binary)
    if binary is None:
        return [CheckResult("binary", "FAIL", f"{config.server.binary!r} not found (set [server].binary)")]
    if not os.access(binary, os.X_OK):
        return [CheckResult("binary", "FAIL", f"{binary} is not executable")]
    try:
        out = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                             timeout=HELP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [CheckResult("binary", "FAIL", f"{binary} --help failed: {exc}")]
    help_text = out.stdout + out.stderr
    results = [CheckResult("binary", "OK", str(binary))]
    unknown = [f for f in flags_in(build_argv(config.server, binary)) if f not in help_text]
    if unknown:
        results.append(CheckResult("flags", "FAIL",
                                   f"{binary} does not know: {' '.join(sorted(set(unknown)))}"))
    else:
        results.append(CheckResult("flags", "OK", "every flag is listed by --help"))
    return results


def check_model(config: Config) -> CheckResult:
    """The model file exists, is readable and starts with the GGUF magic."""
    path = Path(config.server.model)
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        return CheckResult("model", "FAIL", f"{path}: {exc.strerror or exc}")
    if magic != GGUF_MAGIC:
        return CheckResult("model", "FAIL", f"{path}: not a GGUF file (magic {magic!r})")
    return CheckResult("model", "OK", f"{path} ({path.stat().st_size / 2**20:.0f} MiB)")


def run_checks(config: Config, config_path: Path) -> list[CheckResult]:
    """Every preflight check, in report order."""
    results = [CheckResult("config", "OK", str(config_path))]
    results += check_binary(config)
    results.append(check_model(config))
    return results
