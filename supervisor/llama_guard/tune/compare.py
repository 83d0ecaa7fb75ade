"""``bench --compare OTHER``: the configured server and another one measured side by side. OTHER is a
llama-server executable (another build: the same configuration with ``[server].binary`` = OTHER, the
motivating write-up's A/B of a self-compiled build against the prebuilt one) or another configuration
file (the flash-attention on/off A/B, for instance). Both servers are started and stay up together
(on distinct ports: B takes a free one when it would share A's), and their runs alternate
(:func:`~llama_guard.tune.bench.run_interleaved`), so a slow spell of the host cannot pick the winner.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_guard.config import Config, load_config
from llama_guard.config.argv import resolve_binary
from llama_guard.core.child import child_environ
from llama_guard.core.privileges import server_user_argv
from llama_guard.host.build import identify
from llama_guard.tune.bench import BenchResult, free_port


class CompareError(Exception):
    """OTHER is neither a llama-server that answers ``--version`` nor a configuration (the message says why)."""


@dataclass(frozen=True)
class Side:
    """One side of the comparison: its label in the report and the configuration its server runs."""

    label: str
    config: Config


#: How an executable's first bytes begin (ELF, a script): a file that starts so is a build, not a configuration.
PROGRAM_MAGIC = (b"\x7fELF", b"#!")
USAGE = "OTHER is a llama-server executable or a configuration file (.toml)"


def is_build(other: Path) -> bool:
    """Whether ``other`` names an executable (a llama-server build) rather than a configuration file."""
    return other.suffix != ".toml" and other.is_file() and os.access(other, os.X_OK)


def refusal(other: Path) -> str:
    """Why ``other`` can be neither side B's build nor its configuration ("" when it may be tried; a
    path that does not exist is left to the configuration's own error): a directory, an empty file, a
    program without the execute bit, a file that is neither an executable nor a ``.toml``. Blocking
    (reads the file's first bytes, or the ``.toml``)."""
    if other.is_dir():
        return f"{other} is a directory: {USAGE}"
    if not other.is_file() or is_build(other):
        return ""
    try:
        with other.open("rb") as f:
            head = f.read(4096)
    except OSError as exc:
        return f"{other}: {exc.strerror or exc}"
    if not head.strip():
        return f"{other} is empty: {USAGE}"
    if head.startswith(PROGRAM_MAGIC):
        mode = stat.S_IMODE(other.stat().st_mode)
        return f"{other} is a program but not executable (mode {mode:04o}): chmod +x it to compare that build"
    if other.suffix != ".toml":
        return f"{other} is neither executable nor a .toml file: {USAGE}"
    try:
        lines = [line.strip() for line in other.read_text(errors="replace").splitlines()]
    except OSError:
        return ""  # the configuration's own error says why
    if all(not line or line.startswith("#") for line in lines):
        return f"{other} is empty (no setting, only comments): {USAGE}"
    return ""


def sides(config_path: Path, config: Config, other: Path) -> tuple[Side, Side]:
    """A (``config``) and B (``other``: a build or a configuration; see the module docstring). Raises
    :class:`CompareError` (:func:`refusal`), or :class:`~llama_guard.config.ConfigError` for a
    configuration that does not load. Blocking: runs each build's ``--version`` (bounded)."""
    problem = refusal(other)
    if problem:
        raise CompareError(problem)
    if not is_build(other):
        theirs = load_config(other)
        if (theirs.server.host, theirs.server.port) == (config.server.host, config.server.port):
            theirs = on_port(theirs, free_port())
        return Side(config_path.name, config), Side(other.name, theirs)
    ours = resolve_binary(config.server.binary)
    if ours is None:
        raise CompareError(f"{config.server.binary!r} not found ([server].binary)")
    server = config.server
    try:  # each build's --version as llama-server runs: never as root
        run_as = server_user_argv(server.user, server.group, server.supplementary_groups)
    except (ValueError, FileNotFoundError) as exc:
        raise CompareError(f"[server].user: {exc}") from None
    labels = []
    for binary in (ours, other):
        build, failure = identify(binary, env=child_environ(os.environ, server.env), prefix=run_as)
        if build is None:
            raise CompareError(failure)
        labels.append(f"{binary} ({build.release})")
    theirs = on_port(config.model_copy(update={"server": config.server.model_copy(update={"binary": str(other)})}),
                     free_port())
    return Side(labels[0], config), Side(labels[1], theirs)


def on_port(config: Config, port: int) -> Config:
    """``config`` served on ``port``."""
    return config.model_copy(update={"server": config.server.model_copy(update={"port": port})})


def ratio_line(a: BenchResult, b: BenchResult) -> str:
    """``B ÷ A: eval 0.998×, prompt 1.003× (5 rounds, interleaved)``."""
    return (f"{b.label} ÷ {a.label}: eval {b.eval.median / a.eval.median:.3f}×, "
            f"prompt {b.prompt.median / a.prompt.median:.3f}× ({len(a.runs)} rounds, interleaved A, B, A, B …)")


def ratios(a: BenchResult, b: BenchResult) -> dict[str, Any]:
    """The ratios of B's medians to A's, for ``--json``."""
    return {"ratio_eval": b.eval.median / a.eval.median, "ratio_prompt": b.prompt.median / a.prompt.median,
            "interleaved": True}
