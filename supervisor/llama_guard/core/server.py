"""One llama-server process and the tasks that watch it, from the spawn to the end of its output.

A :class:`ServerWatch` owns its process's tasks: the line reader (each output line kept, classified
by :mod:`.server_log`, emitted as ``server_line`` and, unless harmless, queued as a policy
:class:`~llama_guard.model.inputs.Line`), readiness polling and load progress while STARTING, liveness
rounds while serving, the exit watch (a pidfd, then the rest of the pipe) and drains. It follows the
policy through the loop's records (:meth:`ServerWatch.on_transition`: the phase, the server the policy
names, the front door's last completed request), never by reading the state, and posts inputs
through the :class:`~llama_guard.model.watcher.Context`; it never calls back into the daemon loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import signal
import stat
from collections.abc import Awaitable, Callable
from typing import TextIO

from llama_guard.core.child import ServerProcess, pipe_holders
from llama_guard.core.gpu_port import GpuPort
from llama_guard.core.offload import PROC_TIMEOUT_S, CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.core.ports import FrontPort, SlotPort
from llama_guard.core.probes import ServerProbe, sleep_or_wake
from llama_guard.core.progress import ProgressSample, ProgressSampler
from llama_guard.core.service import StartTimeout
from llama_guard.core.tasks import TaskSet
from llama_guard.host.procs import port_owner
from llama_guard.host.safe_files import kind_of
from llama_guard.model.inputs import Drained, Exited, HealthOk, Line, LoadProgress, NotOnGpu, Probe, SlotsSaved
from llama_guard.model.policy.steps import SERVING
from llama_guard.model.server_log import Family, classify_line
from llama_guard.model.transition import Transition
from llama_guard.model.types import State
from llama_guard.model.watcher import Context
from llama_guard.vocab.phases import Phase

# llama-server's per-request timing line: "eval time = 610.78 ms / 64 tokens (... 103.15 tokens per second)".
LAST_LINE_MAX = 300  # characters of the last output line kept for a stalled load's verdict
EVAL_SPEED = re.compile(r"(?<!prompt )eval time =\s*[\d.]+ ms /\s*(\d+) tokens.*?([\d.]+) tokens per second")
# llama-server's line when a slot finishes a request ("slot release: id 0 | task 5 | stop processing: ...").
REQUEST_DONE = re.compile(r"\bstop processing: n_tokens = \d+")
# llama-server's lines as its HTTP server begins answering ("llama_server: model loaded", "listening on
# http://H:P"; older builds "main: server is listening on ..."): the readiness poll probes at once
# instead of at its next startup_poll_s tick.
SERVING_LINE = re.compile(r"\bmodel loaded\b|\blistening on https?://")
MIN_SPEED_TOKENS = 16  # the 1-token canary's own timing says nothing about speed
EXIT_PIPE_GRACE_S = 0.3  # after the exit: how long the rest of the output may take to arrive
LOAD_SAMPLE_S = 2.0  # while the model loads, progress signals are sampled this often
MIN_ROUND_GAP_S = 0.5  # liveness rounds that took longer than interval_s: the next one after this pause
PROBE_CLOSE_TIMEOUT_S = 5.0


def open_server_log(path: str, emit: Callable[..., None]) -> TextIO | None:
    """``[log].server_log_file`` opened for appending the server's lines; None (reported as
    ``config_error``) when it cannot be opened. O_NONBLOCK: a FIFO without a reader fails at once
    (ENXIO) instead of wedging the loop; later writes that would block are dropped. O_NOFOLLOW: a
    symbolic link there (one planted by a user who can write the log's directory) is refused, never
    followed; so is a regular file with more than one name (a hard link to another file)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    except OSError as exc:
        reason = "it is a symbolic link (never followed: name the file itself)" if exc.errno == errno.ELOOP \
            else exc.strerror
        emit("config_error", reason=f"cannot open server_log_file {path}: {reason}")
        return None
    st = os.fstat(fd)
    refusal = ("" if stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode) or
               (stat.S_ISREG(st.st_mode) and st.st_nlink == 1) else
               f"it has {st.st_nlink} hard links (another name of another file)" if stat.S_ISREG(st.st_mode)
               else f"it is {kind_of(st.st_mode)}")
    if refusal:
        os.close(fd)
        emit("config_error", reason=f"cannot open server_log_file {path}: {refusal}")
        return None
    return open(fd, "a", buffering=1, encoding="utf-8", errors="replace")


