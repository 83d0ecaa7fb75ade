"""``llama-guard run``: the asyncio loop that feeds observations to the policy and executes actions.

Sources (child exit, child output, HTTP probes, signals, timers) put :mod:`policy` inputs on
one queue; the loop calls :func:`policy.decide` and carries out the actions. Signal handlers
only enqueue (SIGHUP too). Every wait has a deadline on ``time.monotonic()``.

The decision step never awaits I/O: the spawn with its pre-spawn checks (model file, ``--help``,
the watchers' ``before_spawn`` such as the wait for the old server's VRAM), drains, reloads and
resets run as tasks that answer through the queue, so watchdog pings and a stop request are
handled within a loop turn (``MAX_TICK_S``) whatever is waiting. Blocking calls run on
:class:`~llama_guard.core.offload.Lane` s of their own (``config``, ``probe``, ``proc``) with
timeouts. Every task is tracked and supervised: a watcher that raises is reported
(``watcher_failed``) and restarted with backoff, one that keeps failing or a failure in the
daemon's own tasks ends it with exit 70 (systemd restarts it). A server's exit is learnt from a
pidfd, not from its output pipe. Towards systemd: ``STOPPING=1`` when a stop begins, and never
``READY=1`` after it.

Module size: over the ~400-line aim (about 750): the loop, its actions and the reload share the
daemon's state; the pure parts live in :mod:`.reload`, :mod:`.procs`, :mod:`.offload`, :mod:`.child`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TextIO

from llama_guard import __version__
from llama_guard.argv import build_argv, resolve_binary
from llama_guard.config import Config, ConfigError, GpuWatchMode, load_config, read_api_key
from llama_guard.core.child import ServerProcess, child_environ, kill_and_reap, pipe_holders, spawn
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy
from llama_guard.core.policy import decide
from llama_guard.core.policy_gpu import VRAM_CHECK_TIMEOUT_S
from llama_guard.core.privileges import ServerIdentity, identity_problem, make_drop, resolve_identity
from llama_guard.core.probes import ServerProbe
from llama_guard.core.procs import alive, port_listener, port_owner
from llama_guard.core.progress import ProgressSampler
from llama_guard.core.reload import reload_report, startable
from llama_guard.core.server_log import Family, classify_line
from llama_guard.core.types import (
    Action,
    AfterStop,
    Boot,
    CheckVram,
    Drained,
    Emit,
    ExitDaemon,
    Exited,
    HealthOk,
    Input,
    InspectGpu,
    Kill,
    Line,
    LoadProgress,
    NotifyReady,
    NotOnGpu,
    Params,
    ParamsChanged,
    Phase,
    Probe,
    ResetDone,
    ResetFacts,
    ResetTrigger,
    RestartRequest,
    RunReset,
    Spawn,
    Spawned,
    SpawnFailed,
    StartDrain,
    State,
    StopRequest,
    Terminate,
    Tick,
    VramFacts,
    initial_state,
)
from llama_guard.core.watcher import Context, Source
from llama_guard.exitcodes import EXIT_CONFIG, EXIT_SOFTWARE
from llama_guard.output.eventlog import Emitter
from llama_guard.output.status import AlreadyRunning, RuntimeLock, StatusFile
from llama_guard.preflight import model_problem

# llama-server's per-request timing line: "eval time = 610.78 ms / 64 tokens (... 103.15 tokens per second)".
EVAL_SPEED = re.compile(r"(?<!prompt )eval time =\s*[\d.]+ ms /\s*(\d+) tokens.*?([\d.]+) tokens per second")
# llama-server's line when a slot finishes a request ("slot release: id 0 | task 5 | stop processing: ...").
REQUEST_DONE = re.compile(r"\bstop processing: n_tokens = \d+")
MIN_SPEED_TOKENS = 16  # the 1-token canary's own timing says nothing about speed
MAX_TICK_S = 1.0  # the loop wakes at least this often (timers, watchdog)
STATUS_REFRESH_S = 2.0  # the status file is rewritten at least this often (sources' current readings)
MODEL_CHECK_TIMEOUT_S = 10.0  # loading + checking a reloaded config (stat, open of the model)
HELP_PROBE_TIMEOUT_S = 25.0  # building the argv (the binary's --help, itself bounded at 20 s)
PROC_TIMEOUT_S = 5.0  # a /proc scan (port owner, pipe holders)
EXIT_PIPE_GRACE_S = 0.3  # after the exit: how long the rest of the output may take to arrive
WATCHER_MAX_FAILURES = 5  # a watcher failing more often than this within WATCHER_WINDOW_S ends the daemon
WATCHER_WINDOW_S = 300.0
WATCHER_BACKOFF_S = 1.0  # the first restart of a failed watcher; doubled per failure, at most 30 s
UNKILLABLE_WAIT_S = 30.0  # how long a start waits for a server that outlived SIGKILL to go away

LOAD_SAMPLE_S = 2.0  # while the model loads, progress signals are sampled this often


@dataclass(frozen=True)
class ReloadRequest(Input):
    """SIGHUP: reload the configuration file. Queued like every signal; handled by the daemon."""


class ServiceNotifier(Protocol):
    """The service-manager hooks the daemon calls (sd_notify; see output.notify.SdNotifier)."""

    def ready(self, status: str | None = None) -> None: ...
    def status(self, text: str) -> None: ...
    def reloading(self, status: str | None = None) -> None: ...
    def stopping(self, status: str | None = None) -> None: ...
    def watchdog(self) -> None: ...
    def extend_timeout(self, usec: int) -> None: ...


class NullNotifier:
    """No service manager: every hook does nothing."""

    def ready(self, status: str | None = None) -> None: ...
    def status(self, text: str) -> None: ...
    def reloading(self, status: str | None = None) -> None: ...
    def stopping(self, status: str | None = None) -> None: ...
    def watchdog(self) -> None: ...
    def extend_timeout(self, usec: int) -> None: ...


# While the model loads, each sign of progress pushes systemd's start timeout this far out.
EXTEND_TIMEOUT_USEC = 120_000_000


def params_from(config: Config, *, reset_possible: bool = False) -> Params:
    """The policy's parameters from a validated configuration; ``reset_possible`` when the GPU
    watch is on (a reset can be verified)."""
    gpu_wanted = config.gpu.enabled is not GpuWatchMode.OFF and config.server.n_gpu_layers > 0
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
        reset_possible=reset_possible,
        reset_on=frozenset(ResetTrigger(t) for t in config.recovery.reset_on),
        max_resets=config.recovery.max_resets,
        reset_window_s=config.recovery.reset_window_s,
        reset_deadline_s=(config.recovery.reset_timeout_s + config.gpu.vram_release_timeout_s
                          + config.recovery.foreign_wait_s + config.recovery.stop_grace_s + 30.0),
        gpu_index=config.gpu.index,
        vram_admission=reset_possible and gpu_wanted,
        vram_wait_timeout_s=config.gpu.vram_wait_timeout_s,
        load_stall_s=config.health.load_stall_s,
        progress_cpu_s=config.health.progress_cpu_s,
        silent_limit_s=config.health.silent_limit_s,
    )


@dataclass
class _Generation:
    """One llama-server process and the tasks that watch it."""

    server: ServerProcess
    probe: ServerProbe
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    log: TextIO | None = None
    lines: int = 0  # lines printed so far (a progress signal)
    completed_at: float | None = None  # when the server last logged a finished request (monotonic s)
    answering: bool | None = None  # whether the last liveness round got any HTTP answer (None: no round yet)


class Daemon:
    """Owns one llama-server for the lifetime of ``run()``."""

    def __init__(self, config: Config, config_path: Path, emitter: Emitter, *,
                 notifier: ServiceNotifier | None = None, sources: list[Source] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.config_path = config_path
        self.emitter = emitter
        self.notifier: ServiceNotifier = notifier or NullNotifier()
        self.sources: list[Source] = list(sources or [])
        self.clock = clock
        self.state: State = initial_state(params_from(config))
        self.queue: asyncio.Queue[Input] = asyncio.Queue()
        self.status_file = self._make_status_file(config.runtime.dir)
        self.lock = RuntimeLock(config.runtime.dir)
        # [server].api_key_file's key as last read (start, reload, each spawn) and the one the running
        # server was started with, which our probes send. Never emitted.
        self._api_key = ""
        self._live_key = ""
        self._identity = ServerIdentity(None, None, None, "llama-guard's own user")
        self._gen: _Generation | None = None
        self._stop_signals = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._spawn_task: asyncio.Task[None] | None = None
        self._spawn_cancellable = False
        self._reload_task: asyncio.Task[None] | None = None
        self._stopping_sent = False
        self._stale_pid: int | None = None  # a server that outlived SIGKILL
        # Blocking calls, each kind on a lane of its own: one stuck call starves nothing else.
        self.lanes = {"config": Lane("config", 2), "probe": Lane("probe", 1), "proc": Lane("proc", 2)}
        self._vram_check: asyncio.Task[Any] | None = None
        self._vram_check_failing = False  # the last VRAM check failed (reported once per run of failures)
        self._exit_code: int | None = None
        self._last_pid: int | None = None
        self._last_extend = float("-inf")
        self._last_eval_tps: float | None = None
        self._status_at = float("-inf")
        self._reset_possible = False
        self.ctx: Context | None = None

    def _make_status_file(self, directory: Path) -> StatusFile:
        return StatusFile(directory, on_error=lambda reason: self.emitter.emit(
            "status_write_failed", runtime_dir=str(directory), reason=reason))

    # ------------------------------------------------------------ tasks and failures

    def _task(self, coro: Awaitable[Any], name: str, *, core: bool = True) -> asyncio.Task[Any]:
        """A tracked task (dropped from the set when done: nothing accumulates). ``core``: an
        exception in it is a failure of the daemon itself (watcher_failed, then exit 70)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if core and not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                self.emitter.emit("watcher_failed", watcher=f"core.{name}", error=_summary(exc), failures=1,
                                  window_s=0.0, action="a failure in the daemon's core: exiting with status 70")
                self._fail(f"internal error in {name}: {_summary(exc)}")

        task.add_done_callback(done)
        return task

    def _fail(self, reason: str) -> None:
        """End the daemon with exit 70 (EXIT_SOFTWARE): systemd restarts it. The server is stopped."""
        if self._exit_code is None:
            self.emitter.emit("daemon_exit", exit_code=EXIT_SOFTWARE, reason=reason)
            self._exit_code = EXIT_SOFTWARE
            self.queue.put_nowait(Tick())  # wake the loop

    async def _supervise_watcher(self, source: Source) -> None:
        """Run ``source.run`` and restart it with backoff when it raises (``watcher_failed``); more
        than WATCHER_MAX_FAILURES failures within WATCHER_WINDOW_S end the daemon (exit 70)."""
        assert self.ctx is not None
        failures: list[float] = []
        while True:
            try:
                await source.run(self.ctx)
                return
            except Exception as exc:
                now = self.clock()
                failures = [t for t in failures if now - t < WATCHER_WINDOW_S] + [now]
                final = len(failures) > WATCHER_MAX_FAILURES
                delay = min(WATCHER_BACKOFF_S * 2.0 ** (len(failures) - 1), 30.0)
                self.emitter.emit("watcher_failed", watcher=source.name, error=_summary(exc), failures=len(failures),
                                  window_s=WATCHER_WINDOW_S,
                                  action=("it keeps failing: exiting with status 70" if final
                                          else f"restarting it in {delay:.0f} s"))
                if final:
                    self._fail(f"watcher {source.name} keeps failing: {_summary(exc)}")
                    return
                await asyncio.sleep(delay)

    def _extend_start_timeout(self) -> None:
        """While the model loads, keep systemd's start timeout ahead (at most every 10 s)."""
        now = self.clock()
        if now - self._last_extend >= 10.0:
            self._last_extend = now
            self.notifier.extend_timeout(EXTEND_TIMEOUT_USEC)

    def _post_threadsafe(self, event: Input) -> None:
        assert self.ctx is not None
        self.ctx.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def _for_sources(self, hook: str, call: Callable[[Source, Context], None]) -> None:
        """Call the synchronous ``hook`` (named for the report) of every source through ``call``;
        a failing source is reported, not fatal."""
        assert self.ctx is not None
        for source in self.sources:
            try:
                call(source, self.ctx)
            except Exception as exc:
                self.emitter.emit("config_error", reason=f"{source.name}.{hook} failed: {exc!r}")

    # ------------------------------------------------------------ entry point

    async def run(self) -> int:
        """Supervise until a stop request or a give-up; returns the exit status.

        Refuses (exit 78, no server started) when another daemon holds the runtime directory's
        lock, when ``[server].api_key_file`` cannot be read, or when llama-server could not be
        started as ``[server].user``.
        """
        try:
            self.lock.acquire()
        except (AlreadyRunning, OSError) as exc:
            reason = str(exc) if isinstance(exc, AlreadyRunning) else (
                f"cannot lock the runtime directory {self.config.runtime.dir}: {exc.strerror or exc}")
            self.emitter.emit("config_error", reason=reason)
            self.emitter.emit("daemon_exit", exit_code=EXIT_CONFIG, reason=reason)
            return EXIT_CONFIG
        try:
            return await self._run_locked()
        finally:
            self.lock.release()

    def _prepare(self, config: Config) -> tuple[str, ServerIdentity]:
        """The API key and llama-server's identity for ``config``. Raises ConfigError."""
        key = read_api_key(config.server)
        try:
            identity = resolve_identity(config.server.user, config.server.group,
                                        config.server.supplementary_groups)
            problem = identity_problem(identity)
        except (ValueError, OSError) as exc:
            raise ConfigError([f"{self.config_path}: {exc}"]) from None
        if problem:
            raise ConfigError([f"{self.config_path}: {problem}"])
        return key, identity

    def _warn_unauthenticated(self, config: Config) -> None:
        if not config.server.loopback and not config.server.api_key_file:
            self.emitter.emit("server_unauthenticated", host=config.server.host, port=config.server.port)

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
                           get_api_key=lambda: self._live_key)
        self._write_status()
        try:
            try:
                self._api_key, self._identity = await asyncio.to_thread(self._prepare, self.config)
            except ConfigError as exc:
                for line in exc.lines:
                    self.emitter.emit("config_error", reason=line)
                self.emitter.emit("daemon_exit", exit_code=EXIT_CONFIG, reason=exc.lines[0])
                self._exit_code = EXIT_CONFIG
                return EXIT_CONFIG
            self._warn_unauthenticated(self.config)
            for source in self.sources:
                refusal = await source.start(self.ctx)
                if refusal:
                    self.emitter.emit("server_boot_failure", cause=refusal)
                    self.emitter.emit("daemon_exit", exit_code=EXIT_CONFIG, reason=refusal)
                    self._exit_code = EXIT_CONFIG
                    return EXIT_CONFIG
                self._task(self._supervise_watcher(source), f"watcher {source.name}")
            self._reset_possible = any(src.can_reset for src in self.sources)
            self.state = replace(self.state, params=params_from(self.config, reset_possible=self._reset_possible))
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
        """One decision: the policy's answer carried out. Never awaits I/O: every wait (the spawn
        and its pre-spawn checks, drains, reloads, resets, a process exit) runs as a task."""
        if isinstance(event, ReloadRequest):
            self._begin_reload()
            return
        if isinstance(event, StopRequest):
            self._send_stopping()
            self._cancel_pending_spawn()
        before = self.state.phase
        self.state, actions = decide(self.state, event, self.clock())
        if self.state.phase is Phase.EXITED or (self.state.phase is Phase.STOPPING
                                                and self.state.after_stop is AfterStop.EXIT):
            self._send_stopping()
        for action in actions:
            self._execute(action)
        gen = self._gen
        if isinstance(event, Exited) and gen is not None and gen.server.pid == event.pid:
            self._gen = None
            pid, code = event.pid, event.returncode
            self._for_sources("on_exit", lambda src, ctx: src.on_exit(ctx, pid, code))
            self._task(self._end_generation(gen), "end of a server")
        if self.state.phase is not before:
            self._write_status()
            self.notifier.status(self.status_line())
            if self.state.phase is Phase.STARTING:
                self._extend_start_timeout()
        elif self.clock() - self._status_at >= STATUS_REFRESH_S:
            self._write_status()
        if self.state.phase is Phase.WAITING_VRAM:
            self._extend_start_timeout()  # a bounded wait for VRAM is no stuck start (TimeoutStartSec)

    def _send_stopping(self) -> None:
        """``STOPPING=1`` once, when a stop of the daemon begins; no ``READY=1`` after it."""
        if not self._stopping_sent:
            self._stopping_sent = True
            self.notifier.stopping(self.status_line())

    def _ready(self) -> None:
        if not self._stopping_sent:
            self.notifier.ready(self.status_line())

    # ------------------------------------------------------------ signals (enqueue only)

    def _on_term(self, sig: int) -> None:
        self._stop_signals += 1
        self.queue.put_nowait(StopRequest(reason=f"{signal.Signals(sig).name} received",
                                          immediate=self._stop_signals > 1))

    def _on_hup(self, _sig: int) -> None:
        self.queue.put_nowait(ReloadRequest())

    def _on_usr1(self, _sig: int) -> None:
        self.queue.put_nowait(RestartRequest(reason="SIGUSR1 (llama-guard restart)"))

    # ------------------------------------------------------------ actions

    def _execute(self, action: Action) -> None:
        self._for_sources("on_action", lambda src, ctx: src.on_action(ctx, action))
        if isinstance(action, Emit):
            self.emitter.emit(action.name, **action.fields)
        elif isinstance(action, Spawn):
            self._spawn_cancellable = True
            self._spawn_task = self._task(self._spawn(), "spawn")
        elif isinstance(action, Terminate):
            if self._gen is not None and self._gen.server.pid == action.pid:
                self._gen.server.signal_group(signal.SIGTERM)
                # A stopped (SIGSTOP) server acts on SIGTERM only once continued.
                self._gen.server.signal_group(signal.SIGCONT)
        elif isinstance(action, Kill):
            if self._gen is not None and self._gen.server.pid == action.pid:
                self._gen.server.signal_group(signal.SIGKILL)
                if self.state.phase is Phase.STOPPING and self.state.killed:
                    self._stale_pid = action.pid  # cleared when its exit is seen
        elif isinstance(action, NotifyReady):
            self._write_status()
            self._ready()
        elif isinstance(action, StartDrain):
            if self._gen is not None and self._gen.server.pid == action.pid:
                self._gen.tasks.append(self._task(self._drain(self._gen), "drain"))
        elif isinstance(action, (InspectGpu, RunReset)):
            self._task(self._reset_gpu(action), "GPU reset")
        elif isinstance(action, CheckVram):
            # One check at a time: a poll still running answers for the ones asked meanwhile (a
            # slow check must not pile up threads that starve the sampler and the loop).
            if self._vram_check is None or self._vram_check.done():
                self._vram_check = self._task(self._check_vram(), "VRAM check")
        elif isinstance(action, ExitDaemon):
            self.emitter.emit("daemon_exit", exit_code=action.code, reason=action.reason)
            self._exit_code = action.code

    def _cancel_pending_spawn(self) -> None:
        """A stop while the spawn still waits in its pre-spawn checks: abandon them (the task then
        answers SpawnFailed), so the stop is honoured at once rather than after the wait."""
        if self._spawn_task is not None and not self._spawn_task.done() and self._spawn_cancellable:
            self._spawn_task.cancel()

    async def _spawn(self) -> None:
        """Prepare and start one server; always answers Spawned or SpawnFailed (a task)."""
        try:
            await self._spawn_inner()
        except asyncio.CancelledError:
            self.queue.put_nowait(SpawnFailed("stop requested before the server started", fatal=False))
        finally:
            self._spawn_cancellable = False

    async def _spawn_inner(self) -> None:
        server_cfg = self.config.server
        binary = resolve_binary(server_cfg.binary)
        if binary is None:
            self.queue.put_nowait(SpawnFailed(f"llama-server binary {server_cfg.binary!r} not found"))
            return
        model = Path(server_cfg.model)
        try:
            problem = await self.lanes["config"].run(lambda: model_problem(model), MODEL_CHECK_TIMEOUT_S,
                                                     f"checking {model}")
        except (CallTimeout, LaneBusy) as exc:  # a hung filesystem: a failure, retried after backoff
            self.emitter.emit("blocking_call_timeout", call=f"checking {model}", timeout_s=MODEL_CHECK_TIMEOUT_S,
                              effect="the server is not started now")
            self.queue.put_nowait(SpawnFailed(f"server.model: {exc}", fatal=False))
            return
        if problem:  # a FIFO, a directory, not GGUF ...: a configuration error (exit 78)
            self.queue.put_nowait(SpawnFailed(f"server.model: {problem}"))
            return
        refusal = await self._wait_stale_gone()
        if refusal:
            self._fail(refusal)
            return
        try:
            argv = await self.lanes["probe"].run(lambda: build_argv(server_cfg, binary), HELP_PROBE_TIMEOUT_S,
                                                 f"{binary} --help")
        except (CallTimeout, LaneBusy) as exc:
            self.emitter.emit("blocking_call_timeout", call=f"{binary} --help", timeout_s=HELP_PROBE_TIMEOUT_S,
                              effect=f"starting with --mlock unverified ({exc})")
            argv = [str(binary), *build_argv(server_cfg, None)[1:]]  # no binary: plain --mlock
        env = child_environ(os.environ, server_cfg.env)
        assert self.ctx is not None
        for source in self.sources:
            refused = await source.before_spawn(self.ctx, self._last_pid)
            if refused:
                self.queue.put_nowait(SpawnFailed(refused, fatal=False))
                return
        # The sources' hooks (rlimits) first: raising a hard limit needs the privileges that
        # the drop to [server].user then takes away.
        hooks = [h for h in (src.preexec() for src in self.sources) if h is not None]
        hooks.append(make_drop(self._identity, os.getpid()))
        try:  # llama-server reads the key file as it starts: read it now too, so both hold one key
            self._api_key = await asyncio.to_thread(read_api_key, server_cfg)
        except ConfigError as exc:
            self.queue.put_nowait(SpawnFailed(exc.lines[0]))
            return

        def preexec_all() -> None:
            for hook in hooks:
                hook()

        self._spawn_cancellable = False  # from here on the answer is Spawned (or an exec error)
        try:
            server = await asyncio.shield(spawn(argv, env, preexec_extra=preexec_all))
        except OSError as exc:
            self.queue.put_nowait(SpawnFailed(f"cannot execute {binary}: {exc.strerror or exc}"))
            return
        self._live_key = self._api_key
        probe = ServerProbe(server_cfg.base_url, timeout_s=self.config.health.timeout_s,
                            canary_timeout_s=self.config.health.canary_timeout_s,
                            canary=self.config.health.canary, get_key=lambda: self._live_key)
        gen = _Generation(server=server, probe=probe, log=self._open_server_log())
        self._gen = gen
        gen.tasks += [self._task(self._read_lines(gen), "server output"),
                      self._task(self._watch_health(gen), "health probe"),
                      self._task(self._watch_exit(gen), "exit watch")]
        self._last_pid = server.pid
        self.queue.put_nowait(Spawned(server.pid, tuple(argv)))
        self._for_sources("on_spawn", lambda src, ctx: src.on_spawn(ctx, server.pid))

    async def _wait_stale_gone(self) -> str:
        """Before a start: a server that outlived SIGKILL must be gone and its port free, else no
        second server is started (""; or the reason to exit 70 after UNKILLABLE_WAIT_S)."""
        pid = self._stale_pid
        if pid is None:
            return ""
        port = self.config.server.port
        start = self.clock()
        while True:
            running = alive(pid)
            try:
                holds = await self.lanes["proc"].run(lambda: port_listener(port), PROC_TIMEOUT_S, "port scan")
            except (CallTimeout, LaneBusy):
                holds = 0  # cannot tell: keep waiting
            if not running and holds is None:
                self._stale_pid = None
                return ""
            waited = self.clock() - start
            if waited >= UNKILLABLE_WAIT_S:
                what = ", ".join(x for x in ((f"pid {pid} alive" if running else ""),
                                             (f"port {port} held by pid {holds}" if holds else "")) if x)
                self.emitter.emit("server_unkillable", server_pid=pid, waited_s=waited, holds=what)
                return f"llama-server pid {pid} outlived SIGKILL ({what}); not starting a second server"
            await asyncio.sleep(0.1)

    def _open_server_log(self) -> TextIO | None:
        path = self.config.log.server_log_file
        if not path:
            return None
        try:
            # O_NONBLOCK: a FIFO without a reader fails at once (ENXIO) instead of wedging the loop;
            # later writes that would block are dropped (OSError is suppressed at the write).
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o640)
            return open(fd, "a", buffering=1, encoding="utf-8", errors="replace")
        except OSError as exc:
            self.emitter.emit("config_error", reason=f"cannot open server_log_file {path}: {exc.strerror}")
            return None

    # ------------------------------------------------------------ per-server sources

    async def _read_lines(self, gen: _Generation) -> None:
        """Every line of the server's output: kept, classified, queued; then the exit status."""
        pid = gen.server.pid
        async for text in gen.server.lines():
            gen.lines += 1
            if gen.log is not None:
                with contextlib.suppress(OSError):
                    gen.log.write(text + "\n")
            verdict = classify_line(text)
            speed = EVAL_SPEED.search(text)
            if speed is not None and int(speed.group(1)) >= MIN_SPEED_TOKENS:
                self._last_eval_tps = float(speed.group(2))
            if REQUEST_DONE.search(text):
                gen.completed_at = self.clock()
            self.emitter.emit("server_line", server_pid=pid, line=text, family=verdict.family.value)
            if self.state.phase is Phase.STARTING:
                self._extend_start_timeout()
            if verdict.family is not Family.HARMLESS:
                self.queue.put_nowait(Line(pid, verdict, text))

    def _gpu_busy(self, pid: int) -> bool | None:
        """Our pid's GPU use as the sources see it (the first that can tell); None: unknown."""
        for source in self.sources:
            busy = source.gpu_busy(pid)
            if busy is not None:
                return busy
        return None

    async def _watch_health(self, gen: _Generation) -> None:
        """Readiness polling and load-progress sampling while STARTING, then liveness rounds
        (probes plus progress signals) while the server serves."""
        pid = gen.server.pid
        health = self.config.health
        assert self.ctx is not None
        sampler = ProgressSampler(pid, lambda: gen.lines, gpu_busy=self._gpu_busy)
        sampled_at = self.clock()
        answered = False
        while self.state.pid in (None, pid) and self.state.phase is Phase.STARTING:
            status = await gen.probe.health_status()
            owner = await self._port_owner(pid) if status == 200 else None
            if owner is not None:
                for source in self.sources:
                    refusal = await source.ready_check(self.ctx, pid)
                    if refusal:
                        self.queue.put_nowait(NotOnGpu(pid, refusal))
                        return
                self.queue.put_nowait(HealthOk(pid, owner[0] if owner[0] != pid else None, owner[1]))
                break
            answered = answered or status is not None
            if self.clock() - sampled_at >= LOAD_SAMPLE_S:
                sampled_at = self.clock()
                await self._load_progress(gen, sampler, answered)
                answered = False
            await asyncio.sleep(health.startup_poll_s)
        while self.state.phase is Phase.STARTING and self.state.pid == pid:  # noqa: ASYNC110 - until HealthOk is taken
            await asyncio.sleep(0.01)
        await asyncio.to_thread(sampler.sample)  # the liveness window starts at ready
        while self.state.pid == pid and self.state.phase in (Phase.READY, Phase.DRAINING):
            await asyncio.sleep(health.interval_s)
            if self.state.pid != pid or self.state.phase not in (Phase.READY, Phase.DRAINING):
                return
            result = await gen.probe.liveness(completed_at=gen.completed_at)
            if gen.answering is not result.answered:
                gen.answering = result.answered
                self._write_status()  # `status` must not say ready while nothing answers
            moved = await asyncio.to_thread(sampler.sample)  # psutil walks /proc: off the loop
            cpu_s = None if moved.cpu_s is None else round(moved.cpu_s, 3)
            self.emitter.emit("server_probe", server_pid=pid, health_ok=result.health_ok,
                              canary_ok=result.canary_ok, canary=result.canary.value, busy=result.busy,
                              progressed=result.progressed, traffic=result.traffic, detail=result.detail,
                              elapsed_s=round(result.elapsed_s, 3), silent_s=round(result.silent_s, 1),
                              cpu_s=cpu_s, lines=moved.lines, gpu_busy=moved.gpu_busy)
            self.queue.put_nowait(Probe(pid, result.health_ok, result.canary_ok, result.busy,
                                        result.progressed, result.detail, cpu_s=moved.cpu_s,
                                        lines=moved.lines, gpu_busy=moved.gpu_busy, silent_s=result.silent_s,
                                        canary_status=result.status, canary_error=result.error,
                                        loop_ok=result.loop_ok))

    async def _load_progress(self, gen: _Generation, sampler: ProgressSampler, answered: bool) -> None:
        """Report the progress signals of a loading server (lines, CPU time, any HTTP answer from
        its own port) to the policy, and keep systemd's start timeout ahead while they move."""
        pid = gen.server.pid
        threshold = self.config.health.progress_cpu_s
        moved = await asyncio.to_thread(lambda: sampler.sample(accumulate_below_s=threshold))
        signals = list(moved.signals(threshold))
        if answered and await self._port_owner(pid) is not None:
            signals.append("http")
        if signals:
            self.queue.put_nowait(LoadProgress(pid, tuple(signals)))
            self._extend_start_timeout()

    async def _port_owner(self, pid: int) -> tuple[int, str] | None:
        port = self.config.server.port
        try:
            return await self.lanes["proc"].run(lambda: port_owner(pid, port), PROC_TIMEOUT_S, "port owner")
        except (CallTimeout, LaneBusy):
            return None  # asked again at the next poll

    async def _watch_exit(self, gen: _Generation) -> None:
        """The server's exit, from the kernel (pidfd), not from its pipe: then up to
        EXIT_PIPE_GRACE_S for its last lines; whoever still holds the pipe escaped the process
        group (setsid) and is named (``server_escaped_process``) and killed. Answers Exited."""
        server = gen.server
        pid = server.pid
        code = await server.exited()
        server.signal_group(signal.SIGKILL)  # nothing of its group outlives it
        reader = gen.tasks[0] if gen.tasks else None
        if reader is not None and not reader.done():
            await asyncio.wait([reader], timeout=EXIT_PIPE_GRACE_S)
        if reader is not None and not reader.done():
            inode = server.pipe_inode()
            holders: list[tuple[int, str]] = []
            if inode is not None:
                with contextlib.suppress(CallTimeout, LaneBusy):
                    holders = await self.lanes["proc"].run(
                        lambda: pipe_holders(inode, frozenset({os.getpid()})), PROC_TIMEOUT_S, "pipe holders")
            for holder, comm in holders:
                self.emitter.emit("server_escaped_process", server_pid=pid, escaped_pid=holder, escaped_name=comm)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(holder, signal.SIGKILL)
            await asyncio.wait([reader], timeout=EXIT_PIPE_GRACE_S)
        if self._stale_pid == pid:
            self._stale_pid = None
        server.close_pidfd()
        self.queue.put_nowait(Exited(pid, code))

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
        gen.tasks.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(gen.probe.aclose(), 5.0)
        if gen.log is not None:
            gen.log.close()
        gen.server.close_pidfd()

    async def _check_vram(self) -> None:
        """Ask the sources for the GPU's VRAM facts; always answers VramFacts (empty: unknown).

        Bounded: a source that fails or does not answer within :data:`VRAM_CHECK_TIMEOUT_S` seconds
        answers facts with an ``error``; the first of a run of failed checks is reported
        (``gpu_vram_check_failed``), not each poll's."""
        assert self.ctx is not None
        facts: VramFacts | None = None
        for source in self.sources:
            try:  # bounded: the estimate reads the model file (a FIFO, a hung mount never answer)
                facts = await asyncio.wait_for(source.vram_facts(self.ctx), VRAM_CHECK_TIMEOUT_S)
            except Exception as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    reason = f"{source.name} gave no VRAM facts within {VRAM_CHECK_TIMEOUT_S:.0f} s"
                else:
                    reason = f"{source.name}.vram_facts failed: {exc!r}"
                facts = VramFacts(None, None, None, error=reason)
            if facts is not None:
                break
        if facts is not None and facts.error:
            if not self._vram_check_failing:
                index = facts.gpu_index if facts.gpu_index is not None else self.config.gpu.index
                self.emitter.emit("gpu_vram_check_failed", gpu_index=index, reason=facts.error)
            self._vram_check_failing = True
        else:
            self._vram_check_failing = False
        self.queue.put_nowait(facts or VramFacts(None, None, None))

    async def _reset_gpu(self, action: InspectGpu | RunReset) -> None:
        """Hand a reset step to the source that can reset; always answers ResetFacts / ResetDone."""
        assert self.ctx is not None
        source = next((src for src in self.sources if src.can_reset), None)
        answer: Input
        if isinstance(action, InspectGpu):
            try:
                if source is None:
                    raise RuntimeError("GPU watch is off: a reset cannot be verified")
                answer = await source.inspect_reset(self.ctx, action.previous_pid)
            except Exception as exc:
                answer = ResetFacts(None, True, 0.0, (), False, f"cannot inspect the GPU: {exc}")
        else:
            try:
                if source is None:
                    raise RuntimeError("GPU watch is off")
                answer = await source.reset(self.ctx, action.gpu_index)
            except Exception as exc:
                answer = ResetDone(action.gpu_index, "", None, "", False,
                                   f"internal error during the reset: {exc!r}")
        self.queue.put_nowait(answer)

    # ------------------------------------------------------------ reload

    def _begin_reload(self) -> None:
        """A queued SIGHUP: ignored (with an event) during a stop or while a reload runs."""
        if self._stopping_sent or self.state.phase in (Phase.EXITED,) or self._exit_code is not None:
            self.emitter.emit("reload_ignored", reason="llama-guard is stopping")
            return
        if self._reload_task is not None and not self._reload_task.done():
            self.emitter.emit("reload_ignored", reason="a reload is still running")
            return
        self._reload_task = self._task(self._reload(), "reload")

    async def _reload(self) -> None:
        """SIGHUP: validate the file, refuse one the server could not start with, apply the rest.
        Loading and the start checks run on the config lane with a deadline (a model on a hung
        filesystem, a FIFO), and always end with READY=1 unless a stop began meanwhile."""
        self.notifier.reloading()
        try:
            new = await self.lanes["config"].run(lambda: load_config(self.config_path), MODEL_CHECK_TIMEOUT_S,
                                                 f"loading {self.config_path}")
            problem = await self.lanes["config"].run(lambda: startable(new), MODEL_CHECK_TIMEOUT_S,
                                                     f"checking {new.server.model}")
            key, identity = await self.lanes["config"].run(lambda: self._prepare(new), MODEL_CHECK_TIMEOUT_S,
                                                           "reading [server].api_key_file")
        except ConfigError as exc:
            for line in exc.lines:
                self.emitter.emit("config_error", reason=line + " (keeping the running configuration)")
            self._ready()
            return
        except (CallTimeout, LaneBusy) as exc:
            self.emitter.emit("config_error", reason=f"{self.config_path}: {exc} (keeping the running configuration)")
            self._ready()
            return
        except Exception as exc:  # never leave systemd in "reloading"
            self.emitter.emit("config_error", reason=f"{self.config_path}: cannot be loaded: {exc!r} "
                                                     "(keeping the running configuration)")
            self._ready()
            return
        if problem:
            self.emitter.emit("config_error", reason=f"{self.config_path}: {problem} "
                                                     "(keeping the running configuration)")
            self._ready()
            return
        if self._stopping_sent:
            self.emitter.emit("reload_ignored", reason="llama-guard began stopping during the reload")
            return
        # A new key (same file, new content) reaches llama-server only by a (drained) restart.
        server_changed = (new.server != self.config.server or new.limits != self.config.limits
                          or key != self._live_key)
        old = self.config
        report = reload_report(old, new)
        self.config = new
        self._api_key, self._identity = key, identity
        self._apply_runtime(old, new)
        if (new.server.host, new.server.api_key_file) != (old.server.host, old.server.api_key_file):
            self._warn_unauthenticated(new)
        self._for_sources("on_reload", lambda src, ctx: src.on_reload(ctx, old, new))
        self.emitter.emit("config_reloaded", config_path=str(self.config_path),
                          changed=",".join(report.changed), applied=",".join(report.applied),
                          server_restart=",".join(report.server_restart),
                          next_server_start=",".join(report.next_server_start),
                          needs_daemon_restart=",".join(report.daemon_restart),
                          changed_text=report.text())
        self.queue.put_nowait(ParamsChanged(params_from(new, reset_possible=self._reset_possible),
                                            server_changed))
        self._ready()

    def _apply_runtime(self, old: Config, new: Config) -> None:
        """Apply the reloadable parts that live outside the policy: the log level, the status dir."""
        if new.log.level != old.log.level:
            self.emitter.set_level(new.log.level)
        if new.runtime.dir != old.runtime.dir:
            lock = RuntimeLock(new.runtime.dir)
            try:
                lock.acquire()
            except (AlreadyRunning, OSError) as exc:
                self.emitter.emit("config_error", reason=f"[runtime].dir: {exc}; keeping {old.runtime.dir}")
                return
            self.status_file.remove()
            self.lock.release()
            self.lock = lock
            self.status_file = self._make_status_file(new.runtime.dir)
            self._write_status()

    # ------------------------------------------------------------ status

    def status_line(self) -> str:
        """One human line for sd_notify STATUS= and ``llama-guard status``."""
        s = self.state
        pid = f" pid {s.pid}" if s.pid else ""
        extra = ""
        if s.phase is Phase.BACKOFF and s.deadline is not None:
            extra = f", next start in {max(0.0, s.deadline - self.clock()):.1f} s"
        if self._gen is not None and self._gen.answering is False and s.phase in (Phase.READY, Phase.DRAINING):
            extra += f", not answering for {self._gen.probe.silent_s():.0f} s"
        if self._last_eval_tps is not None and s.phase in (Phase.READY, Phase.DRAINING):
            extra += f", {self._last_eval_tps:.1f} tok/s last request"
        for source in self.sources:
            with contextlib.suppress(Exception):
                text = source.status_fragment()
                if text:
                    extra += f", {text}"
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
            "liveness": self._liveness(),
            **{src.name: snap for src in self.sources if (snap := self._safe_snapshot(src)) is not None},
        }

    def _liveness(self) -> dict[str, Any] | None:
        """The serving server's answers to liveness rounds, for ``status``; None before a round."""
        gen = self._gen
        if gen is None or gen.answering is None or self.state.phase not in (Phase.READY, Phase.DRAINING):
            return None
        return {"answering": gen.answering, "silent_s": round(gen.probe.silent_s(), 1)}

    @staticmethod
    def _safe_snapshot(source: Source) -> dict[str, Any] | None:
        try:
            return source.snapshot()
        except Exception:
            return None

    def _write_status(self) -> None:
        self._status_at = self.clock()
        self.status_file.write(self.snapshot())

    # ------------------------------------------------------------ shutdown

    async def _cleanup(self) -> None:
        """Stop everything, each wait bounded: the server (SIGKILL, reaped), the tasks, the sources."""
        self._send_stopping()
        gen = self._gen
        if gen is not None:
            if gen.server.proc.returncode is None:
                await kill_and_reap(gen.server)
            await self._end_generation(gen)
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for source in self.sources:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(source.close(), 10.0)
        self.status_file.remove()


def _summary(exc: BaseException | None) -> str:
    """``ValueError: bad thing`` (one line) for events."""
    if exc is None:
        return "?"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
