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
  next start rolls back. After the probation it is the last good build (``upgrade_kept`` when it
  replaced another) and a copy of it is kept.

``status`` shows the serving build, the one on probation, the last refused one with its cause, and
the kept copies (:meth:`UpgradeSource.snapshot`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from llama_guard.argv import resolve_binary
from llama_guard.config import Config
from llama_guard.core.child import child_environ
from llama_guard.core.inputs import Exited
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.core.ports import BuildChoice, BuildRefused, ReloadBuild
from llama_guard.core.transition import Transition
from llama_guard.core.types import AfterStop, exit_text
from llama_guard.core.watcher import Context, Watcher
from llama_guard.upgrade.build import HELP_TIMEOUT_S, VERSION_TIMEOUT_S, Build, file_sha256, identify, stamp_of
from llama_guard.upgrade.kept import COPY_TIMEOUT_S, Kept, builds_dir, keep, listing, verified
from llama_guard.upgrade.preflight import Preflight, preflight
from llama_guard.vocab.events import EventName
from llama_guard.vocab.phases import Phase

PREFLIGHT_CALL_S = VERSION_TIMEOUT_S + HELP_TIMEOUT_S + 30.0  # both runs, the hash and the argv's own --help


@dataclass(frozen=True)
class _Identify:
    """Identify the build of server ``pid`` (started from ``path`` unverified), ready since ``at``."""

    path: Path
    pid: int
    at: float


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
    return before.phase in (Phase.STARTING, Phase.READY) or (
        before.phase is Phase.STOPPING and before.after_stop not in (AfterStop.RESTART, AfterStop.EXIT))


class UpgradeSource(Watcher):
    """Preflight, probation and roll-back of llama-server builds; the daemon's build port
    (:class:`llama_guard.core.ports.BuildPort`)."""

    name = "build"

    def __init__(self) -> None:
        self._probe = Lane(LaneKind.PROBE, max_calls=2)  # running the builds (an identification beside a preflight)
        self._files = Lane(LaneKind.CONFIG, max_calls=1)  # hashing and copying kept builds
        self._ctx: Context | None = None
        self._passed: dict[tuple[str, tuple[int, int, int, int], str], Build] = {}
        self._failed: dict[str, str] = {}  # sha256 → why that build is not started again
        self._reported: set[tuple[str, str]] = set()  # (event, sha256 or path) already emitted
        self._pids: dict[int, Build | Path] = {}
        self._chosen: Build | Path | None = None  # a Path: not identified yet
        self.serving: Build | None = None
        self._serving_since: float | None = None
        self._proven = False
        self._previous: Build | None = None  # the good build before the one on probation
        self.refused: _Refusal | None = None
        self._kept: list[Kept] = []
        self._jobs: asyncio.Queue[Build | _Identify] = asyncio.Queue()  # copies to keep, builds to identify

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
        try:
            stamp = stamp_of(binary)
        except OSError as exc:
            return Preflight(None, f"{binary}: {exc.strerror or exc}")
        key = (str(binary), stamp, config.server.model_dump_json())
        if key in self._passed:
            return Preflight(self._passed[key], "")
        what = f"preflight of {binary}"
        try:
            result = await self._probe.run(lambda: preflight(config, binary), PREFLIGHT_CALL_S, what)
        except (CallTimeout, LaneBusy):
            self._emit("blocking_call_timeout", call=what, timeout_s=PREFLIGHT_CALL_S, effect=effect)
            return None
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
        binary = resolve_binary(new.server.binary)
        if binary is None:
            return ReloadBuild.SAME  # the reload's own check refuses it, naming the path
        result = await self._preflight(new, binary, "the reload is refused; the running configuration stays")
        if result is None:  # the running configuration stays: it is known to serve
            self.refused = _Refusal(str(binary), "unknown", f"the preflight of {binary} did not finish")
            return ReloadBuild.REFUSED
        if result.passed and result.build is not None:
            self.refused = None  # the configuration now names a build that passes
            if self.serving is None or result.build.same_as(self.serving):
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
        if self.serving is None and self._previous is None and not self._kept:
            # Nothing to fall back to: started as before (llama-server names what it refuses, and
            # the policy judges it); the build is identified once it is ready.
            self._chosen = binary
            return BuildChoice(binary)
        result = await self._preflight(ctx.config, binary, "the server is started without it")
        if result is None:  # started unverified, as before preflights: a hung disk is no build fault
            self._chosen = None
            return BuildChoice(binary)
        build = result.build
        if result.passed and build is not None and build.sha256 not in self._failed:
            self._chosen = build
            return BuildChoice(binary)
        cause = self._failed[build.sha256] if result.passed and build is not None else result.cause
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
            self._emit("upgrade_rolled_back", from_build=build.short if build is not None else "unknown",
                       from_binary=str(binary), to_build=good[0].short, to_binary=str(good[1].binary), cause=cause)
        self._chosen = good[0]
        return good[1]

    async def _last_good(self, config: Config, *, exclude: Build | None) -> tuple[Build, BuildChoice] | None:
        """The build to roll back to: the serving (or previous) one while its file still holds it,
        else the newest kept copy that passes :func:`~llama_guard.upgrade.kept.verified`."""
        for build in (self.serving, self._previous):
            if build is None or build.sha256 in self._failed or build.same_content(exclude):
                continue
            path = build.path
            try:
                digest = await self._files.run(partial(file_sha256, path), COPY_TIMEOUT_S, f"hashing {path}")
            except (OSError, CallTimeout, LaneBusy):
                continue
            if digest == build.sha256:
                return build, BuildChoice(path, self._library_dir(config, path))
        root = self._root(config)
        with contextlib.suppress(CallTimeout, LaneBusy):
            self._kept = await self._files.run(partial(listing, root), COPY_TIMEOUT_S, f"listing {root}")
        for kept in self._kept:
            if kept.build.sha256 in self._failed or kept.build.same_content(exclude):
                continue
            try:
                problem = await self._files.run(partial(verified, kept), COPY_TIMEOUT_S,
                                         f"checking {kept.dir}")
            except (CallTimeout, LaneBusy) as exc:
                problem = str(exc)
            if problem:
                self._emit("upgrade_copy_failed", build=kept.build.short, dir=str(kept.dir), reason=problem)
                continue
            return kept.build, BuildChoice(kept.build.path, kept.dir)
        return None

    def _library_dir(self, config: Config, path: Path) -> Path | None:
        """The kept directory when ``path`` is a kept copy's executable, else None."""
        root = self._root(config)
        return path.parent if path.parent.parent == root else None

    # ------------------------------------------------------------ the watcher

    async def start(self, ctx: Context) -> str | None:
        self._ctx = ctx
        root = self._root(ctx.config)
        try:
            self._kept = await self._files.run(partial(listing, root), COPY_TIMEOUT_S, f"listing {root}")
        except (CallTimeout, LaneBusy):
            self._kept = []
        return None

    async def run(self, ctx: Context) -> None:
        """Identify the build of a server started unverified once it is ready; keep a copy of each
        build that passed its probation; one at a time."""
        while True:
            job = await self._jobs.get()
            if isinstance(job, _Identify):
                await self._identify(ctx, job)
                continue
            build, root = job, self._root(ctx.config)
            try:
                kept = await self._files.run(partial(keep, build, root), COPY_TIMEOUT_S, f"keeping {build.path}")
            except (OSError, CallTimeout, LaneBusy) as exc:
                ctx.emit("upgrade_copy_failed", build=build.short, dir=str(root), reason=str(exc))
                continue
            self._kept = await self._files.run(partial(listing, root), COPY_TIMEOUT_S, f"listing {root}")
            ctx.emit("upgrade_copy_kept", build=kept.build.short, dir=str(kept.dir), files=len(kept.files),
                     kept=len(self._kept))

    async def _identify(self, ctx: Context, job: _Identify) -> None:
        env = child_environ(os.environ, ctx.config.server.env)
        try:
            build, _ = await self._probe.run(partial(identify, job.path, VERSION_TIMEOUT_S, env), PREFLIGHT_CALL_S,
                                             f"{job.path} --version")
        except (CallTimeout, LaneBusy):
            return
        if build is not None and job.pid in self._pids:
            self._pids[job.pid] = build
            self._ready(build, job.at)

    async def _identify_serving(self) -> None:
        """Identify the ready server's build now when it was started unverified and is not yet."""
        ctx = self._ctx
        pid = ctx.state.pid if ctx is not None else None
        entry = self._pids.get(pid) if pid is not None else None
        if ctx is not None and pid is not None and isinstance(entry, Path) and ctx.state.phase is Phase.READY:
            await self._identify(ctx, _Identify(entry, pid, ctx.clock()))

    def on_spawn(self, ctx: Context, pid: int) -> None:
        if self._chosen is not None:
            self._pids[pid] = self._chosen

    def on_exit(self, ctx: Context, pid: int, returncode: int | None) -> None:
        self._pids.pop(pid, None)

    def on_transition(self, ctx: Context, step: Transition) -> None:
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
                self._failed_exit(failed, step)
        if (self.serving is not None and not self._proven and self._serving_since is not None
                and step.after.phase is Phase.READY
                and step.at - self._serving_since >= ctx.config.upgrade.probation_s):
            self._pass_probation(ctx)

    def _ready(self, build: Build, at: float) -> None:
        if build.same_as(self.serving):
            return
        if self.serving is not None and (self._proven or self._previous is None):
            self._previous = self.serving  # the build that served before (proven if one was)
        self.serving, self._serving_since, self._proven = build, at, False

    def _last_good_build(self) -> Build | None:
        """The build a failing new one is judged against: the serving one once proven, else the one
        before it, else the newest kept copy."""
        if self.serving is not None and self._proven:
            return self.serving
        return self._previous if self._previous is not None else (self._kept[0].build if self._kept else None)

    def _failed_exit(self, build: Build, step: Transition) -> None:
        """A server of ``build`` exited unasked: a new build (not proven here) is marked failed when a
        different good build exists to go back to — the serving one for a build that died loading,
        the one before it (or the newest kept copy) for a build that crashed in its probation."""
        on_probation = build.same_as(self.serving)
        if on_probation and self._proven:
            return
        good = self._last_good_build() if on_probation else (self.serving or self._last_good_build())
        if good is None or build.same_content(good):
            return
        assert isinstance(step.input, Exited)
        how = exit_text(step.input.returncode)
        when = ("while loading" if self._serving_since is None or not on_probation else
                f"{step.at - (self._serving_since or step.at):.0f} s into its probation")
        self._failed[build.sha256] = f"llama-server {build.short} {how} {when}"
        if on_probation:
            self.serving, self._serving_since, self._proven = self._previous, None, self._previous is not None

    def _pass_probation(self, ctx: Context) -> None:
        assert self.serving is not None
        previous = self._last_good_build()
        self._proven = True
        if previous is not None and not previous.same_as(self.serving):
            ctx.emit("upgrade_kept", build=self.serving.short, binary=str(self.serving.path),
                     previous_build=previous.short, probation_s=ctx.config.upgrade.probation_s)
        self._previous = None
        if self._library_dir(ctx.config, self.serving.path) is None:
            self._jobs.put_nowait(self.serving)

    def snapshot(self) -> dict[str, Any] | None:
        def shown(build: Build | None) -> dict[str, str] | None:
            return None if build is None else {"binary": str(build.path), "build": build.short,
                                               "version": build.version, "sha256": build.sha256}
        return {
            "serving": shown(self.serving),
            "on_probation": self.serving is not None and not self._proven,
            "refused": (None if self.refused is None else
                        {"binary": self.refused.binary, "build": self.refused.build, "cause": self.refused.cause}),
            "kept": [{"build": k.build.short, "dir": str(k.dir)} for k in self._kept],
        }
