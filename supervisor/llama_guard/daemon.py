"""``llama-guard run``: the asyncio loop that feeds observations to the policy and executes actions.

Sources (child exit, child output, HTTP probes, signals, timers) put :mod:`policy` inputs on
one queue; the loop calls :func:`policy.decide` and carries out the actions. Signal handlers
only enqueue. Every wait has a deadline on ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from llama_guard import __version__
from llama_guard.argv import build_argv, resolve_binary
from llama_guard.child import ServerProcess, child_environ, kill_and_reap, spawn
from llama_guard.classify import Family, classify
from llama_guard.config import Config, ConfigError, load_config
from llama_guard.eventlog import Emitter
from llama_guard.exitcodes import EXIT_SOFTWARE
from llama_guard.policy import (
    Action,
    Boot,
    Drained,
    Emit,
    ExitDaemon,
    Exited,
    HealthOk,
    Input,
    Kill,
    Line,
    NotifyReady,
    Params,
    ParamsChanged,
    Phase,
    Probe,
    RestartRequest,
    Spawn,
    Spawned,
    SpawnFailed,
    StartDrain,
    State,
    StopRequest,
    Terminate,
    Tick,
    decide,
    initial_state,
)
from llama_guard.probes import ServerProbe
from llama_guard.status import StatusFile

MAX_TICK_S = 1.0  # the loop wakes at least this often (timers, watchdog)


class Notifier:
    """The service-manager hooks the daemon calls; the base class does nothing (no systemd)."""

    def ready(self, status: str) -> None: ...
    def status(self, text: str) -> None: ...
    def reloading(self) -> None: ...
    def stopping(self) -> None: ...
    def watchdog(self) -> None: ...
    def extend_timeout(self, usec: int) -> None: ...


def params_from(config: Config) -> Params:
    """The policy's parameters from a validated configuration."""
    gpu_wanted = config.gpu.enabled != "off" and config.server.n_gpu_layers > 0
    return Params(
        load_timeout_s=config.health.load_timeout_s,
        hang_strikes=config.health.hang_strikes,
        backoff_initial_s=config.recovery.backoff_initial_s,
        backoff_factor=config.recovery.backoff_factor,
        backoff_max_s=config.recovery.backoff_max_s,
        max_restarts=config.recovery.max_restarts,
        restart_window_s=config.recovery.restart_window_s,
        stable_after_s=config.recovery.stable_after_s,
        stop_grace_s=config.recovery.stop_grace_s,
        drain_timeout_s=config.schedule.drain_timeout_s,
        require_gpu=gpu_wanted and config.gpu.require_server_on_gpu,
    )


@dataclass
class _Generation:
    """One llama-server process and the tasks that watch it."""

    server: ServerProcess
    probe: ServerProbe
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    log: TextIO | None = None


