"""The plug-in interface between the daemon loop and its optional watchers (GPU, limits, schedule).

A :class:`Source` observes one kind of thing and reports through :class:`Context`: events to
emit, and policy inputs to queue. The daemon calls the hooks below at fixed points of the
server's life; every hook has a no-op default, and none may block the loop (blocking work goes
to a lane of :mod:`llama_guard.core.offload`, with a deadline). A source must never raise out of
a hook: the daemon logs and ignores such an error, but the observation is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llama_guard.config import Config
from llama_guard.core.inputs import Input
from llama_guard.core.transition import Transition
from llama_guard.core.types import State
from llama_guard.vocab.events import EmitFn


@dataclass
class Context:
    """What a source may use: the live config and policy state, emit, post, the clocks."""

    get_config: Callable[[], Config]
    get_state: Callable[[], State]
    emit: EmitFn
    post: Callable[[Input], None]
    post_threadsafe: Callable[[Input], None]
    clock: Callable[[], float]
    loop: asyncio.AbstractEventLoop
    # The API key of [server].api_key_file as last read (start, reload); "" without one.
    get_api_key: Callable[[], str] = lambda: ""

    @property
    def config(self) -> Config:
        return self.get_config()

    @property
    def state(self) -> State:
        return self.get_state()


class Source:
    """Base class: override what you need."""

    name = "source"
    listening: tuple[str, int] | None = None
    """The ``(host, port)`` this source serves on once started (the front door, the exporter)."""

    async def start(self, ctx: Context) -> str | None:
        """Once, before the first server starts. Return a reason to refuse to run (exit 78)."""
        return None

    async def run(self, ctx: Context) -> None:
        """A long-running task (cancelled at shutdown); the default returns at once."""
        return None

    def child_rlimits(self) -> tuple[tuple[int, tuple[int, int]], ...]:
        """``(resource, (soft, hard))`` to set on the next llama-server before its exec (by the
        parent, with prlimit(2): :class:`llama_guard.core.child.ChildSetup`)."""
        return ()

    async def before_spawn(self, ctx: Context, previous_pid: int | None) -> str | None:
        """Bounded preparation before each spawn; return a reason to refuse this start."""
        return None

    def on_spawn(self, ctx: Context, pid: int) -> None:
        """A new server process exists."""

    def on_exit(self, ctx: Context, pid: int, returncode: int | None) -> None:
        """The server process ``pid`` exited."""

    async def ready_check(self, ctx: Context, pid: int) -> str | None:
        """After /health 200: None if the server may be called ready, else the reason it may not."""
        return None

    async def after_drain(self, ctx: Context, pid: int) -> None:
        """A planned restart drained server ``pid`` (no slot processing, clients held); it is
        stopped when every source's hook returned. Bounded by the source itself."""

    async def before_reset_stop(self, ctx: Context, pid: int) -> None:
        """Server ``pid`` is about to be stopped for a GPU reset while it can still answer (the policy
        asked, :class:`~llama_guard.core.actions.SaveSlots`); it is stopped when every source's hook
        returned, or when the policy's bound (``[slots].reset_save_timeout_s``) passed."""

    def on_transition(self, ctx: Context, step: Transition) -> None:
        """The loop took one ``step`` (every input, whether or not the state or phase changed): the
        state before and after, the input, the actions it is about to carry out. ``ctx.state`` is
        already ``step.after``. Observe only."""

    def on_reload(self, ctx: Context, old: Config, new: Config) -> None:
        """A validated configuration replaced ``old``."""

    async def wait_requests_done(self) -> bool:
        """When this source sees every client request to the server (the front door): wait until none
        is in flight, then return True. Else return False at once (the drain asks the server's
        ``/slots`` instead)."""
        return False

    def status_fragment(self) -> str:
        """A short text for sd_notify STATUS= (``GPU 0 61°C 212 W``); empty for nothing."""
        return ""

    def snapshot(self) -> dict[str, Any] | None:
        """What ``llama-guard status`` should show for this source."""
        return None

    async def close(self) -> None:
        """At shutdown, after the server is gone."""
