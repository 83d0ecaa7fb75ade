"""The interface between the daemon loop and its watchers (GPU, limits, schedule, slots, front door, metrics).

A :class:`Watcher` observes one kind of thing and reports through :class:`Context`: events to
emit, and policy inputs to queue. It is started once, runs (supervised), is told of every step of
the loop (:meth:`Watcher.on_transition`), of each new server process and its exit, and of reloads;
it shows its readings in ``llama-guard status`` (:meth:`Watcher.snapshot`). It decides nothing and
answers nothing: what the daemon asks of a watcher goes through an explicit port
(:mod:`llama_guard.core.ports`, :mod:`llama_guard.core.gpu_port`), handed to the daemon by name.
Every hook has a no-op default, and none may block the loop (blocking work goes to a lane of
:mod:`llama_guard.core.offload`, with a deadline). A watcher must never raise out of a hook: the
daemon logs and ignores such an error, but the observation is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llama_guard.config import Config
from llama_guard.model.inputs import Input
from llama_guard.model.transition import Transition
from llama_guard.model.types import State
from llama_guard.vocab.events import EmitFn


@dataclass
class Context:
    """What a watcher may use: the live config, emit, post, the clocks, and the policy's state before
    the loop's first step (``initial``). The policy's later states come only through the loop's records
    (:meth:`Watcher.on_transition`): a watcher is fed them, it never reads (polls) the live state."""

    get_config: Callable[[], Config]
    emit: EmitFn
    post: Callable[[Input], None]
    post_threadsafe: Callable[[Input], None]
    clock: Callable[[], float]
    loop: asyncio.AbstractEventLoop
    # The API key of [server].api_key_file as last read (start, reload); "" without one.
    get_api_key: Callable[[], str] = lambda: ""
    # The policy's state as the daemon made it, before the loop's first step (a watcher that must act
    # before any record, such as the front door's gate at its start).
    initial: State = field(default_factory=State)

    @property
    def config(self) -> Config:
        return self.get_config()


class Watcher:
    """Base class: observes and posts; override what you need."""

    name = "watcher"

    async def start(self, ctx: Context) -> str | None:
        """Once, before the first server starts. Return a reason to refuse to run (exit 78)."""
        return None

    async def run(self, ctx: Context) -> None:
        """A long-running task (cancelled at shutdown; restarted with backoff when it raises); the
        default returns at once."""
        return None

    def on_spawn(self, ctx: Context, pid: int) -> None:
        """A new server process ``pid`` exists (called as it is started, before its first line)."""

    def on_exit(self, ctx: Context, pid: int, returncode: int | None) -> None:
        """The server process ``pid`` exited with ``returncode`` (negative: the signal's number)."""

    async def before_drained_stop(self, ctx: Context, pid: int) -> None:
        """Server ``pid`` was drained (no request in flight, its slots saved) and gets its SIGTERM when
        every watcher's hook returned (bounded by the caller): finish what is still asking it, ask it
        nothing more, and close idle connections to it — llama-server's graceful exit waits for the
        requests it is answering and for idle keep-alive connections."""

    def on_transition(self, ctx: Context, step: Transition) -> None:
        """The loop took one ``step`` (every input, whether or not the state or phase changed): the
        state before and after, the input, the actions it is about to carry out. Observe only."""

    def on_reload(self, ctx: Context, old: Config, new: Config) -> None:
        """A validated configuration replaced ``old``."""

    def snapshot(self) -> dict[str, Any] | None:
        """What ``llama-guard status`` should show for this watcher (``status.json`` under
        :attr:`name`); None for nothing."""
        return None

    async def close(self) -> None:
        """At shutdown, after the server is gone."""
