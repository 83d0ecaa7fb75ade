"""``llama-guard run``: the asyncio loop that feeds observations to the policy and executes actions.

The loop owns the input queue, the policy state and the action executor. The server's tasks in
:mod:`.server`, the watchers, signals and timers put :mod:`.policy` inputs on the queue; the
loop calls :func:`~llama_guard.core.policy.decide`, hands each step to the watchers as one frozen
:class:`~llama_guard.core.transition.Transition` (state before and after, input, actions, time),
then carries out the actions. What the daemon asks of a watcher goes through the ports it is handed
by name (:mod:`.gpu_port`, :mod:`.ports`: the GPU, the child set-up, the KV slots, the front door,
the exporter), each one or none. Signal handlers only
enqueue (SIGHUP too). Every wait has a deadline on ``time.monotonic()``.

The decision step never awaits I/O: the spawn (:mod:`.spawner`), drains, reloads (:mod:`.reload`)
and GPU requests (:mod:`.gpu_requests`) run as tasks (:mod:`.tasks`) that answer through the
queue, so watchdog pings and a stop request are handled within a loop turn (``MAX_TICK_S``)
whatever is waiting. A watcher that raises is reported (``watcher_failed``) and restarted with
backoff; one that keeps failing or a failure in the daemon's own tasks ends it with exit 70
(systemd restarts it). Towards systemd: ``STOPPING=1`` when a stop begins, never ``READY=1`` after
it. The status line and ``status.json`` come from :mod:`llama_guard.output.snapshot`.

One module: the loop, the executor and the reload's apply step share the state the loop owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from llama_guard import __version__
from llama_guard.config import Config, ConfigError
from llama_guard.core.actions import (
    Action,
    CheckVram,
    Emit,
    ExitDaemon,
    FindPortHolder,
    InspectGpu,
    Kill,
    NotifyReady,
    ReadBuild,
    RunReset,
    SaveSlots,
    Spawn,
    StartDrain,
    Terminate,
)
from llama_guard.core.child import kill_and_reap
from llama_guard.core.facts import find_port_holder, read_build
from llama_guard.core.gpu_port import GpuPort
from llama_guard.core.gpu_requests import GpuRequests
from llama_guard.core.inputs import (
    Boot,
    Exited,
    Input,
    ParamsChanged,
    RestartRequest,
    Spawned,
    SpawnFailed,
    StopRequest,
    Tick,
)
from llama_guard.core.model_file import MODEL_CHECK_TIMEOUT_S
from llama_guard.core.offload import PROC_TIMEOUT_S, CallTimeout, LaneBusy, LaneKind, daemon_lanes
from llama_guard.core.params import params_from
from llama_guard.core.policy import decide
from llama_guard.core.ports import ChildSetupPort, FrontPort, Listening, SlotPort
from llama_guard.core.reload import emit_reloaded, load_candidate, port_clash
from llama_guard.core.server import ServerWatch
from llama_guard.core.service import NullNotifier, ServiceNotifier, StartTimeout, StopTimeout
from llama_guard.core.spawner import Spawner, prepare
from llama_guard.core.tasks import TaskSet
from llama_guard.core.transition import Transition
from llama_guard.core.types import AfterStop, State, initial_state
from llama_guard.core.watcher import Context, Watcher
from llama_guard.output.eventlog import Emitter
from llama_guard.output.snapshot import Liveness, RuntimeFiles, snapshot, status_line
from llama_guard.output.status import AlreadyRunning
from llama_guard.vocab.exitcodes import EXIT_CONFIG, EXIT_OK, EXIT_SOFTWARE
from llama_guard.vocab.phases import Phase

MAX_TICK_S = 1.0  # the loop wakes at least this often (timers, watchdog)
STATUS_REFRESH_S = 2.0  # the status file is rewritten at least this often (the watchers' current readings)
TASK_CANCEL_TIMEOUT_S = 5.0  # at shutdown: how long the daemon's tasks may take to end
WATCHER_CLOSE_TIMEOUT_S = 10.0  # at shutdown: how long each watcher's close() may take
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
PREPARE_CALL = "reading the API key file and the [server].user account"  # the start's blocking call


@dataclass(frozen=True)
class ReloadRequest(Input):
    """SIGHUP: reload the configuration file. Queued like every signal; handled by the daemon."""


class Daemon:
    """Owns one llama-server at a time for the lifetime of ``run()``."""

    def __init__(self, config: Config, config_path: Path, emitter: Emitter, *,
                 notifier: ServiceNotifier | None = None, watchers: list[Watcher] | None = None,
                 gpu: GpuPort | None = None, child: ChildSetupPort | None = None, slots: SlotPort | None = None,
                 front: FrontPort | None = None, exporter: Listening | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``watchers``: each started in this order, supervised, told of every step. The ports, each
        None when absent (a port that is a watcher is among ``watchers`` too): ``gpu``, the GPU port
        (None: no GPU watched); ``child``, the child set-up (rlimits and its check before each
        spawn); ``slots``, the KV slot carry-over; ``front``, the front door (the drain's count of
        requests in flight); ``exporter``, the metrics listener. ``front`` and ``exporter`` name the
        addresses a reload must not give llama-server."""
        self.config = config
        self.config_path = config_path
        self.emitter = emitter
        self.notifier: ServiceNotifier = notifier or NullNotifier()
        self.watchers: list[Watcher] = list(watchers or [])
        self.gpu = gpu
        self.slots = slots
        self.front = front
        self.listeners: tuple[Listening, ...] = tuple(p for p in (front, exporter) if p is not None)
        self.clock = clock
        self.state: State = initial_state(params_from(config))
        self.queue: asyncio.Queue[Input] = asyncio.Queue()
        self.runtime = RuntimeFiles(config.runtime.dir, emitter.emit)
        self.tasks = TaskSet(emitter.emit, self._fail, clock)
        # Blocking calls, each kind on a lane of its own: one stuck call starves nothing else.
        self.lanes = daemon_lanes()
        self.spawner = Spawner(emitter.emit, self.lanes, clock, child=child, gpu=gpu, slots=slots)
        self.start_timeout = StartTimeout(self.notifier, clock)
        self.stop_timeout = StopTimeout(self.notifier, clock)
        self.ctx: Context | None = None
        self._gpu: GpuRequests | None = None
        self._gen: ServerWatch | None = None
        self._stop_signals = 0
        self._stop_asked = asyncio.Event()  # set by SIGTERM/SIGINT: ends a watcher's start that waits
        self._spawn_task: asyncio.Task[None] | None = None
        self._reload_task: asyncio.Task[None] | None = None
        self._vram_check: asyncio.Task[None] | None = None
        self._stopping_sent = False
        self._exit_code: int | None = None
        self._status_at = float("-inf")
        self._reset_possible = False

    def _fail(self, reason: str) -> None:
        """End the daemon with exit 70 (EXIT_SOFTWARE): systemd restarts it. The server is stopped."""
        if self._exit_code is None:
            self.emitter.emit("daemon_exit", exit_code=EXIT_SOFTWARE, reason=reason)
            self._exit_code = EXIT_SOFTWARE
            self.queue.put_nowait(Tick())  # wake the loop

    def _post_threadsafe(self, event: Input) -> None:
        assert self.ctx is not None
        self.ctx.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def _for_watchers(self, hook: str, call: Callable[[Watcher, Context], None]) -> None:
        """Call the synchronous ``hook`` (named for the report) of every watcher through ``call``;
        a failing watcher is reported, not fatal."""
        assert self.ctx is not None
        for watcher in self.watchers:
            try:
                call(watcher, self.ctx)
            except Exception as exc:
                self.emitter.emit("config_error", reason=f"{watcher.name}.{hook} failed: {exc!r}")

    async def _before_drained_stop(self, pid: int) -> None:
        """Every watcher's :meth:`~Watcher.before_drained_stop` for drained server ``pid``, side by side;
        a failing watcher is reported, not fatal (the caller bounds the whole)."""
        assert self.ctx is not None
        ctx = self.ctx
        results = await asyncio.gather(*(w.before_drained_stop(ctx, pid) for w in self.watchers),
                                       return_exceptions=True)
        for watcher, result in zip(self.watchers, results, strict=True):
            if isinstance(result, Exception):
                self.emitter.emit("config_error", reason=f"{watcher.name}.before_drained_stop failed: {result!r}")

    # ------------------------------------------------------------ entry point

    async def run(self) -> int:
        """Supervise until a stop request or a give-up; returns the exit status.

        Refuses (exit 78, no server started) when another daemon holds the runtime directory's
        lock, when ``[server].api_key_file`` cannot be read, or when llama-server could not be
        started as ``[server].user``.
        """
        try:
            ports = self._ports()
            await self.lanes[LaneKind.PROC].run(lambda: self.runtime.acquire(ports), PROC_TIMEOUT_S,
                                                "the runtime directory's lock")
        except (AlreadyRunning, OSError, CallTimeout, LaneBusy) as exc:
            reason = str(exc) if not isinstance(exc, OSError) else (
                f"cannot lock the runtime directory {self.config.runtime.dir}: {exc.strerror or exc}")
            self.emitter.emit("config_error", reason=reason)
            self.emitter.emit("daemon_exit", exit_code=EXIT_CONFIG, reason=reason)
            return EXIT_CONFIG
        try:
            return await self._run_locked()
        finally:
            self.runtime.release()

    def _ports(self) -> dict[str, int]:
        """The TCP ports only this instance may serve (a second daemon of it is refused by them)."""
        front = self.config.front.address
        return {"llama-server's port": self.config.server.port,
                **({"the front door's port": front[1]} if front is not None else {})}

    def _warn_unauthenticated(self, config: Config) -> None:
        if not config.server.loopback and not config.server.api_key_file:
            self.emitter.emit("server_unauthenticated", host=config.server.host, port=config.server.port)

    def _refuse(self, reason: str) -> int:
        self.emitter.emit("daemon_exit", exit_code=EXIT_CONFIG, reason=reason)
        self._exit_code = EXIT_CONFIG
        return EXIT_CONFIG

    async def _run_locked(self) -> int:
        loop = asyncio.get_running_loop()
        for sig, handler in ((signal.SIGTERM, self._on_term), (signal.SIGINT, self._on_term),
                             (signal.SIGHUP, self._on_hup), (signal.SIGUSR1, self._on_usr1)):
            loop.add_signal_handler(sig, handler, sig)
        self.emitter.emit("daemon_started", version=__version__, config_path=str(self.config_path),
                          daemon_pid=os.getpid())
        self.ctx = Context(get_config=lambda: self.config, get_state=lambda: self.state,
                           emit=self.emitter.emit, post=self.queue.put_nowait,
                           post_threadsafe=self._post_threadsafe, clock=self.clock, loop=loop,
                           get_api_key=lambda: self.spawner.live_key)
        self._gpu = GpuRequests(self.ctx, self.gpu)
        self._write_status()
        try:
            try:
                _, self.spawner.identity = await self.lanes[LaneKind.CONFIG].run(
                    lambda: prepare(self.config, self.config_path), MODEL_CHECK_TIMEOUT_S, PREPARE_CALL)
            except (CallTimeout, LaneBusy) as exc:  # a hung mount at start: nothing can run
                self.emitter.emit("blocking_call_timeout", call=PREPARE_CALL, timeout_s=MODEL_CHECK_TIMEOUT_S,
                                  effect="the daemon does not start")
                return self._refuse(str(exc))
            except ConfigError as exc:
                for line in exc.lines:
                    self.emitter.emit("config_error", reason=line)
                return self._refuse(exc.lines[0])
            self._warn_unauthenticated(self.config)
            for watcher in self.watchers:
                refusal = await self._start_watcher(watcher)
                if refusal is None:
                    self.emitter.emit("daemon_exit", exit_code=EXIT_OK, reason="stopped before llama-server started")
                    self._exit_code = EXIT_OK
                    return EXIT_OK
                if refusal:
                    self.emitter.emit("server_boot_failure", cause=refusal)
                    return self._refuse(refusal)
                self.tasks.start(self.tasks.supervise(watcher, self.ctx), f"watcher {watcher.name}")
            self._reset_possible = self.gpu is not None and self.gpu.can_reset
            self.state = replace(self.state, params=params_from(self.config, reset_possible=self._reset_possible))
            self.queue.put_nowait(Boot())
            await self._loop()
        except Exception as exc:  # an internal error: the server must still go away
            self.emitter.emit("daemon_exit", exit_code=EXIT_SOFTWARE, reason=f"internal error: {exc!r}")
            self._exit_code = EXIT_SOFTWARE
        finally:
            await self._cleanup()
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
        return self._exit_code if self._exit_code is not None else EXIT_SOFTWARE

    async def _start_watcher(self, watcher: Watcher) -> str | None:
        """``watcher.start`` (which may wait, e.g. for a taken port), given up when a stop is asked
        meanwhile: its refusal ("" for none), or None when the stop came first."""
        assert self.ctx is not None
        start = asyncio.ensure_future(watcher.start(self.ctx))
        stop = asyncio.ensure_future(self._stop_asked.wait())
        await asyncio.wait((start, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if start.done():
            return start.result() or ""
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await start
        return None

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
        """One decision: the policy's answer carried out. Never awaits I/O: every wait (the spawn
        and its pre-spawn checks, drains, reloads, resets, a process exit) runs as a task."""
        if isinstance(event, ReloadRequest):
            self._begin_reload()
            return
        if isinstance(event, StopRequest):
            self._send_stopping()
            self._cancel_pending_spawn()
        before, now = self.state, self.clock()
        self.state, actions = decide(before, event, now)
        step = Transition(before, self.state, event, tuple(actions), now)
        self._for_watchers("on_transition", lambda src, ctx: src.on_transition(ctx, step))
        if self.state.phase is Phase.EXITED or (self.state.phase is Phase.STOPPING
                                                and self.state.after_stop is AfterStop.EXIT):
            self._send_stopping()
        for action in actions:
            self._execute(action)
        gen = self._gen
        if isinstance(event, Exited) and gen is not None and gen.pid == event.pid:
            self._gen = None
            pid, code = event.pid, event.returncode
            self._for_watchers("on_exit", lambda src, ctx: src.on_exit(ctx, pid, code))
            self.tasks.start(gen.end(), "end of a server")
        if self.state.phase is not before.phase:
            self._write_status()
            self.notifier.status(self._status_line())
            if self.state.phase is Phase.STARTING:
                self.start_timeout.extend()
        elif self.clock() - self._status_at >= STATUS_REFRESH_S:
            self._write_status()
        if self.state.phase is Phase.WAITING_VRAM:
            self.start_timeout.extend()  # a bounded wait for VRAM is no stuck start (TimeoutStartSec)
        if self._stopping_sent:
            self.stop_timeout.extend(self.state)  # a stop waiting for a reset is no stuck stop

    def _send_stopping(self) -> None:
        """``STOPPING=1`` once, when a stop of the daemon begins; no ``READY=1`` after it."""
        if not self._stopping_sent:
            self._stopping_sent = True
            self.notifier.stopping(self._status_line())

    def _ready(self) -> None:
        if not self._stopping_sent:
            self.notifier.ready(self._status_line())

    # ------------------------------------------------------------ signals (enqueue only)

    def _on_term(self, sig: int) -> None:
        self._stop_signals += 1
        self._stop_asked.set()
        self.queue.put_nowait(StopRequest(reason=f"{signal.Signals(sig).name} received",
                                          immediate=self._stop_signals > 1))

    def _on_hup(self, _sig: int) -> None:
        self.queue.put_nowait(ReloadRequest())

    def _on_usr1(self, _sig: int) -> None:
        self.queue.put_nowait(RestartRequest(reason="SIGUSR1 (llama-guard restart)"))

    # ------------------------------------------------------------ actions

    def _execute(self, action: Action) -> None:
        gen = self._gen
        if isinstance(action, Emit):
            self.emitter.emit(action.name, **action.fields)
        elif isinstance(action, Spawn):
            self._spawn_task = self.tasks.start(self._spawn(), "spawn")
        elif isinstance(action, Terminate):
            if gen is not None and gen.pid == action.pid:
                gen.signal(signal.SIGTERM)
                gen.signal(signal.SIGCONT)  # a stopped (SIGSTOP) server acts on SIGTERM only once continued
        elif isinstance(action, Kill):
            if gen is not None and gen.pid == action.pid:
                gen.signal(signal.SIGKILL)
        elif isinstance(action, NotifyReady):
            self._write_status()
            self._ready()
        elif isinstance(action, StartDrain):
            if gen is not None and gen.pid == action.pid:
                gen.drain()
        elif isinstance(action, SaveSlots):
            if gen is not None and gen.pid == action.pid:
                gen.save_slots()
        elif isinstance(action, (InspectGpu, RunReset)):
            self.tasks.start(self._reset_step(action), "GPU reset")
        elif isinstance(action, FindPortHolder):
            self.tasks.start(self._answer(find_port_holder(action.port, self.lanes[LaneKind.PROC])), "port holder")
        elif isinstance(action, ReadBuild):
            build = read_build(self.config.server.binary, self.lanes[LaneKind.PROBE])
            self.tasks.start(self._answer(build), "llama-server --version")
        elif isinstance(action, CheckVram):
            # One check at a time: a poll still running answers for the ones asked meanwhile (a
            # slow check must not pile up threads that starve the sampler and the loop).
            if self._vram_check is None or self._vram_check.done():
                self._vram_check = self.tasks.start(self._check_vram(), "VRAM check")
        elif isinstance(action, ExitDaemon):
            self.emitter.emit("daemon_exit", exit_code=action.code, reason=action.reason)
            self._exit_code = action.code

    async def _answer(self, fact: Awaitable[Input]) -> None:
        self.queue.put_nowait(await fact)

    async def _check_vram(self) -> None:
        assert self._gpu is not None
        self.queue.put_nowait(await self._gpu.check_vram())

    async def _reset_step(self, action: InspectGpu | RunReset) -> None:
        assert self._gpu is not None
        self.queue.put_nowait(await self._gpu.reset_step(action))

    def _cancel_pending_spawn(self) -> None:
        """A stop while the spawn still waits in its pre-spawn checks: abandon them (the task then
        answers SpawnFailed), so the stop is honoured at once rather than after the wait."""
        if self._spawn_task is not None and not self._spawn_task.done() and self.spawner.cancellable:
            self._spawn_task.cancel()

    async def _spawn(self) -> None:
        """Start one server and its watch; always answers Spawned or SpawnFailed (a task)."""
        assert self.ctx is not None
        try:
            outcome = await self.spawner.start(self.config, self.ctx)
        except asyncio.CancelledError:
            self.queue.put_nowait(SpawnFailed("stop requested before the server started", fatal=False))
            return
        if isinstance(outcome, SpawnFailed):
            self.queue.put_nowait(outcome)
            return
        spawner = self.spawner
        gen = ServerWatch(outcome.server, self.ctx, self.lanes, self.tasks, self.start_timeout,
                          get_key=lambda: spawner.live_key, gpu=self.gpu, slots=self.slots, front=self.front,
                          before_drained_stop=self._before_drained_stop)
        self._gen = gen
        gen.start()
        self.queue.put_nowait(Spawned(gen.pid, outcome.argv))
        self._for_watchers("on_spawn", lambda src, ctx: src.on_spawn(ctx, gen.pid))

    # ------------------------------------------------------------ reload

    def _begin_reload(self) -> None:
        """A queued SIGHUP: ignored (with an event) during a stop or while a reload runs."""
        if self._stopping_sent or self.state.phase in (Phase.EXITED,) or self._exit_code is not None:
            self.emitter.emit("reload_ignored", reason="llama-guard is stopping")
            return
        if self._reload_task is not None and not self._reload_task.done():
            self.emitter.emit("reload_ignored", reason="a reload is still running")
            return
        self._reload_task = self.tasks.start(self._reload(), "reload")

    async def _reload(self) -> None:
        """SIGHUP: validate the file, refuse one the server could not start with, apply the rest;
        always ends with READY=1 unless a stop began meanwhile."""
        self.notifier.reloading()
        candidate = await load_candidate(self.config_path, self.lanes, self.emitter.emit)
        if candidate is None:
            self._ready()
            return
        if self._stopping_sent:
            self.emitter.emit("reload_ignored", reason="llama-guard began stopping during the reload")
            return
        clash = port_clash(candidate.config, [listener.listening for listener in self.listeners])
        if clash:
            self.emitter.emit("config_error", reason=f"{self.config_path}: {clash} (keeping the running configuration)")
            self._ready()
            return
        old, new = self.config, candidate.config
        # A new key (same file, new content) reaches llama-server only by a (drained) restart.
        server_changed = (new.server != old.server or new.limits != old.limits
                          or candidate.key != self.spawner.live_key)
        self.config = new
        self.spawner.identity = candidate.identity
        if new.log.level != old.log.level:
            self.emitter.set_level(new.log.level)
        if new.runtime.dir != old.runtime.dir:
            problem = self.runtime.switch(new.runtime.dir)
            if problem:
                self.emitter.emit("config_error", reason=f"[runtime].dir: {problem}; keeping {old.runtime.dir}")
            else:
                self._write_status()
        if (new.server.host, new.server.api_key_file) != (old.server.host, old.server.api_key_file):
            self._warn_unauthenticated(new)
        self._for_watchers("on_reload", lambda src, ctx: src.on_reload(ctx, old, new))
        emit_reloaded(self.emitter.emit, self.config_path, old, new, key_changed=candidate.key != self.spawner.live_key)
        self.queue.put_nowait(ParamsChanged(params_from(new, reset_possible=self._reset_possible),
                                            server_changed))
        self._ready()

    # ------------------------------------------------------------ status

    def _liveness(self) -> Liveness | None:
        gen = self._gen
        if gen is None or gen.answering is None:
            return None
        return Liveness(gen.answering, gen.probe.silent_s())

    def _status_line(self) -> str:
        tps = self._gen.last_eval_tps if self._gen is not None else None
        return status_line(self.state, self.clock(), tps, self._gpu_fragment(), self._liveness())

    def _gpu_fragment(self) -> str:
        """The GPU port's part of the status line; empty without one or when it fails."""
        if self.gpu is None:
            return ""
        try:
            return self.gpu.status_fragment()
        except Exception:
            return ""

    def _write_status(self) -> None:
        self._status_at = self.clock()
        self.runtime.write(snapshot(self.state, self._status_line(), self.config.server.base_url,
                                    list(self.emitter.recent), self.watchers, self._liveness()))

    # ------------------------------------------------------------ shutdown

    async def _cleanup(self) -> None:
        """Stop everything, each wait bounded: the server (SIGKILL, reaped), the tasks, the watchers."""
        self._send_stopping()
        gen = self._gen
        if gen is not None:
            if gen.server.proc.returncode is None:
                await kill_and_reap(gen.server)
            await gen.end()
        await self.tasks.cancel_all(TASK_CANCEL_TIMEOUT_S)
        for watcher in self.watchers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watcher.close(), WATCHER_CLOSE_TIMEOUT_S)
        self.runtime.status_file.remove()
