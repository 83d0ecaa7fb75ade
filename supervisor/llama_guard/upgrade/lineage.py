"""The builds as the upgrade watcher judges them: which serves, whether it has passed its probation, the
good one before it, and those that failed here — the rules of a probation, without a file or a process.

A build that becomes ready replaces the serving one; it is *on probation* until ``[upgrade].probation_s``
of serving pass while a different good build is at hand (the one before it, else the newest kept copy).
A build that failed (died loading, crashed in its probation — a SIGKILL, which comes from outside the
build, only the second time — a trial's verdict, errors confirmed by llama-guard's own requests) is
recorded by its content hash with the cause, and is not started again while llama-guard runs; the one
it replaced serves again. A failure of a build whose content is the
last good build's (or the serving one's) is never recorded: that would leave nothing to go back to.

The watcher (:mod:`llama_guard.upgrade.watcher`) feeds it and acts on what it answers; times are the
loop's monotonic seconds.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from llama_guard.host.build import Build
from llama_guard.model.types import exit_text

#: SIGKILLs of a build not yet proven that mark it failed: one may be an operator's ``kill -9`` or the
#: OOM killer taking the largest process for another's growth; a second is a repeated failure.
KILLS_TO_FAIL = 2


class Lineage:
    """The serving build, the one before it and the builds that failed here (sha256 → the cause)."""

    def __init__(self, newest_kept: Callable[[], Build | None]) -> None:
        """``newest_kept``: the newest kept copy's build (None: none), the last good build when no
        other is known (a fresh daemon whose state directory keeps one)."""
        self._newest_kept = newest_kept
        self.serving: Build | None = None
        self.since: float | None = None  # when the serving build became ready (None: not since its failure)
        self.proven = False  # the serving build passed its probation
        self.previous: Build | None = None  # the good build before the one on probation
        self.failed: dict[str, str] = {}  # sha256 → why that build is not started again
        self._kills: dict[str, int] = {}  # sha256 → SIGKILLs of a build not yet proven

    def ready(self, build: Build, at: float) -> None:
        """Server of ``build`` ready at ``at``: a build other than the serving one starts its probation."""
        if build.same_as(self.serving):
            return
        if self.serving is not None and (self.proven or self.previous is None):
            self.previous = self.serving  # the build that served before (proven if one was)
        self.serving, self.since, self.proven = build, at, False

    def last_good(self) -> Build | None:
        """The build a failing new one is judged against: the serving one once proven, else the one
        before it, else the newest kept copy."""
        if self.serving is not None and self.proven:
            return self.serving
        return self.previous if self.previous is not None else self._newest_kept()

    def on_probation(self, build: Build) -> bool:
        """Whether ``build`` serves on probation with a different good build to go back to."""
        good = self.last_good()
        return (build.same_as(self.serving) and not self.proven and good is not None
                and not build.same_content(good))

    def probation_over(self, at: float, probation_s: float) -> bool:
        """Whether the serving build, not yet proven, has served ``probation_s`` by ``at``."""
        return (self.serving is not None and not self.proven and self.since is not None
                and at - self.since >= probation_s)

    def pass_probation(self) -> Build | None:
        """The serving build is proven; returns the good build it replaced (None: it replaced none,
        or itself)."""
        assert self.serving is not None
        previous = self.last_good()
        self.proven, self.previous = True, None
        self._kills.pop(self.serving.sha256, None)
        return None if previous is None or previous.same_as(self.serving) else previous

    def exited(self, build: Build, returncode: int | None, at: float) -> None:
        """A server of ``build`` exited unasked (``returncode``: its waitpid status): a new build (not
        proven here) is marked failed when a different good build exists to go back to — the serving
        one for a build that died loading, the one before it (or the newest kept copy) for a build that
        crashed in its probation. A SIGKILL comes from outside the build (an operator's ``kill -9``, the
        kernel's OOM killer): the first one is ridden out (the build is started again), the second marks
        it — a repeated failure."""
        on_probation = build.same_as(self.serving)
        if on_probation and self.proven:
            return
        good = self.last_good() if on_probation else (self.serving or self.last_good())
        if good is None or build.same_content(good) or build.same_content(self.last_good()):
            return  # nothing to go back to, or the build to go back to itself
        how = exit_text(returncode)
        if returncode == -signal.SIGKILL:
            kills = self._kills.get(build.sha256, 0) + 1
            self._kills[build.sha256] = kills
            if kills < KILLS_TO_FAIL:
                return
            how = f"{how}, {kills} times"
        when = ("while loading" if self.since is None or not on_probation else
                f"{at - (self.since or at):.0f} s into its probation")
        self.failed[build.sha256] = f"llama-server {build.short} {how} {when}"
        if on_probation:
            self.fall_back()

    def trial_failed(self, build: Build, cause: str) -> bool:
        """A trial's verdict against ``build``: recorded unless its content is the serving build's or
        the last good one's. Returns whether it was."""
        if build.same_content(self.serving) or build.same_content(self.last_good()):
            return False
        self.failed[build.sha256] = cause
        return True

    def serving_failed(self, cause: str) -> None:
        """The build on probation failed (its errors confirmed): recorded, and the one before it serves."""
        assert self.serving is not None
        self.failed[self.serving.sha256] = cause
        self.fall_back()

    def fall_back(self) -> None:
        """The build on probation failed: the good one before it is the serving one again (proven when
        there was one)."""
        self.serving, self.since, self.proven = self.previous, None, self.previous is not None