class ServerWatch:
    """The tasks of one server process (``server``); :meth:`start` begins them, :meth:`end` ends them.
    ``state``: the policy's state as the process is spawned; every later step comes through
    :meth:`on_transition`. ``gpu``, ``slots``, ``front``: the daemon's ports (None: absent)."""

    def __init__(self, server: ServerProcess, ctx: Context, lanes: dict[LaneKind, Lane],
                 tasks: TaskSet, start_timeout: StartTimeout, get_key: Callable[[], str], state: State, *,
                 gpu: GpuPort | None = None, slots: SlotPort | None = None, front: FrontPort | None = None,
                 before_drained_stop: Callable[[int], Awaitable[None]] | None = None) -> None:
        config = ctx.get_config()
        self.server = server
        self.pid = server.pid
        self._ctx = ctx
        self._gpu = gpu
        self._slots = slots
        self._front = front
        self._before_drained_stop = before_drained_stop
        self._lanes = lanes
        self._taskset = tasks
        self._start_timeout = start_timeout
        self.probe = ServerProbe(config.server.base_url, timeout_s=config.health.timeout_s,
                                 canary_timeout_s=config.health.canary_timeout_s,
                                 canary=config.health.canary, get_key=get_key)
        path = config.log.server_log_file
        self.log = open_server_log(path, ctx.emit) if path else None
        self.tasks: list[asyncio.Task[None]] = []
        self.lines = 0  # lines printed so far (a progress signal)
        self.last_line = ""  # the last of them (clipped), named when a load stalls after it
        self.last_eval_tps: float | None = None  # the speed of the last request of >= MIN_SPEED_TOKENS
        self.completed_at: float | None = None  # when the server last logged a finished request (monotonic s)
        self.answering: bool | None = None  # whether the last liveness round got any HTTP answer (None: no round)
        self._serving_line = asyncio.Event()  # set by a SERVING_LINE: the readiness poll probes at once
        self._slot_released = asyncio.Event()  # set by a REQUEST_DONE line: a drain asks /slots at once
        # The policy as the loop's records show it: its phase, the server it names (None: the spawn is
        # not answered yet) and when the front door last saw a request completed (monotonic s).
        self._phase, self._policy_pid, self._last_request_at = state.phase, state.pid, state.last_request_at
        self._confirming = state.confirming  # the policy holds requests until a liveness round confirms
        self._moved = asyncio.Event()  # set when a record changes the phase or the pid
        self._confirm = asyncio.Event()  # set by confirm(): the next liveness round starts at once

    def on_transition(self, step: Transition) -> None:
        """One step of the loop (called by the daemon before it carries out the step's actions)."""
        after = step.after
        self._last_request_at, self._confirming = after.last_request_at, after.confirming
        if (after.phase, after.pid) != (self._phase, self._policy_pid):
            self._phase, self._policy_pid = after.phase, after.pid
            self._moved.set()

    async def _until(self, done: Callable[[], bool]) -> None:
        """Return once ``done()`` holds, woken by the records that change the phase or the pid."""
        while not done():
            self._moved.clear()
            await self._moved.wait()

    def _loading(self) -> bool:
        """The policy waits for this server to become ready (or for its spawn to be answered)."""
        return self._phase is Phase.STARTING and self._policy_pid in (None, self.pid)

    def _on_trial(self) -> bool:
        """The policy measures this server's decode speed (TRIAL: the front door holds the clients)."""
        return self._policy_pid == self.pid and self._phase is Phase.TRIAL

    def _serving(self) -> bool:
        return self._policy_pid == self.pid and self._phase in SERVING

    def _draining(self) -> bool:
        return self._policy_pid == self.pid and self._phase is Phase.DRAINING

    def start(self) -> None:
        """Begin the line reader, the health watch and the exit watch."""
        self.tasks += [self._taskset.start(self._read_lines(), "server output"),
                       self._taskset.start(self._watch_health(), "health probe"),
                       self._taskset.start(self._watch_exit(), "exit watch")]

    def drain(self) -> None:
        """Wait until no client request is in flight; posts Drained. The policy alone bounds the drain
        (its deadline: ``[schedule].drain_timeout_s``, or ``[front].stop_drain_s`` before an exit): the
        wait ends when the policy leaves DRAINING, or with this server's tasks."""
        self.tasks.append(self._taskset.start(self._drain(), "drain"))

    def save_slots(self) -> None:
        """Before the stop for a GPU reset: the slot port's :meth:`~SlotPort.before_reset_stop`, then
        posts SlotsSaved (the policy bounds the wait; the task ends with this server's tasks)."""
        self.tasks.append(self._taskset.start(self._save_slots(), "slot saves before a reset"))

    def confirm(self) -> None:
        """Start a confirming liveness round now (:class:`~llama_guard.model.actions.ConfirmCompletions`);
        a round under way is followed at once by the confirming one."""
        self._confirm.set()

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the server's process group."""
        self.server.signal_group(sig)

    # ------------------------------------------------------------ the tasks

    async def _read_lines(self) -> None:
        """Every line of the server's output: kept, classified, queued."""
        async for text in self.server.lines():
            self.lines += 1
            self.last_line = text.strip()[:LAST_LINE_MAX]
            if self.log is not None:
                with contextlib.suppress(OSError):
                    self.log.write(text + "\n")
            verdict = classify_line(text)
            speed = EVAL_SPEED.search(text)
            if speed is not None and int(speed.group(1)) >= MIN_SPEED_TOKENS:
                self.last_eval_tps = float(speed.group(2))
            if REQUEST_DONE.search(text):
                self.completed_at = self._ctx.clock()
                self._slot_released.set()
            if SERVING_LINE.search(text):
                self._serving_line.set()
            self._ctx.emit("server_line", server_pid=self.pid, line=text, family=verdict.family.value)
            if self._phase is Phase.STARTING:
                self._start_timeout.extend()
            if verdict.family is not Family.HARMLESS:
                self._ctx.post(Line(self.pid, verdict, text))

    async def _watch_health(self) -> None:
        """Readiness polling and load-progress sampling while STARTING, then liveness rounds
        (probes plus progress signals) while the server serves."""
        pid = self.pid
        ctx = self._ctx
        health = ctx.get_config().health
        sampler = ProgressSampler(pid, lambda: self.lines, gpu_busy=None if self._gpu is None else self._gpu.gpu_busy)
        sampled_at = ctx.clock()
        answered = False
        while self._loading():
            status = await self.probe.health_status()
            owner = await self._port_owner() if status == 200 else None
            if owner is not None:
                refusal = await self._gpu.ready_check(ctx, pid) if self._gpu is not None else None
                if refusal:
                    ctx.post(NotOnGpu(pid, refusal))
                    return
                if self._slots is not None:  # once the server is on the GPU, clients still held
                    await self._slots.restore(ctx, pid)
                ctx.post(HealthOk(pid, owner[0] if owner[0] != pid else None, owner[1]))
                break
            answered = answered or status is not None
            if ctx.clock() - sampled_at >= LOAD_SAMPLE_S:
                sampled_at = ctx.clock()
                await self._load_progress(sampler, answered)
                answered = False
            await sleep_or_wake(health.startup_poll_s, self._serving_line)  # at once on a SERVING_LINE
        # until the policy took HealthOk (or moved on), and a new build's trial is over (kept or not)
        await self._until(lambda: not self._loading() and not self._on_trial())
        await self._sample(sampler)  # the liveness window starts at ready
        round_at = ctx.clock()
        while self._serving():
            # Rounds start interval_s apart (not interval_s after the previous one ended): a probe
            # that times out does not stretch the cycle, so a hang is found within
            # hang_strikes x interval_s + timeout_s of its start.
            # A confirming round (confirm()) starts at once.
            await sleep_or_wake(max(MIN_ROUND_GAP_S, round_at + ctx.get_config().health.interval_s - ctx.clock()),
                                self._confirm)
            confirm, round_at = self._confirming, ctx.clock()
            if not self._serving():
                return
            # A request that completed since the previous round (the server's own log line for it, or
            # the front door's last_request_at) already showed progress: no canary in that round.
            seen = [t for t in (self.completed_at, self._last_request_at) if t is not None]
            result = await self.probe.liveness(completed_at=max(seen) if seen else None, confirm=confirm)
            self.answering = result.answered
            moved = await self._sample(sampler)
            cpu_s = None if moved.cpu_s is None else round(moved.cpu_s, 3)
            ctx.emit("server_probe", server_pid=pid, health_ok=result.health_ok,
                     canary_ok=result.canary_ok, canary=result.canary.value, busy=result.busy,
                     progressed=result.progressed, traffic=result.traffic, detail=result.detail,
                     elapsed_s=round(result.elapsed_s, 3), silent_s=round(result.silent_s, 1),
                     cpu_s=cpu_s, lines=moved.lines, gpu_busy=moved.gpu_busy, confirm=confirm)
            ctx.post(Probe(pid, result.health_ok, result.canary_ok, result.busy,
                           result.progressed, result.detail, cpu_s=moved.cpu_s,
                           lines=moved.lines, gpu_busy=moved.gpu_busy, silent_s=result.silent_s,
                           canary_status=result.status, canary_error=result.error, loop_ok=result.loop_ok,
                           confirm=confirm))

    async def _load_progress(self, sampler: ProgressSampler, answered: bool) -> None:
        """Report the progress signals of a loading server (lines, CPU time, any HTTP answer from
        its own port) to the policy, and keep systemd's start timeout ahead while they move."""
        threshold = self._ctx.get_config().health.progress_cpu_s
        moved = await self._sample(sampler, threshold)
        signals = list(moved.signals(threshold))
        if answered and await self._port_owner() is not None:
            signals.append("http")
        if signals:
            self._ctx.post(LoadProgress(self.pid, tuple(signals)))
            self._start_timeout.extend()

    async def _sample(self, sampler: ProgressSampler, accumulate_below_s: float = 0.0) -> ProgressSample:
        """``sampler``'s next sample (psutil walks /proc) on the proc lane; nothing moved (unknown CPU
        time) when the walk did not answer within PROC_TIMEOUT_S."""
        try:
            return await self._lanes[LaneKind.PROC].run(lambda: sampler.sample(accumulate_below_s=accumulate_below_s),
                                                        PROC_TIMEOUT_S, "progress sample")
        except (CallTimeout, LaneBusy):
            return ProgressSample(cpu_s=None, lines=0, gpu_busy=None)

    async def _port_owner(self) -> tuple[int, str] | None:
        """The process (pid, name) of this server's tree that listens on ``[server].port``; None
        when none does yet, or the scan did not answer (asked again at the next poll)."""
        pid, port = self.pid, self._ctx.get_config().server.port
        try:
            return await self._lanes[LaneKind.PROC].run(lambda: port_owner(pid, port), PROC_TIMEOUT_S, "port owner")
        except (CallTimeout, LaneBusy):
            return None

    async def _watch_exit(self) -> None:
        """The server's exit, from the kernel (pidfd), not from its pipe: then up to
        EXIT_PIPE_GRACE_S for its last lines; whoever still holds the pipe escaped the process
        group (setsid) and is named (``server_escaped_process``) and killed. Posts Exited."""
        server = self.server
        pid = self.pid
        code = await server.exited()
        server.signal_group(signal.SIGKILL)  # nothing of its group outlives it
        reader = self.tasks[0] if self.tasks else None
        if reader is not None and not reader.done():
            await asyncio.wait([reader], timeout=EXIT_PIPE_GRACE_S)
        if reader is not None and not reader.done():
            inode = server.output_inode
            holders: list[tuple[int, str]] = []
            with contextlib.suppress(CallTimeout, LaneBusy):
                holders = await self._lanes[LaneKind.PROC].run(
                    lambda: pipe_holders(inode, frozenset({os.getpid()})), PROC_TIMEOUT_S, "pipe holders")
            for holder, comm in holders:
                self._ctx.emit("server_escaped_process", server_pid=pid, escaped_pid=holder, escaped_name=comm)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(holder, signal.SIGKILL)
            await asyncio.wait([reader], timeout=EXIT_PIPE_GRACE_S)
        server.close()
        self._ctx.post(Exited(pid, code, self.last_line))

    async def _drain(self) -> None:
        done = asyncio.ensure_future(self._requests_done())
        left = asyncio.ensure_future(self._until(lambda: not self._draining()))
        try:
            finished, _ = await asyncio.wait({done, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not done.done():
                done.cancel()
        if done not in finished:
            return  # the policy left DRAINING (its deadline passed, a fault, the exit): nothing more to do
        done.result()  # what the wait raised
        if self._slots is not None:
            await self._slots.after_drain(self._ctx, self.pid)
        # llama-server's graceful exit waits for the requests it answers and its idle keep-alive
        # connections: the watchers' (front door pool, restart samples) and the probe's go now
        # (the next probe opens a new one), just before the SIGTERM.
        with contextlib.suppress(asyncio.TimeoutError):  # bounded: the stop goes on without them
            if self._before_drained_stop is not None:
                await asyncio.wait_for(self._before_drained_stop(self.pid), PROBE_CLOSE_TIMEOUT_S)
            await asyncio.wait_for(self.probe.aclose(), PROBE_CLOSE_TIMEOUT_S)
        self._ctx.post(Drained(self.pid))

    async def _save_slots(self) -> None:
        if self._slots is not None:
            await self._slots.before_reset_stop(self._ctx, self.pid)
        self._ctx.post(SlotsSaved(self.pid))

    async def _requests_done(self) -> None:
        """No client request left in flight: the front door's count when it is on (it sees every
        request), else no slot of ``/slots`` processing."""
        if self._front is None or not await self._front.wait_requests_done():
            await self.probe.wait_idle()

    async def end(self) -> None:
        """Cancel this server's tasks and close its probe client, log file and pidfd (bounded); the
        closing is done even when this is cancelled meanwhile (the daemon's shutdown cancels its tasks)."""
        try:
            for task in self.tasks:
                if task is not asyncio.current_task():
                    task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        finally:
            self.tasks.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.probe.aclose(), PROBE_CLOSE_TIMEOUT_S)
            if self.log is not None:
                self.log.close()
            self.server.close()
