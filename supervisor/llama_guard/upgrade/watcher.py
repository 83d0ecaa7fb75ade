"""The upgrade watcher: a new llama-server build is an upgrade, never an outage.

- A reload (:meth:`UpgradeSource.vet_reload`) whose build (the path, or the content at the path) or
  ``[server]`` differs is preflighted (:mod:`.preflight`) while the running server serves; a failure
  is ``upgrade_refused`` naming the flag or the cause (``config_error`` when the build is the serving
  one and only the flags changed), and the running configuration stays.
- Every start (:meth:`UpgradeSource.before_spawn`) while a last good build is at hand: a build not
  seen before (a binary replaced in place) is preflighted too; one that fails, or that failed to load
  or crashed in its probation, is replaced by the last good build — the serving one while its file is
  unchanged, else a kept copy (:mod:`.kept`), verified by hash — with ``upgrade_rolled_back``. With
  none at hand (a first start on a fresh state directory) the configured build starts as before
  (llama-server names what it refuses; the policy judges it) and is identified once ready.
- A new build that becomes ready is on probation for ``[upgrade].probation_s``: an exit of it that
  the daemon did not ask for (died loading, crashed on its first requests) marks it failed and the
  next start rolls back (the rules: :mod:`.lineage`); so do ``[front].hold_after_errors`` client
  requests it answered 5xx that llama-guard's own requests confirm (``/health`` fine, an endpoint
  broken: :mod:`.confirm`), through a drained restart. After the probation it is the last good build
  (``upgrade_kept`` when it replaced another) and a copy of it is kept, once that copy started
  (``--version``) as a roll-back would start it.

``status`` shows the serving build, the one on probation, the last refused one with its cause, and
the kept copies (:meth:`UpgradeSource.snapshot`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from llama_guard.config import Config
from llama_guard.config.argv import resolve_binary
from llama_guard.core.child import child_environ
from llama_guard.core.client import Cancel
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.core.ports import BuildChoice, BuildRefused, ReloadBuild
from llama_guard.core.privileges import ServerIdentity, resolve_identity, server_user_argv, unexecutable_by
from llama_guard.host.build import HELP_TIMEOUT_S, VERSION_TIMEOUT_S, Build, file_sha256, identify, stamp_of
from llama_guard.model.inputs import Exited, SpeedMeasured, TrialAsked, UpstreamError
from llama_guard.model.transition import Transition
from llama_guard.model.types import AfterStop, TrialResult
from llama_guard.model.watcher import Context, Watcher
from llama_guard.upgrade.confirm import Confirm, ProbationErrors
from llama_guard.upgrade.figures import flags_key, record, recorded
from llama_guard.upgrade.kept import COPY_TIMEOUT_S, Kept, builds_dir, discard, keep, listing, share, verified
from llama_guard.upgrade.lineage import Lineage
from llama_guard.upgrade.preflight import Preflight, copy_problem, preflight
from llama_guard.vocab.events import EventName
from llama_guard.vocab.phases import Phase

PREFLIGHT_CALL_S = VERSION_TIMEOUT_S + HELP_TIMEOUT_S + 30.0  # both runs, the hash and the argv's own --help

DecodeSpeed = Callable[[str, str, int, int, float, Cancel], float]
"""``(base_url, api_key, runs, tokens, timeout_s, cancel) -> median decode tokens/s`` as ``llama-guard
bench`` measures it (blocking; raises ``RuntimeError`` or ``OSError`` on a failed completion, and once
``cancel`` is set): the daemon's wiring hands in :func:`llama_guard.tune.bench.decode_speed`."""


def _rounded(tps: float | None) -> float | None:
    return None if tps is None else round(tps, 2)


@dataclass(frozen=True)
class _Identify:
    """Identify the build of server ``pid`` (started from ``path`` unverified), ready since ``at``."""

    path: Path
    pid: int
    at: float


@dataclass(frozen=True)
class _Record:
    """Record trial figures (sha256 → decode tokens/s) measured with flags ``key``."""

    figures: dict[str, float]
    key: str