class Daemon:
    """Owns one llama-server for the lifetime of ``run()``."""

    def __init__(self, config: Config, config_path: Path, emitter: Emitter, *,
                 notifier: Notifier | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.config_path = config_path
        self.emitter = emitter
        self.notifier = notifier or Notifier()
        self.clock = clock
        self.state: State = initial_state(params_from(config))
        self.queue: asyncio.Queue[Input] = asyncio.Queue()
        self.status_file = StatusFile(config.runtime.dir)
        self._gen: _Generation | None = None
        self._stop_signals = 0
        self._aux: list[asyncio.Task[None]] = []
        self._exit_code: int | None = None

    # ------------------------------------------------------------ entry point

    async def run(self) -> int:
        """Supervise until a stop request or a give-up; returns the exit status."""
        loop = asyncio.get_running_loop()
        for sig, handler in ((signal.SIGTERM, self._on_term), (signal.SIGINT, self._on_term),
                             (signal.SIGHUP, self._on_hup), (signal.SIGUSR1, self._on_usr1)):
            loop.add_signal_handler(sig, handler, sig)
        self.emitter.emit("daemon_started", version=__version__, config_path=str(self.config_path),
                          daemon_pid=os.getpid())
        self._write_status()
        try:
            self.queue.put_nowait(Boot())
            await self._loop()
        except Exception as exc:  # an internal error: the server must still go away
            self.emitter.emit("daemon_exit", exit_code=EXIT_SOFTWARE, reason=f"internal error: {exc!r}")
            self._exit_code = EXIT_SOFTWARE
        finally:
            await self._cleanup()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
                loop.remove_signal_handler(sig)
        return self._exit_code if self._exit_code is not None else EXIT_SOFTWARE

    async def _loop(self) -> None:
        while self._exit_code is None:
            now = self.clock()
            deadline = self.state.next_deadline()
            wait = MAX_TICK_S if deadline is None else max(0.0, min(MAX_TICK_S, deadline - now))
            try:
                event: Input = await asyncio.wait_for(self.queue.get(), timeout=wait)
            except asyncio.TimeoutError:
                event = Tick()
            self.notifier.watchdog()
            await self._step(event)
            # Deadlines that passed while events kept arriving are checked too.
            d = self.state.next_deadline()
            if self._exit_code is None and d is not None and self.clock() >= d:
                await self._step(Tick())

    async def _step(self, event: Input) -> None:
        before = self.state.phase
        self.state, actions = decide(self.state, event, self.clock())
        for action in actions:
            await self._execute(action)
        gen = self._gen
        if isinstance(event, Exited) and gen is not None and gen.server.pid == event.pid:
            self._gen = None
            await self._end_generation(gen)
        if self.state.phase is not before:
            self._write_status()
            self.notifier.status(self.status_line())

    # ------------------------------------------------------------ signals (enqueue only)

    def _on_term(self, sig: int) -> None:
        self._stop_signals += 1
        self.queue.put_nowait(StopRequest(reason=f"{signal.Signals(sig).name} received",
                                          immediate=self._stop_signals > 1))

    def _on_hup(self, _sig: int) -> None:
        self._aux.append(asyncio.ensure_future(self._reload()))

    def _on_usr1(self, _sig: int) -> None:
        self.queue.put_nowait(RestartRequest(reason="SIGUSR1 (llama-guard restart)"))

    # ------------------------------------------------------------ actions

    async def _execute(self, action: Action) -> None:
        if isinstance(action, Emit):
            self.emitter.emit(action.name, **action.fields)
        elif isinstance(action, Spawn):
            await self._spawn()
        elif isinstance(action, Terminate):
            if self._gen is not None and self._gen.server.pid == action.pid:
                self._gen.server.signal_group(signal.SIGTERM)
        elif isinstance(action, Kill):
            if self._gen is not None and self._gen.server.pid == action.pid:
                self._gen.server.signal_group(signal.SIGKILL)
        elif isinstance(action, NotifyReady):
            self._write_status()
            self.notifier.ready(self.status_line())
        elif isinstance(action, StartDrain):
            if self._gen is not None and self._gen.server.pid == action.pid:
                self._gen.tasks.append(asyncio.ensure_future(self._drain(self._gen)))
        elif isinstance(action, ExitDaemon):
            self.emitter.emit("daemon_exit", exit_code=action.code, reason=action.reason)
            self._exit_code = action.code

    async def _spawn(self) -> None:
        server_cfg = self.config.server
        binary = resolve_binary(server_cfg.binary)
        if binary is None:
            self.queue.put_nowait(SpawnFailed(f"llama-server binary {server_cfg.binary!r} not found"))
            return
        argv = build_argv(server_cfg, binary)
        env = child_environ(os.environ, server_cfg.env)
        try:
            server = await spawn(argv, env)
        except OSError as exc:
            self.queue.put_nowait(SpawnFailed(f"cannot execute {binary}: {exc.strerror or exc}"))
            return
        probe = ServerProbe(server_cfg.base_url, timeout_s=self.config.health.timeout_s,
                            canary_timeout_s=self.config.health.canary_timeout_s,
                            canary=self.config.health.canary)
        gen = _Generation(server=server, probe=probe, log=self._open_server_log())
        self._gen = gen
        gen.tasks += [asyncio.ensure_future(self._read_lines(gen)),
                      asyncio.ensure_future(self._watch_health(gen))]
        self.queue.put_nowait(Spawned(server.pid, tuple(argv)))

    def _open_server_log(self) -> TextIO | None:
        path = self.config.log.server_log_file
        if not path:
            return None
        try:
            return open(path, "a", buffering=1, encoding="utf-8")
        except OSError as exc:
            self.emitter.emit("config_error", reason=f"cannot open server_log_file {path}: {exc.strerror}")
            return None

    # ------------------------------------------------------------ per-server sources

    async def _read_lines(self, gen: _Generation) -> None:
        """Every line of the server's output: kept, classified, queued; then the exit status."""
        pid = gen.server.pid
        async for text in gen.server.lines():
            if gen.log is not None:
                with contextlib.suppress(OSError):
                    gen.log.write(text + "\n")
            verdict = classify(text)
            self.emitter.emit("server_line", server_pid=pid, line=text, family=verdict.family.value)
            if verdict.family is not Family.HARMLESS:
                self.queue.put_nowait(Line(pid, verdict, text))
        code = await gen.server.wait()
        self.queue.put_nowait(Exited(pid, code))

    async def _watch_health(self, gen: _Generation) -> None:
        """Readiness polling while STARTING, then liveness rounds while the server serves."""
        pid = gen.server.pid
        health = self.config.health
        while self.state.pid in (None, pid) and self.state.phase is Phase.STARTING:
            if await gen.probe.health():
                self.queue.put_nowait(HealthOk(pid))
                break
            await asyncio.sleep(health.startup_poll_s)
        while self.state.phase is Phase.STARTING and self.state.pid == pid:  # noqa: ASYNC110 - until HealthOk is taken
            await asyncio.sleep(0.01)
        while self.state.pid == pid and self.state.phase in (Phase.READY, Phase.DRAINING):
            await asyncio.sleep(health.interval_s)
            if self.state.pid != pid or self.state.phase not in (Phase.READY, Phase.DRAINING):
                return
            result = await gen.probe.liveness()
            self.queue.put_nowait(Probe(pid, result.health_ok, result.canary_ok, result.busy,
                                        result.progressed, result.detail))

    async def _drain(self, gen: _Generation) -> None:
        pid = gen.server.pid
        timeout = self.config.schedule.drain_timeout_s
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(gen.probe.wait_idle(), timeout)
            self.queue.put_nowait(Drained(pid))

    async def _end_generation(self, gen: _Generation) -> None:
        for task in gen.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.gather(*gen.tasks, return_exceptions=True)
        await gen.probe.aclose()
        if gen.log is not None:
            gen.log.close()

    # ------------------------------------------------------------ reload

    async def _reload(self) -> None:
        self.notifier.reloading()
        try:
            new = await asyncio.to_thread(load_config, self.config_path)
        except ConfigError as exc:
            for line in exc.lines:
                self.emitter.emit("config_error", reason=line + " (keeping the running configuration)")
            self.notifier.ready(self.status_line())
            return
        server_changed = new.server != self.config.server or new.limits != self.config.limits
        changed = [name for name in type(new).model_fields if getattr(new, name) != getattr(self.config, name)]
        self.config = new
        self.emitter.emit("config_reloaded", config_path=str(self.config_path),
                          changed=",".join(changed),
                          changed_text=f" (changed: {', '.join(changed)})" if changed else " (no change)")
        self.queue.put_nowait(ParamsChanged(params_from(new), server_changed))
        self.notifier.ready(self.status_line())

    # ------------------------------------------------------------ status

    def status_line(self) -> str:
        """One human line for sd_notify STATUS= and ``llama-guard status``."""
        s = self.state
        pid = f" pid {s.pid}" if s.pid else ""
        extra = ""
        if s.phase is Phase.BACKOFF and s.deadline is not None:
            extra = f", next start in {max(0.0, s.deadline - self.clock()):.1f} s"
        if s.restarts:
            extra += f", {s.restarts} restarts"
        return f"{s.phase.value}:{pid}{extra}".replace(":,", ",").rstrip(":")

    def snapshot(self) -> dict[str, Any]:
        s = self.state
        return {
            "daemon_pid": os.getpid(),
            "phase": s.phase.value,
            "server_pid": s.pid,
            "base_url": self.config.server.base_url,
            "status": self.status_line(),
            "restarts": s.restarts,
            "recent_failures": len(s.failures),
            "last_failure": s.last_failure,
            "updated": time.time(),
            "events": list(self.emitter.recent)[-10:],
        }

    def _write_status(self) -> None:
        self.status_file.write(self.snapshot())

    # ------------------------------------------------------------ shutdown

    async def _cleanup(self) -> None:
        self.notifier.stopping()
        gen = self._gen
        if gen is not None:
            if gen.server.proc.returncode is None:
                await kill_and_reap(gen.server)
            await self._end_generation(gen)
        for task in self._aux:
            task.cancel()
        await asyncio.gather(*self._aux, return_exceptions=True)
        self.status_file.remove()
