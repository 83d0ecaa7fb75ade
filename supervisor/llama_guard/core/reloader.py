"""A reload's apply step (SIGHUP, queued like every signal): one reload at a time, run as a task
(:mod:`.tasks`) so the decision step never waits for it.

The candidate file is loaded and checked by :func:`~llama_guard.core.reload.load_candidate` on
the ``config`` lane; one that could not start a server, or that would give llama-server a port
this daemon listens on (:func:`~llama_guard.core.reload.port_clash`), is refused with
``config_error`` and the running configuration stays; so is one whose llama-server build (or ``[server]``) fails its
preflight through the build port (:class:`~llama_guard.core.ports.BuildPort`: reported by the port,
the running server goes on serving). An accepted one replaces it: the log level,
``[runtime].dir`` (the status file moves; a directory that cannot be used is a ``config_error``
and the old one stays), the watchers' ``on_reload``, ``config_reloaded``, and new policy
parameters (``ParamsChanged``; a changed ``[server]``, ``[limits]`` or API key restarts the
server, drained). Towards systemd: ``RELOADING=1``, then ``READY=1`` unless a stop began meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from llama_guard.config import Config
from llama_guard.core.announcer import Announcer
from llama_guard.core.offload import Lane, LaneKind
from llama_guard.core.ports import BuildPort, Listening, ReloadBuild
from llama_guard.core.reload import emit_reloaded, load_candidate, port_clash
from llama_guard.core.spawner import Spawner
from llama_guard.core.tasks import TaskSet
from llama_guard.model.inputs import Input, ParamsChanged
from llama_guard.model.params import params_from
from llama_guard.output.eventlog import Emitter


def warn_unauthenticated(emit: Callable[..., None], config: Config) -> None:
    """``server_unauthenticated`` when llama-server listens beyond loopback without an API key."""
    if not config.server.loopback and not config.server.api_key_file:
        emit("server_unauthenticated", host=config.server.host, port=config.server.port)


class Reloader:
    """Reloads ``config_path`` into the daemon: ``get_config``/``set_config`` are the daemon's
    configuration, ``on_reload(old, new)`` tells the watchers, ``post`` queues the policy's new
    parameters, ``reset_possible`` whether a GPU reset can be verified (a parameter), ``builds`` the
    build port (None: no preflight of a new build)."""

    def __init__(self, config_path: Path, emitter: Emitter, lanes: dict[LaneKind, Lane], tasks: TaskSet,
                 spawner: Spawner, announcer: Announcer, listeners: Sequence[Listening], *,
                 get_config: Callable[[], Config], set_config: Callable[[Config], None],
                 on_reload: Callable[[Config, Config], None], post: Callable[[Input], None],
                 reset_possible: Callable[[], bool], builds: BuildPort | None = None) -> None:
        self.config_path = config_path
        self._emitter = emitter
        self._lanes = lanes
        self._tasks = tasks
        self._spawner = spawner
        self._announcer = announcer
        self._listeners = listeners
        self._get_config = get_config
        self._set_config = set_config
        self._on_reload = on_reload
        self._post = post
        self._reset_possible = reset_possible
        self._builds = builds
        self.task: asyncio.Task[None] | None = None

    def begin(self, *, ending: bool) -> None:
        """A queued SIGHUP: ignored (with an event) during a stop (``ending``: the daemon is about to
        exit) or while a reload runs."""
        if ending or self._announcer.stopping_sent:
            self._emitter.emit("reload_ignored", reason="llama-guard is stopping")
            return
        if self.task is not None and not self.task.done():
            self._emitter.emit("reload_ignored", reason="a reload is still running")
            return
        self.task = self._tasks.start(self.reload(), "reload")

    async def reload(self) -> None:
        """Validate the file, refuse one the server could not start with, apply the rest; always
        ends with READY=1 unless a stop began meanwhile."""
        announcer, emit = self._announcer, self._emitter.emit
        announcer.notifier.reloading()
        candidate = await load_candidate(self.config_path, self._lanes, emit)
        if candidate is None:
            announcer.ready()
            return
        if announcer.stopping_sent:
            emit("reload_ignored", reason="llama-guard began stopping during the reload")
            return
        clash = port_clash(candidate.config, [listener.listening for listener in self._listeners])
        if clash:
            emit("config_error", reason=f"{self.config_path}: {clash} (keeping the running configuration)")
            announcer.ready()
            return
        old, new = self._get_config(), candidate.config
        build = await self._builds.vet_reload(old, new) if self._builds is not None else ReloadBuild.SAME
        if build is ReloadBuild.REFUSED:
            announcer.ready()
            return
        if announcer.stopping_sent:
            emit("reload_ignored", reason="llama-guard began stopping during the reload")
            return
        old = self._get_config()
        key_changed = candidate.key != self._spawner.live_key
        # A new key (same file, new content) or a new build at the same path reaches llama-server only
        # by a (drained) restart.
        server_changed = (new.server != old.server or new.limits != old.limits or key_changed
                          or build is ReloadBuild.NEW)
        self._set_config(new)
        self._spawner.identity = candidate.identity
        if new.log.level != old.log.level:
            self._emitter.set_level(new.log.level)
        if new.runtime.dir != old.runtime.dir:
            problem = announcer.runtime.switch(new.runtime.dir)
            if problem:
                emit("config_error", reason=f"[runtime].dir: {problem}; keeping {old.runtime.dir}")
            else:
                announcer.write()
        if (new.server.host, new.server.api_key_file) != (old.server.host, old.server.api_key_file):
            warn_unauthenticated(emit, new)
        self._on_reload(old, new)
        emit_reloaded(emit, self.config_path, old, new, key_changed=key_changed)
        self._post(ParamsChanged(params_from(new, reset_possible=self._reset_possible()), server_changed,
                                 new_build=build is ReloadBuild.NEW))
        announcer.ready()
