"""The plug-in interface between the daemon loop and its optional watchers (GPU, limits, schedule).

A :class:`Source` observes one kind of thing and reports through :class:`Context`: events to
emit, and policy inputs to queue. The daemon calls the hooks below at fixed points of the
server's life; every hook has a no-op default, and none may block the loop (blocking work goes
to a thread with ``asyncio.to_thread``). A source must never raise out of a hook: the daemon
logs and ignores such an error, but the observation is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llama_guard.config import Config
from llama_guard.core.server_log import LineClass
from llama_guard.core.types import Action, Input, State


@dataclass
class Context:
    """What a source may use: the live config and policy state, emit, post, the clocks."""

    get_config: Callable[[], Config]
    get_state: Callable[[], State]
    emit: Callable[..., None]
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

    async def start(self, ctx: Context) -> str | None:
        """Once, before the first server starts. Return a reason to refuse to run (exit 78)."""
        return None

    async def run(self, ctx: Context) -> None:
        """A long-running task (cancelled at shutdown); the default returns at once."""
        return None

    def preexec(self) -> Callable[[], None] | None:
        """A function to run in the child between fork and exec (async-signal-safe work only)."""
        return None

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

    def on_line(self, ctx: Context, pid: int, verdict: LineClass, text: str) -> None:
        """A classified (non-harmless) server line."""

    def on_action(self, ctx: Context, action: Action) -> None:
        """The daemon is about to carry out the policy's ``action`` (an event to emit, a stop, a
        drain …); ``ctx.state`` is already the state that asked for it. Observe only."""

    def on_reload(self, ctx: Context, old: Config, new: Config) -> None:
        """A validated configuration replaced ``old``."""

    def snapshot(self) -> dict[str, Any] | None:
        """What ``llama-guard status`` should show for this source."""
        return None

    async def close(self) -> None:
        """At shutdown, after the server is gone."""
