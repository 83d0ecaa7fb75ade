"""Everything between "start a server" and a running llama-server child.

In order: the binary and the model file (a configuration error is fatal, a hung filesystem is a
failure retried after backoff), the argv (the binary's
``--help`` tells whether ``--mlock`` is known), the ports' checks before the spawn (the child
set-up's plan of limits, the GPU's wait for the old server's VRAM, the KV slot store), the child
set-up run between fork and exec (the child set-up port's rlimits, then the drop to
``[server].user``), the API key read, and the spawn itself. Blocking calls run on the
daemon's lanes with deadlines. The answer is a :class:`Started` or a :class:`SpawnFailed` for the
policy (a server that outlives SIGKILL never gets a successor: the policy's verdict, exit 69). Never
touches the loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llama_guard.config import Config, ConfigError
from llama_guard.config.api_key import read_api_key
from llama_guard.config.argv import binary_problem, build_argv, own_slot_save_problem, resolve_binary
from llama_guard.core.child import ChildSetup, ServerProcess, child_environ, spawn
from llama_guard.core.gpu_port import GpuPort
from llama_guard.core.model_file import MODEL_CHECK_TIMEOUT_S, model_problem
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.core.ports import BuildPort, BuildRefused, ChildSetupPort, SlotPort
from llama_guard.core.privileges import ServerIdentity, drop_argv, server_identity
from llama_guard.model.inputs import SpawnFailed
from llama_guard.model.watcher import Context

HELP_PROBE_TIMEOUT_S = 25.0  # building the argv (the binary's --help, itself bounded at 20 s)


@dataclass(frozen=True)
class Started:
    """A running llama-server child and the argv it was started with."""

    server: ServerProcess
    argv: tuple[str, ...]


def prepare(config: Config, config_path: Path) -> tuple[str, ServerIdentity]:
    """The API key and llama-server's identity for ``config``. Blocking (reads files, the user
    database). Raises ConfigError naming ``config_path``."""
    key = read_api_key(config.server)
    try:
        identity = server_identity(config.server.user, config.server.group, config.server.supplementary_groups)
    except (ValueError, OSError) as exc:
        raise ConfigError([f"{config_path}: {exc}"]) from None
    return key, identity


class Spawner:
    """Starts one llama-server at a time for the daemon.

    Holds what carries from one start to the next: the identity to drop to, the API key the running
    server was started with (``live_key``, which the probes send; never emitted), the last server's
    pid (for the checks before the next spawn). ``child``, ``gpu``, ``slots``, ``builds``: the
    daemon's ports (None: absent).
    """

    def __init__(self, emit: Callable[..., None], lanes: dict[LaneKind, Lane], clock: Callable[[], float], *,
                 child: ChildSetupPort | None = None, gpu: GpuPort | None = None,
                 slots: SlotPort | None = None, builds: BuildPort | None = None) -> None:
        self._emit = emit
        self._builds = builds
        self._child = child
        self._gpu = gpu
        self._slots = slots
        self._lanes = lanes
        self._clock = clock
        self.identity = ServerIdentity(None, None, None, "llama-guard's own user")
        self.live_key = ""
        self.last_pid: int | None = None
        self.cancellable = False  # True while the start may still be abandoned (before the fork)

    async def start(self, config: Config, ctx: Context) -> Started | SpawnFailed:
        """Prepare and start one server for ``config`` (``ctx`` for the ports). Cancelling
        it while :attr:`cancellable` abandons the start (nothing was forked)."""
        self.cancellable = True
        try:
            return await self._start(config, ctx)
        finally:
            self.cancellable = False

    async def _start(self, config: Config, ctx: Context) -> Started | SpawnFailed:
        server_cfg = config.server

        def find() -> tuple[Path | None, str]:  # stats of the binary's path: off the loop (a hung filesystem)
            found = resolve_binary(server_cfg.binary)
            return found, binary_problem(server_cfg.binary) if found is None else ""

        try:
            binary, problem = await self._lanes[LaneKind.CONFIG].run(find, MODEL_CHECK_TIMEOUT_S,
                                                                     f"finding {server_cfg.binary}")
        except (CallTimeout, LaneBusy) as exc:  # a hung filesystem: a failure, retried after backoff
            self._emit("blocking_call_timeout", call=f"finding {server_cfg.binary}", timeout_s=MODEL_CHECK_TIMEOUT_S,
                       effect="the server is not started now")
            return SpawnFailed(f"server.binary: {exc}", fatal=False)
        if binary is None:
            return SpawnFailed(f"llama-server binary: {problem}")
        library_dir: Path | None = None
        if self._builds is not None:  # the configured build once preflighted, or the last good one
            choice = await self._builds.before_spawn(ctx, binary)
            if isinstance(choice, BuildRefused):
                return SpawnFailed(choice.cause)
            binary, library_dir = choice.binary, choice.library_dir
        model = Path(server_cfg.model)
        try:
            problem = await self._lanes[LaneKind.CONFIG].run(lambda: model_problem(model), MODEL_CHECK_TIMEOUT_S,
                                                      f"checking {model}")
        except (CallTimeout, LaneBusy) as exc:  # a hung filesystem: a failure, retried after backoff
            self._emit("blocking_call_timeout", call=f"checking {model}", timeout_s=MODEL_CHECK_TIMEOUT_S,
                           effect="the server is not started now")
            return SpawnFailed(f"server.model: {exc}", fatal=False)
        if problem:  # a FIFO, a directory, not GGUF ...: a configuration error (exit 78)
            return SpawnFailed(f"server.model: {problem}")
        try:
            problem = await self._lanes[LaneKind.CONFIG].run(lambda: own_slot_save_problem(server_cfg),
                                                             MODEL_CHECK_TIMEOUT_S, "checking --slot-save-path")
        except (CallTimeout, LaneBusy) as exc:
            return SpawnFailed(f"server.extra_args: {exc}", fatal=False)
        if problem:  # llama-server refuses a --slot-save-path that is not a directory: so does llama-guard
            return SpawnFailed(f"server.{problem}")
        try:  # the drop to [server].user: llama-server's and its --help probe's (never run a build as root)
            drop = tuple(drop_argv(self.identity))
        except FileNotFoundError as exc:  # no setpriv: nothing can be started safely (exit 78)
            return SpawnFailed(str(exc))
        try:
            argv = await self._lanes[LaneKind.PROBE].run(
                lambda: build_argv(server_cfg, binary, config.slots, config.runtime, drop), HELP_PROBE_TIMEOUT_S,
                                                  f"{binary} --help")
        except (CallTimeout, LaneBusy) as exc:
            self._emit("blocking_call_timeout", call=f"{binary} --help", timeout_s=HELP_PROBE_TIMEOUT_S,
                           effect=f"starting with --mlock unverified ({exc})")
            # no binary: plain --mlock
            argv = [str(binary), *build_argv(server_cfg, None, config.slots, config.runtime)[1:]]
        env = child_environ(os.environ, server_cfg.env)
        if library_dir is not None:  # a kept copy: its own libraries, not those where it was built
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(library_dir), env.get("LD_LIBRARY_PATH")) if p)
        refused = await self._child.before_spawn(ctx, self.last_pid) if self._child is not None else None
        if not refused and self._gpu is not None:
            refused = await self._gpu.before_spawn(ctx, self.last_pid)
        if refused:
            return SpawnFailed(refused, fatal=False)
        if self._slots is not None:
            await self._slots.before_spawn(ctx, binary, env)
        # The child set-up's rlimits and the drop to [server].user: the child set-up `bench --spawn` shares.
        setup = ChildSetup(drop, self._child.child_rlimits() if self._child is not None else ())
        try:  # llama-server reads the key file as it starts: read it now too, so both hold one key
            key = await self._lanes[LaneKind.CONFIG].run(lambda: read_api_key(server_cfg), MODEL_CHECK_TIMEOUT_S,
                                                         "reading [server].api_key_file")
        except (CallTimeout, LaneBusy) as exc:  # a hung filesystem: a failure, retried after backoff
            self._emit("blocking_call_timeout", call="reading [server].api_key_file", timeout_s=MODEL_CHECK_TIMEOUT_S,
                       effect="the server is not started now")
            return SpawnFailed(f"server.api_key_file: {exc}", fatal=False)
        except ConfigError as exc:
            return SpawnFailed(exc.lines[0])

        self.cancellable = False  # from here on the answer is Started (or an exec error)
        try:
            server = await asyncio.shield(spawn(argv, env, setup))
        except OSError as exc:
            return SpawnFailed(f"cannot execute {binary}: {exc.strerror or exc}")
        self.live_key = key
        self.last_pid = server.pid
        return Started(server, tuple(argv))
