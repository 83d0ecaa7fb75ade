"""The action executor: carries out each of the policy's actions for the daemon's loop.

Never awaits: a signal to the server is sent at once; the spawn, the GPU requests
(:mod:`.gpu_requests`) and the facts asked by action (:mod:`.facts`: the port holder, the build)
run as tasks (:mod:`.tasks`) whose answers go on the loop's queue as inputs. One VRAM check runs at
a time: one still running answers for those asked meanwhile.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from llama_guard.config.server import ServerConfig
from llama_guard.core.facts import find_port_holder, read_build
from llama_guard.core.gpu_requests import GpuRequests
from llama_guard.core.lend import LendChannel
from llama_guard.core.offload import Lane, LaneKind
from llama_guard.core.server import ServerWatch
from llama_guard.core.tasks import TaskSet
from llama_guard.model.actions import (
    Action,
    AnswerLend,
    CheckVram,
    ConfirmCompletions,
    Emit,
    ExitDaemon,
    FindPortHolder,
    InspectGpu,
    Kill,
    MeasureSpeed,
    NotifyReady,
    ReadBuild,
    RunReset,
    SaveSlots,
    SignalTune,
    Spawn,
    StartDrain,
    Terminate,
)
from llama_guard.model.inputs import Input


class Executor:
    """Carries out actions: ``emit`` reports, ``post`` queues an answer, ``server`` is the serving
    :class:`ServerWatch` (None between servers; a signal for another pid is dropped),
    ``server_config`` the configured ``[server]`` (whose build a verdict names), ``spawn`` the
    coroutine that starts a server, ``ready`` the readiness announcement, ``exit(code, reason)`` the
    daemon's end and ``measure`` a trial's measurement of a server's decode speed (answers
    :class:`~llama_guard.model.inputs.SpeedMeasured`).
    :attr:`gpu` is set once the loop runs."""

    def __init__(self, emit: Callable[..., None], tasks: TaskSet, post: Callable[[Input], None],
                 lanes: dict[LaneKind, Lane], *, server: Callable[[], ServerWatch | None],
                 server_config: Callable[[], ServerConfig], spawn: Callable[[], Coroutine[Any, Any, None]],
                 ready: Callable[[], None], exit: Callable[[int, str], None],
                 measure: Callable[[MeasureSpeed], Awaitable[Input]] | None = None,
                 lend: LendChannel | None = None) -> None:
        self._emit = emit
        self._tasks = tasks
        self._post = post
        self._lanes = lanes
        self._server = server
        self._server_config = server_config
        self._spawn = spawn
        self._ready = ready
        self._exit = exit
        self._measure = measure
        self._lend = lend
        self.gpu: GpuRequests | None = None
        self.spawn_task: asyncio.Task[None] | None = None
        self._vram_check: asyncio.Task[None] | None = None

    def execute(self, action: Action) -> None:
        gen = self._server()
        if isinstance(action, Emit):
            self._emit(action.name, **action.fields)
        elif isinstance(action, Spawn):
            self.spawn_task = self._tasks.start(self._spawn(), "spawn")
        elif isinstance(action, Terminate):
            if gen is not None and gen.pid == action.pid:
                gen.signal(signal.SIGTERM)
                gen.signal(signal.SIGCONT)  # a stopped (SIGSTOP) server acts on SIGTERM only once continued
        elif isinstance(action, Kill):
            if gen is not None and gen.pid == action.pid:
                gen.signal(signal.SIGKILL)
        elif isinstance(action, NotifyReady):
            self._ready()
        elif isinstance(action, StartDrain):
            if gen is not None and gen.pid == action.pid:
                gen.drain()
        elif isinstance(action, ConfirmCompletions):
            if gen is not None and gen.pid == action.pid:
                gen.confirm()
        elif isinstance(action, SaveSlots):
            if gen is not None and gen.pid == action.pid:
                gen.save_slots()
        elif isinstance(action, (InspectGpu, RunReset)):
            self._tasks.start(self._reset_step(action), "GPU reset")
        elif isinstance(action, FindPortHolder):
            self._tasks.start(self._answer(find_port_holder(action.port, self._lanes[LaneKind.PROC])), "port holder")
        elif isinstance(action, ReadBuild):
            build = read_build(self._server_config(), self._lanes[LaneKind.PROBE])
            self._tasks.start(self._answer(build), "llama-server --version")
        elif isinstance(action, CheckVram):
            # One check at a time: a poll still running answers for the ones asked meanwhile (a
            # slow check must not pile up threads that starve the sampler and the loop).
            if self._vram_check is None or self._vram_check.done():
                self._vram_check = self._tasks.start(self._check_vram(), "VRAM check")
        elif isinstance(action, MeasureSpeed):
            if self._measure is not None:
                self._tasks.start(self._answer(self._measure(action)), "decode speed trial")
        elif isinstance(action, AnswerLend):
            if self._lend is not None:
                self._lend.answer(action)
        elif isinstance(action, SignalTune):
            if self._lend is not None:
                self._lend.signal(action.pid, action.signal)
        elif isinstance(action, ExitDaemon):
            self._exit(action.code, action.reason)

    async def _answer(self, fact: Awaitable[Input]) -> None:
        self._post(await fact)

    async def _check_vram(self) -> None:
        assert self.gpu is not None
        self._post(await self.gpu.check_vram())

    async def _reset_step(self, action: InspectGpu | RunReset) -> None:
        assert self.gpu is not None
        self._post(await self.gpu.reset_step(action))
