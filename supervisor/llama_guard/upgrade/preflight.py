"""Preflight of a llama-server build, run while the serving server goes on serving and as llama-server
runs (as ``[server].user``): the build starts at all (``--version`` exits 0 in time: no missing shared
library, no signal, executable by that account), and every flag
llama-guard would pass it (:func:`~llama_guard.config.argv.build_argv`) is in its ``--help``.

Blocking (runs the binary twice, each bounded): call it off the event loop.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llama_guard.config import Config
from llama_guard.config.argv import binary_problem, build_argv, flags_in
from llama_guard.core.child import child_environ
from llama_guard.core.privileges import server_user_argv
from llama_guard.host.build import HELP_TIMEOUT_S, VERSION_TIMEOUT_S, Build, identify, run_bounded


@dataclass(frozen=True)
class Preflight:
    """The outcome: ``build`` (None when not even its hash or ``--version`` could be read) and
    ``cause``, "" when it passed; ``unknown_flags``: the flags its ``--help`` does not list."""

    build: Build | None
    cause: str
    unknown_flags: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.cause


def unknown_flags(argv: list[str], help_listing: str) -> tuple[str, ...]:
    """The flags of ``argv`` (without the binary) that ``help_listing`` does not name as a whole
    word (``--mlock`` is not found in ``--mlock-all``), sorted, each once."""
    def listed(flag: str) -> bool:
        return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_listing) is not None
    return tuple(sorted({flag for flag in flags_in(argv) if not listed(flag)}))


def preflight(config: Config, binary: Path, *, version_timeout_s: float = VERSION_TIMEOUT_S,
              help_timeout_s: float = HELP_TIMEOUT_S, prefix: Sequence[str] | None = None) -> Preflight:
    """Preflight ``binary`` for ``config`` (see the module docstring), run as llama-server would be:
    after ``prefix`` (None: :func:`~llama_guard.core.privileges.server_user_argv`, the drop to
    ``[server].user``), with ``[server].env`` over llama-guard's environment."""
    server = config.server
    problem = binary_problem(str(binary))
    if problem:  # not run at all: a directory, a file without the execute bit
        return Preflight(None, problem)
    if prefix is None:
        try:
            prefix = server_user_argv(server.user, server.group, server.supplementary_groups)
        except (ValueError, FileNotFoundError) as exc:
            return Preflight(None, str(exc))
    env = child_environ(os.environ, server.env)
    build, failure = identify(binary, version_timeout_s, env, prefix)
    if build is None:
        return Preflight(None, failure)
    what = f"{binary} --help"
    try:
        ran = run_bounded([*prefix, str(binary), "--help"], help_timeout_s, env=env)
    except OSError as exc:
        return Preflight(build, f"{what}: {exc.strerror or exc}")
    failure = ran.failure(what, help_timeout_s)
    if failure:
        return Preflight(build, failure)
    unknown = unknown_flags(build_argv(config.server, binary, config.slots, config.runtime, prefix), ran.text)
    if unknown:
        return Preflight(build, f"{binary} ({build.release}) does not know {' '.join(unknown)}, which llama-guard "
                                "passes (its --help lists no such flag)", unknown)
    return Preflight(build, "")


def copy_problem(config: Config, kept: Build, library_dir: Path) -> str:
    """Why the kept copy ``kept`` would not start as a roll-back starts it — as ``[server].user``, with
    ``LD_LIBRARY_PATH`` on ``library_dir`` (its directory): its ``--version`` fails (a directory that
    account cannot reach, a library the copy lacks: one that lay outside the build's own directory);
    "" when it starts. Blocking (runs the copy, bounded)."""
    server = config.server
    try:
        prefix = server_user_argv(server.user, server.group, server.supplementary_groups)
    except (ValueError, FileNotFoundError) as exc:
        return f"[server].user: {exc}"
    env = child_environ(os.environ, server.env)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(library_dir), env.get("LD_LIBRARY_PATH")) if p)
    return identify(kept.path, VERSION_TIMEOUT_S, env, prefix)[1]
