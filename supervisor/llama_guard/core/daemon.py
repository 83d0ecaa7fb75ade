"""``llama-guard run``: the asyncio loop that feeds observations to the policy and executes actions.

The loop owns the input queue, the policy state and the serving server's watch. The server's tasks
in :mod:`.server`, the watchers, signals and timers put :mod:`.policy` inputs on the queue; the
loop calls :func:`~llama_guard.model.policy.decide`, hands each step to the watchers as one frozen
:class:`~llama_guard.model.transition.Transition` (state before and after, input, actions, time),
then has :class:`~llama_guard.core.executor.Executor` carry out the actions. What the daemon asks
of a watcher goes through the ports it is handed by name (:mod:`.gpu_port`, :mod:`.ports`: the GPU,
the child set-up, the KV slots, the front door, the exporter), each one or none. Signal handlers
only enqueue (SIGHUP too). Every wait has a deadline on ``time.monotonic()``.

The decision step never awaits I/O: the spawn (:mod:`.spawner`), drains, reloads (:mod:`.reloader`)
and GPU requests (:mod:`.gpu_requests`) run as tasks (:mod:`.tasks`) that answer through the
queue, so watchdog pings and a stop request are handled within a loop turn (``MAX_TICK_S``)
whatever is waiting. A watcher that raises is reported (``watcher_failed``) and restarted with
backoff; one that keeps failing or a failure in the daemon's own tasks ends it with exit 70
(systemd restarts it). The status line, ``status.json`` and ``READY=1``/``STOPPING=1`` towards
systemd come from :class:`~llama_guard.core.announcer.Announcer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from llama_guard import __version__
from llama_guard.config import Config, ConfigError
from llama_guard.core.announcer import Announcer
from llama_guard.core.child import kill_and_reap
from llama_guard.core.executor import Executor
from llama_guard.core.gpu_port import GpuPort
from llama_guard.core.gpu_requests import GpuRequests
from llama_guard.core.lend import LendChannel
from llama_guard.core.model_file import MODEL_CHECK_TIMEOUT_S
from llama_guard.core.offload import PROC_TIMEOUT_S, CallTimeout, LaneBusy, LaneKind, daemon_lanes
from llama_guard.core.ports import BuildPort, ChildSetupPort, FrontPort, Listening, SlotPort
from llama_guard.core.reloader import Reloader, warn_unauthenticated
from llama_guard.core.server import ServerWatch
from llama_guard.core.service import NullNotifier, ServiceNotifier, StartTimeout, StopTimeout
from llama_guard.core.spawner import Spawner, prepare
from llama_guard.core.tasks import TaskSet
from llama_guard.model.actions import MeasureSpeed
from llama_guard.model.inputs import (
    Boot,
    Exited,
    Input,
    RestartRequest,
    Spawned,
    SpawnFailed,
    SpeedMeasured,
    StopRequest,
    Tick,
)
from llama_guard.model.params import params_from
from llama_guard.model.policy import decide
from llama_guard.model.transition import Transition
from llama_guard.model.types import AfterStop, State, initial_state
from llama_guard.model.watcher import Context, Watcher
from llama_guard.output.eventlog import Emitter
from llama_guard.status.snapshot import RuntimeFiles
from llama_guard.status.status import AlreadyRunning
from llama_guard.vocab.exitcodes import EXIT_CONFIG, EXIT_OK, EXIT_SOFTWARE
from llama_guard.vocab.phases import Phase

MAX_TICK_S = 1.0  # the loop wakes at least this often (timers, watchdog)
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
                 front: FrontPort | None = None, exporter: Listening | None = None, builds: BuildPort | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``watchers``: each started in this order, supervised, told of every step. The ports, each
        None when absent (a port that is a watcher is among ``watchers`` too): ``gpu``, the GPU port
        (None: no GPU watched); ``child``, the child set-up (rlimits and its check before each
        spawn); ``slots``, the KV slot carry-over; ``front``, the front door (the drain's count of
        requests in flight); ``exporter``, the metrics listener; ``builds``, llama-server builds (the
        preflight of a new one, which executable each start runs). ``front`` and ``exporter`` name the
        addresses a reload must not give llama-server."""
        self.config = config
        self.config_path = config_path
        self.emitter = emitter
        self.notifier: ServiceNotifier = notifier or NullNotifier()
        self.watchers: list[Watcher] = list(watchers or [])
        self.gpu = gpu
        self.slots = slots
        self.front = front
        self.builds = builds
        self.clock = clock
        self.state: State = initial_state(params_from(config))
        self.queue: asyncio.Queue[Input] = asyncio.Queue()
        self.runtime = RuntimeFiles(config.runtime.dir, emitter.emit)
        self.tasks = TaskSet(emitter.emit, self._fail, clock)
        # Blocking calls, each kind on a lane of its own: one stuck call starves nothing else.
        self.lanes = daemon_lanes()
        self.spawner = Spawner(emitter.emit, self.lanes, clock, child=child, gpu=gpu, slots=slots, builds=builds)
        self.start_timeout = StartTimeout(self.notifier, clock)
        self.stop_timeout = StopTimeout(self.notifier, clock)
        self.ctx: Context | None = None
        self._gen: ServerWatch | None = None
        self._stop_signals = 0
        self._stop_asked = asyncio.Event()  # set by SIGTERM/SIGINT: ends a watcher's start that waits
        self._exit_code: int | None = None
        self._reset_possible = False
        self.status = Announcer(self.notifier, self.runtime, emitter, self.watchers, gpu, clock,
                                state=lambda: self.state, config=lambda: self.config, server=lambda: self._gen)
        # The window channel of `llama-guard tune` (its socket opened in [runtime].dir by run()).
        self.lend = LendChannel(config_path, emitter.emit, self.queue.put_nowait, self._reload_for_lend)
        self.executor = Executor(emitter.emit, self.tasks, self.queue.put_nowait, self.lanes,
                                 server=lambda: self._gen, server_config=lambda: self.config.server,
                                 spawn=self._spawn, ready=self._ready, exit=self._exit, measure=self._measure,
                                 lend=self.lend)
        self.reloader = Reloader(config_path, emitter, self.lanes, self.tasks, self.spawner, self.status,
                                 tuple(p for p in (front, exporter) if p is not None),
                                 get_config=lambda: self.config, set_config=self._set_config,
                                 on_reload=self._on_reload, post=self.queue.put_nowait,
                                 reset_possible=lambda: self._reset_possible, builds=builds)

    def _set_config(self, config: Config) -> None:
        self.config = config

    def _on_reload(self, old: Config, new: Config) -> None:
        self._for_watchers("on_reload", lambda src, ctx: src.on_reload(ctx, old, new))

    async def _measure(self, action: MeasureSpeed) -> Input:
        """A trial's measurement of server ``action.pid`` through the build port (a trial is asked only
        when the build port named a new build)."""
        if self.builds is None or self.ctx is None:
            return SpeedMeasured(action.pid, None, "no build port")
        return await self.builds.measure_speed(self.ctx, action.pid, action.runs, action.tokens)

    async def _reload_for_lend(self) -> None:
        """A window lent to tune ends and the configuration file changed (``tune --apply``): reload it
        now (a reload under way is awaited instead), so that the next server starts from it."""
        self.reloader.begin(ending=self._exit_code is not None)
        task = self.reloader.task
        if task is not None:
            await asyncio.wait({task})

    def _ready(self) -> None:
        self.status.write()
        self.status.ready()

    def _exit(self, code: int, reason: str) -> None:
        self.emitter.emit("daemon_exit", exit_code=code, reason=reason)
        self._exit_code = code

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

    def _refuse(self, reason: str) -> int:
        self._exit(EXIT_CONFIG, reason)
        return EXIT_CONFIG

    async def _run_locked(self) -> int:
        loop = asyncio.get_running_loop()
        for sig, handler in ((signal.SIGTERM, self._on_term), (signal.SIGINT, self._on_term),
                             (signal.SIGHUP, self._on_hup), (signal.SIGUSR1, self._on_usr1)):
            loop.add_signal_handler(sig, handler, sig)
        self.emitter.emit("daemon_started", version=__version__, config_path=str(self.config_path),
                          daemon_pid=os.getpid())
        self.ctx = Context(get_config=lambda: self.config,
                           emit=self.emitter.emit, post=self.queue.put_nowait,
                           post_threadsafe=self._post_threadsafe, clock=self.clock, loop=loop,
                           get_api_key=lambda: self.spawner.live_key, initial=self.state)
        self.executor.gpu = GpuRequests(self.ctx, self.gpu)
        self.status.write()
        try:
            await self.lend.open(self.config.runtime.dir)
        except OSError as exc:  # tune then finds no socket and says so; the daemon serves on
            self.emitter.emit("config_error", reason=f"cannot listen on {self.config.runtime.dir}/tune.sock for "
                                                     f"llama-guard tune: {exc.strerror or exc}")
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
            warn_unauthenticated(self.emitter.emit, self.config)
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
            # What start-up made (modules, the configuration, the watchers: ~60,000 objects) lives as long
            # as the daemon: kept out of the cyclic collector, whose full collections then walk only
            # what running makes (one over everything: ~35 ms on a 2-core host, a request's latency
            # when it strikes). gc.freeze in the gc module's documentation.
            gc.freeze()
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
            self.reloader.begin(ending=self.state.phase is Phase.EXITED or self._exit_code is not None)
            return
        if isinstance(event, StopRequest):
            self.status.stopping()
            self._cancel_pending_spawn()
        before, now = self.state, self.clock()
        self.state, actions = decide(before, event, now)
        step = Transition(before, self.state, event, tuple(actions), now)
        if self._gen is not None:
            self._gen.on_transition(step)
        self._for_watchers("on_transition", lambda src, ctx: src.on_transition(ctx, step))
        if self.state.phase is Phase.EXITED or (self.state.phase is Phase.STOPPING
                                                and self.state.after_stop is AfterStop.EXIT):
            self.status.stopping()
        for action in actions:
            self.executor.execute(action)
        gen = self._gen
        if isinstance(event, Exited) and gen is not None and gen.pid == event.pid:
            self._gen = None
            pid, code = event.pid, event.returncode
            self._for_watchers("on_exit", lambda src, ctx: src.on_exit(ctx, pid, code))
            self.tasks.start(gen.end(), "end of a server", finish=True)  # closes its probe, log reader, pidfd
        self.status.after_step(self.state.phase is not before.phase)
        if self.state.phase is Phase.STARTING and before.phase is not Phase.STARTING:
            self.start_timeout.extend()
        if self.state.phase is Phase.WAITING_VRAM:
            self.start_timeout.extend()  # a bounded wait for VRAM is no stuck start (TimeoutStartSec)
        if self.status.stopping_sent:
            self.stop_timeout.extend(self.state)  # a stop waiting for a reset is no stuck stop

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

    # ------------------------------------------------------------ the spawn

    def _cancel_pending_spawn(self) -> None:
        """A stop while the spawn still waits in its pre-spawn checks: abandon them (the task then
        answers SpawnFailed), so the stop is honoured at once rather than after the wait."""
        task = self.executor.spawn_task
        if task is not None and not task.done() and self.spawner.cancellable:
            task.cancel()

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
                          get_key=lambda: spawner.live_key, state=self.state, gpu=self.gpu, slots=self.slots,
                          front=self.front, before_drained_stop=self._before_drained_stop)
        self._gen = gen
        gen.start()
        self.queue.put_nowait(Spawned(gen.pid, outcome.argv))
        self._for_watchers("on_spawn", lambda src, ctx: src.on_spawn(ctx, gen.pid))

    # ------------------------------------------------------------ shutdown

    async def _cleanup(self) -> None:
        """Stop everything, each wait bounded: the server (SIGKILL, reaped), the ends of servers gone, the
        tasks, the watchers."""
        self.status.stopping()
        gen = self._gen
        if gen is not None:
            if gen.server.proc.returncode is None:
                await kill_and_reap(gen.server)
            await gen.end()
        await self.lend.close()
        await self.tasks.cancel_all(TASK_CANCEL_TIMEOUT_S)  # a server that exited just before: its end finishes
        for watcher in self.watchers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watcher.close(), WATCHER_CLOSE_TIMEOUT_S)
        self.runtime.status_file.remove()