@dataclass(frozen=True)
class _Refusal:
    binary: str
    build: str
    cause: str


def _unplanned(step: Transition) -> bool:
    """Whether this step is the exit of a server that failed: it exited while loading or serving, or
    the daemon was stopping it for a fault (a CUDA error line, a hang) — not for a planned restart
    or the daemon's own stop."""
    if not isinstance(step.input, Exited):
        return False
    before = step.before
    return before.phase in (Phase.STARTING, Phase.READY, Phase.TRIAL) or (
        before.phase is Phase.STOPPING and before.after_stop not in (AfterStop.RESTART, AfterStop.EXIT))


def _server_identity(config: Config) -> ServerIdentity | None:
    """``[server].user``'s identity; None when it does not resolve (a user gone: the start names it)."""
    server = config.server
    try:
        return resolve_identity(server.user, server.group, server.supplementary_groups)
    except ValueError:
        return None


def _still_runs(build: Build, identity: ServerIdentity | None) -> bool:
    """Whether ``build``'s file still holds it and llama-server as ``identity`` can execute it.
    Blocking; raises OSError."""
    return file_sha256(build.path) == build.sha256 and not unexecutable_by(identity, build.path)


class UpgradeSource(Watcher):
    """Preflight, probation and roll-back of llama-server builds; the daemon's build port
    (:class:`llama_guard.core.ports.BuildPort`)."""

    name = "build"

    def __init__(self, measure: DecodeSpeed | None = None) -> None:
        """``measure``: a trial's measurement of a server's decode speed (None: a trial's measurement
        answers that none is available, and the new build is rolled back)."""
        self._measure = measure
        self._errors = ProbationErrors()  # client 5xx answers by the build on probation
        self._trial = Lane(LaneKind.TRIAL)
        self.last_trial: dict[str, Any] | None = None  # the last trial with both builds, for status
        self._probe = Lane(LaneKind.PROBE, max_calls=2)  # running the builds (an identification beside a preflight)
        self._files = Lane(LaneKind.CONFIG, max_calls=1)  # copying kept builds, recording trial figures (run())
        # Checks before a start (hashes, kept copies, recorded figures): a lane of their own, so that a
        # copy under way (seconds to minutes for a build's libraries) never makes a roll-back find
        # no build to go back to.
        self._checks = Lane(LaneKind.CONFIG, max_calls=1)
        self._ctx: Context | None = None
        self._passed: dict[tuple[str, tuple[int, int, int, int], str], Build] = {}
        self.lineage = Lineage(lambda: self._kept[0].build if self._kept else None)
        self._reported: set[tuple[str, str]] = set()  # (event, sha256 or path) already emitted
        self._pids: dict[int, Build | Path] = {}
        self._chosen: Build | Path | None = None  # a Path: not identified yet
        self.refused: _Refusal | None = None
        self._kept: list[Kept] = []
        # copies to keep, builds to identify, trial figures to record
        self._jobs: asyncio.Queue[Build | _Identify | _Record | Confirm] = asyncio.Queue()
        self._baseline_recorded = False  # the trial under way compares with a recorded figure
        self._trial_figures: dict[str, dict[str, object]] = {}  # sha256 → the figures of its failed trial
        self._measuring: Cancel | None = None  # the trial's measurement under way
        # The policy as the loop's last record showed it (on_transition; never read from the live state):
        # whether a trial is under way, and the server it holds READY (None: none).
        self._trial_under_way = False
        self._ready_pid: int | None = None

    @property
    def serving(self) -> Build | None:
        """The build that serves (None: not identified yet)."""
        return self.lineage.serving

    # ------------------------------------------------------------ helpers

    def _emit(self, name: EventName, **fields: object) -> None:
        if self._ctx is not None:
            self._ctx.emit(name, **fields)

    def _root(self, config: Config) -> Path:
        return builds_dir(config.runtime.dir)

    async def _preflight(self, config: Config, binary: Path, effect: str) -> Preflight | None:
        """:func:`preflight` on the probe lane; None when it did not return in time (a hung
        filesystem: the runs themselves are bounded) or the lane is busy, reported as
        ``blocking_call_timeout`` with ``effect`` (what the caller does then)."""
        what = f"preflight of {binary}"
        try:  # the stat too off the loop: a hung filesystem must not stop the daemon
            stamp = await self._probe.run(partial(stamp_of, binary), PREFLIGHT_CALL_S, what)
            key = (str(binary), stamp, config.server.model_dump_json())
            if key in self._passed:
                return Preflight(self._passed[key], "")
            result = await self._probe.run(lambda: preflight(config, binary), PREFLIGHT_CALL_S, what)
        except (CallTimeout, LaneBusy):  # first: CallTimeout is a TimeoutError, an OSError
            self._emit("blocking_call_timeout", call=what, timeout_s=PREFLIGHT_CALL_S, effect=effect)
            return None
        except OSError as exc:  # the stat's
            return Preflight(None, f"{binary}: {exc.strerror or exc}")
        if result.passed and result.build is not None:
            self._passed[key] = result.build
        return result

    def _refuse(self, binary: Path, result: Preflight, serving_text: str, *, once: bool) -> None:
        """``upgrade_refused`` for ``binary`` (``once``: not again for the same build, as each start
        of a failing build would repeat it; a reload always reports its outcome)."""
        shown = result.build.short if result.build is not None else "unknown"
        self.refused = _Refusal(str(binary), shown, result.cause)
        mark = ("upgrade_refused", result.build.sha256 if result.build is not None else str(binary))
        if once and mark in self._reported:
            return
        self._reported.add(mark)
        self._emit("upgrade_refused", binary=str(binary), build=shown, cause=result.cause,
                   serving_build=self.serving.short if self.serving is not None else "none",
                   outcome=serving_text)

    # ------------------------------------------------------------ the port

    async def vet_reload(self, old: Config, new: Config) -> ReloadBuild:
        await self._identify_serving()
        try:  # a $PATH lookup stats files: off the loop
            binary = await self._probe.run(partial(resolve_binary, new.server.binary), PREFLIGHT_CALL_S,
                                           f"looking up {new.server.binary}")
        except (CallTimeout, LaneBusy):
            what = f"looking up {new.server.binary}"
            self._emit("blocking_call_timeout", call=what, timeout_s=PREFLIGHT_CALL_S,
                       effect="the reload is refused; the running configuration stays")
            self.refused = _Refusal(new.server.binary, "unknown", f"{what} did not finish")
            return ReloadBuild.REFUSED
        if binary is None:
            return ReloadBuild.SAME  # the reload's own check refuses it, naming the path
        result = await self._preflight(new, binary, "the reload is refused; the running configuration stays")
        if result is None:  # the running configuration stays: it is known to serve
            self.refused = _Refusal(str(binary), "unknown", f"the preflight of {binary} did not finish")
            return ReloadBuild.REFUSED
        if result.passed and result.build is not None and result.build.sha256 in self.lineage.failed \
                and not result.build.same_content(self.serving):
            # it failed here before (loading, its trial or its probation): refused again, saying why,
            # rather than reloaded and then quietly rolled back at the start
            earlier = Preflight(result.build, f"it failed here before: {self.lineage.failed[result.build.sha256]} "
                                              "(a restart of llama-guard forgets it)")
            self._refuse(binary, earlier, "the running configuration and build go on serving", once=False)
            return ReloadBuild.REFUSED
        if result.passed and result.build is not None:
            self.refused = None  # the configuration now names a build that passes
            if self.serving is None or result.build.same_as(self.serving) or (
                    result.build.same_content(self.serving) and self._library_dir(new, binary) is not None):
                # the serving build, or the kept copy of it (the same executable, its libraries checked
                # by hash when kept): no trial — a restart on the new path if the flags ask for one
                return ReloadBuild.SAME
            self._emit("upgrade_preflight_passed", binary=str(binary), build=result.build.short,
                       version=result.build.version, serving_build=self.serving.short)
            return ReloadBuild.NEW
        if result.build is not None and result.build.same_content(self.serving):
            self._emit("config_error", reason=f"{result.cause} (keeping the running configuration)")
        else:
            self._refuse(binary, result, "the running configuration and build go on serving", once=False)
        return ReloadBuild.REFUSED

    async def before_spawn(self, ctx: Context, binary: Path) -> BuildChoice | BuildRefused:
        self._ctx = ctx
        if self.serving is None and self.lineage.previous is None and not self._kept:
            # Nothing to fall back to: started as before (llama-server names what it refuses, and
            # the policy judges it); the build is identified once it is ready.
            self._chosen = binary
            return self._configured(ctx.config, binary)
        result = await self._preflight(ctx.config, binary, "the server is started without it")
        if result is None:  # started unverified, as before preflights: a hung disk is no build fault
            self._chosen = None
            return self._configured(ctx.config, binary)
        build = result.build
        if result.passed and build is not None and build.sha256 not in self.lineage.failed:
            self._chosen = build
            await self._ask_trial(ctx, build)
            return self._configured(ctx.config, binary)
        cause = self.lineage.failed[build.sha256] if result.passed and build is not None else result.cause
        good = await self._last_good(ctx.config, exclude=build)
        if good is None:
            if not result.passed:
                self._refuse(binary, result, "no last good build is kept to fall back to", once=True)
            return BuildRefused(cause)
        if result.passed:  # it passed preflight but failed to load or in its probation
            self.refused = _Refusal(str(binary), build.short if build is not None else "unknown", cause)
        else:
            self._refuse(binary, result, f"rolling back to {good[0].short}", once=True)
        mark = ("upgrade_rolled_back", build.sha256 if build is not None else str(binary))
        if mark not in self._reported:
            self._reported.add(mark)
            figures = self._trial_figures.get(build.sha256, {}) if build is not None else {}
            self._emit("upgrade_rolled_back", from_build=build.short if build is not None else "unknown",
                       from_binary=str(binary), to_build=good[0].short, to_binary=str(good[1].binary), cause=cause,
                       **figures)
        self._chosen = good[0]
        return good[1]

    async def _ask_trial(self, ctx: Context, build: Build) -> None:
        """A start runs ``build`` in place of the serving one without a reload's trial (found replaced at
        the path): ask the policy to measure it against the serving build's figure recorded at its last
        trial here with these flags (none recorded: judged by load, answer and probation)."""
        good = self.serving
        if (good is None or build.same_content(good) or self._trial_under_way
                or ctx.config.upgrade.trial_runs < 1):
            return
        root, key = self._root(ctx.config), flags_key(ctx.config)
        try:
            figure = await self._checks.run(partial(recorded, root, good.sha256, key), COPY_TIMEOUT_S,
                                           f"reading {root}")
        except (CallTimeout, LaneBusy):
            return
        if figure is not None:
            self._baseline_recorded = True
            ctx.post(TrialAsked(figure))

    async def _last_good(self, config: Config, *, exclude: Build | None) -> tuple[Build, BuildChoice] | None:
        """The build to roll back to: the serving (or previous) one while its file still holds it,
        else the newest kept copy that passes :func:`~llama_guard.upgrade.kept.verified` — either one
        executable by ``[server].user`` as it is now (a reload may have changed it)."""
        try:  # the build must run as llama-server runs (the user database may be remote: off the loop)
            identity = await self._checks.run(partial(_server_identity, config), COPY_TIMEOUT_S,
                                              "resolving [server].user")
        except (CallTimeout, LaneBusy):
            identity = None
        for build in (self.serving, self.lineage.previous):
            if build is None or build.sha256 in self.lineage.failed or build.same_content(exclude):
                continue
            path = build.path
            try:
                if await self._checks.run(partial(_still_runs, build, identity), COPY_TIMEOUT_S, f"hashing {path}"):
                    return build, BuildChoice(path, self._library_dir(config, path))
            except (OSError, CallTimeout, LaneBusy):
                continue
        root = self._root(config)
        with contextlib.suppress(CallTimeout, LaneBusy):
            self._kept = await self._checks.run(partial(listing, root), COPY_TIMEOUT_S, f"listing {root}")
        for kept in self._kept:
            if kept.build.sha256 in self.lineage.failed or kept.build.same_content(exclude):
                continue
            try:
                problem = await self._checks.run(partial(verified, kept, identity), COPY_TIMEOUT_S,
                                         f"checking {kept.dir}")
            except (CallTimeout, LaneBusy) as exc:
                problem = str(exc)
            if problem:
                self._emit("upgrade_copy_failed", build=kept.build.short, dir=str(kept.dir), reason=problem)
                continue
            return kept.build, BuildChoice(kept.build.path, kept.dir)
        return None

    def _configured(self, config: Config, binary: Path) -> BuildChoice:
        """The configured ``binary`` as started: with its kept directory's libraries first when it is a
        kept copy (``[server].binary`` pointed at one), as a roll-back to that copy starts it."""
        return BuildChoice(binary, self._library_dir(config, binary))

    def _library_dir(self, config: Config, path: Path) -> Path | None:
        """The kept directory when ``path`` is a kept copy's executable, else None."""
        root = self._root(config)
        return path.parent if path.parent.parent == root else None

    async def measure_speed(self, ctx: Context, pid: int, runs: int, tokens: int) -> SpeedMeasured:
        config = ctx.config
        measure, timeout_s = self._measure, config.upgrade.trial_timeout_s
        if measure is None:
            return SpeedMeasured(pid, None, "no decode-speed measurement is wired in")
        url, key = config.server.base_url, ctx.get_api_key()
        what = f"decode speed of server {pid} ({runs} x {tokens} tokens)"
        cancel = self._measuring = Cancel()
        try:
            tps = await self._trial.run(lambda: measure(url, key, runs, tokens, timeout_s, cancel), timeout_s, what)
        except (RuntimeError, OSError, LaneBusy) as exc:  # CallTimeout is an OSError
            return SpeedMeasured(pid, None, str(exc) or repr(exc))
        finally:
            if self._measuring is cancel:
                self._measuring = None
        return SpeedMeasured(pid, tps)

    def _trial_ended(self, ctx: Context, step: Transition, result: TrialResult) -> None:
        """A trial's verdict: ``upgrade_trial_passed`` (kept), or the new build marked failed with the
        cause, so that the start that follows rolls back to the last good build (``upgrade_rolled_back``
        with both figures)."""
        pid = step.before.pid
        entry = self._pids.get(pid) if pid is not None else None
        new = entry if isinstance(entry, Build) else None
        old = self.serving
        figures: dict[str, object] = {
                   "tokens_per_s": _rounded(result.new_tps), "previous_tokens_per_s": _rounded(result.old_tps),
                   "slowdown_pct": None if result.slowdown_pct is None else round(result.slowdown_pct, 1),
                   "max_slowdown_pct": result.max_slowdown_pct}
        figures["previous_figure"] = ("recorded at its last trial on this box" if self._baseline_recorded
                                      else "measured in this window")
        measured = {} if self._baseline_recorded or old is None or result.old_tps is None else {
            old.sha256: result.old_tps}
        if result.kept and new is not None and result.new_tps is not None:
            measured[new.sha256] = result.new_tps
        if measured:
            self._jobs.put_nowait(_Record(measured, flags_key(ctx.config)))
        self._baseline_recorded = False
        self.last_trial = {"build": new.short if new is not None else "unknown",
                           "previous_build": old.short if old is not None else "unknown",
                           "kept": result.kept, "cause": result.cause, **figures}
        if result.kept:
            ctx.emit("upgrade_trial_passed", build=self.last_trial["build"],
                     binary=str(new.path) if new is not None else "unknown",
                     previous_build=self.last_trial["previous_build"],
                     note=result.cause or "within the limit", **figures)
        elif new is not None and self.lineage.trial_failed(new, result.cause):
            self._trial_figures[new.sha256] = figures

    # ------------------------------------------------------------ the watcher

    async def start(self, ctx: Context) -> str | None:
        self._ctx = ctx
        root = self._root(ctx.config)
        try:
            self._kept = await self._files.run(partial(listing, root), COPY_TIMEOUT_S, f"listing {root}")
        except (CallTimeout, LaneBusy):
            self._kept = []
        if self._kept:  # left 0750 by an older llama-guard under the unit's umask: a roll-back could not run them
            with contextlib.suppress(OSError, LaneBusy):  # CallTimeout is an OSError
                await self._files.run(partial(share, root), COPY_TIMEOUT_S, f"opening {root} to [server].user")
        return None

    async def run(self, ctx: Context) -> None:
        """Identify the build of a server started unverified once it is ready; keep a copy of each
        build that passed its probation; one at a time."""
        while True:
            job = await self._jobs.get()
            if isinstance(job, _Identify):
                await self._identify(ctx, job)
                continue
            if isinstance(job, Confirm):
                await self._errors.confirm(ctx, job, self.lineage, lambda: self._ready_pid)
                continue
            if isinstance(job, _Record):
                with contextlib.suppress(OSError, CallTimeout, LaneBusy):
                    root = self._root(ctx.config)
                    await self._files.run(partial(record, root, job.figures, job.key), COPY_TIMEOUT_S,
                                          f"recording trial figures in {root}")
                continue
            build, root = job, self._root(ctx.config)
            try:
                kept = await self._files.run(partial(keep, build, root), COPY_TIMEOUT_S, f"keeping {build.path}")
            except (OSError, CallTimeout, LaneBusy) as exc:
                ctx.emit("upgrade_copy_failed", build=build.short, dir=str(root), reason=str(exc))
                continue
            if await self._copy_fails(ctx, kept):
                continue
            self._kept = await self._files.run(partial(listing, root), COPY_TIMEOUT_S, f"listing {root}")
            ctx.emit("upgrade_copy_kept", build=kept.build.short, dir=str(kept.dir), files=len(kept.files),
                     kept=len(self._kept))

    async def _copy_fails(self, ctx: Context, kept: Kept) -> bool:
        """Run the new copy as a roll-back would (:func:`copy_problem`); one that does not start is
        removed with ``upgrade_copy_failed`` — a roll-back to it would be an outage. No answer in time:
        kept (a busy disk is no fault of the copy's)."""
        what = f"{kept.build.path} --version"
        try:
            problem = await self._probe.run(partial(copy_problem, ctx.config, kept.build, kept.dir),
                                            PREFLIGHT_CALL_S, what)
        except (CallTimeout, LaneBusy):
            return False
        if not problem:
            return False
        with contextlib.suppress(OSError, CallTimeout, LaneBusy):
            await self._files.run(partial(discard, kept), COPY_TIMEOUT_S, f"removing {kept.dir}")
        ctx.emit("upgrade_copy_failed", build=kept.build.short, dir=str(kept.dir),
                 reason=f"the copy does not start as a roll-back would run it: {problem}")
        return True

    async def _identify(self, ctx: Context, job: _Identify) -> None:
        server = ctx.config.server
        env = child_environ(os.environ, server.env)
        try:  # as llama-server runs (as the preflight runs it), never as root
            prefix = server_user_argv(server.user, server.group, server.supplementary_groups)
            build, _ = await self._probe.run(partial(identify, job.path, VERSION_TIMEOUT_S, env, prefix),
                                             PREFLIGHT_CALL_S, f"{job.path} --version")
        except (ValueError, FileNotFoundError, CallTimeout, LaneBusy):
            return  # not identified: judged as an unknown build
        if build is not None and job.pid in self._pids:
            self._pids[job.pid] = build
            self._ready(build, job.at)

    async def _identify_serving(self) -> None:
        """Identify the ready server's build now when it was started unverified and is not yet."""
        ctx, pid = self._ctx, self._ready_pid
        entry = self._pids.get(pid) if pid is not None else None
        if ctx is not None and pid is not None and isinstance(entry, Path):
            await self._identify(ctx, _Identify(entry, pid, ctx.clock()))

    def on_spawn(self, ctx: Context, pid: int) -> None:
        if self._chosen is not None:
            self._pids[pid] = self._chosen

    def on_exit(self, ctx: Context, pid: int, returncode: int | None) -> None:
        self._pids.pop(pid, None)

    def on_transition(self, ctx: Context, step: Transition) -> None:
        if step.before.phase is Phase.TRIAL and step.after.phase is not Phase.TRIAL and self._measuring is not None:
            # The trial ended without its figure (the daemon's stop, an exit, a fatal line): its
            # requests are cut, so that the server's stop waits for none of them.
            self._measuring.set()
        self._trial_under_way = step.after.trial is not None
        self._ready_pid = step.after.pid if step.after.phase is Phase.READY else None
        result = step.after.last_trial
        if step.before.phase is Phase.TRIAL and result is not None and result is not step.before.last_trial:
            self._trial_ended(ctx, step, result)
        pid = step.after.pid
        if step.entered(Phase.READY) and pid is not None and pid in self._pids:
            entry = self._pids[pid]
            if isinstance(entry, Path):
                self._jobs.put_nowait(_Identify(entry, pid, step.at))
            else:
                self._ready(entry, step.at)
        elif isinstance(step.input, Exited) and _unplanned(step):
            failed = self._pids.get(step.input.pid)
            if isinstance(failed, Build):
                self.lineage.exited(failed, step.input.returncode, step.at)
        elif isinstance(step.input, UpstreamError):
            self._client_5xx(step.input, step)
        if step.after.phase is Phase.READY and self.lineage.probation_over(step.at, ctx.config.upgrade.probation_s):
            self._pass_probation(ctx)

    def _ready(self, build: Build, at: float) -> None:
        if not build.same_as(self.lineage.serving):
            self.lineage.ready(build, at)
            self._errors.reset()

    def _client_5xx(self, error: UpstreamError, step: Transition) -> None:
        """A client request answered HTTP 5xx: on a build on probation, counted towards a confirmation
        (:mod:`.confirm`)."""
        build = self._pids.get(error.pid)
        runs = step.after.params.hold_after_errors
        if runs == 0 or not isinstance(build, Build) or not self.lineage.on_probation(build):
            return
        job = self._errors.count(build, error, runs, step.at)
        if job is not None:
            self._jobs.put_nowait(job)

    def _pass_probation(self, ctx: Context) -> None:
        previous, serving = self.lineage.pass_probation(), self.lineage.serving
        assert serving is not None
        if previous is not None:
            ctx.emit("upgrade_kept", build=serving.short, binary=str(serving.path),
                     previous_build=previous.short, probation_s=ctx.config.upgrade.probation_s)
        if self._library_dir(ctx.config, serving.path) is None:
            self._jobs.put_nowait(serving)

    def snapshot(self) -> dict[str, Any] | None:
        def shown(build: Build | None) -> dict[str, str] | None:
            return None if build is None else {"binary": str(build.path), "build": build.short,
                                               "version": build.version, "sha256": build.sha256}
        return {
            "serving": shown(self.serving),
            # with a different good build to go back to (a first build has none: nothing to judge it against)
            "on_probation": self.serving is not None and self.lineage.on_probation(self.serving),
            "refused": (None if self.refused is None else
                        {"binary": self.refused.binary, "build": self.refused.build, "cause": self.refused.cause}),
            "kept": [{"build": k.build.short, "dir": str(k.dir)} for k in self._kept],
            "trial": self.last_trial,
        }
