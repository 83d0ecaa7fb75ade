"""The probation's rules (upgrade/lineage.py), without a file or a process: which build a failure marks,
which one serves after it, and that a build with the last good one's content is never marked failed
(nothing would be left to go back to)."""

from __future__ import annotations

import signal
from pathlib import Path

from llama_guard.host.build import Build
from llama_guard.upgrade.lineage import Lineage

GOOD = Build(Path("/opt/good/llama-server"), "a" * 64, "version: 1", "b1")
NEW = Build(Path("/opt/new/llama-server"), "b" * 64, "version: 2", "b2")
COPY = Build(Path("/opt/copy/llama-server"), GOOD.sha256, "version: 1", "b1")  # the good content elsewhere


def proven(build: Build = GOOD, kept: Build | None = None) -> Lineage:
    lineage = Lineage(lambda: kept)
    lineage.ready(build, 0.0)
    assert lineage.probation_over(600.0, 600.0)
    lineage.pass_probation()
    return lineage


def test_a_new_build_is_on_probation_until_its_time_has_passed_then_replaces_the_last_good() -> None:
    lineage = proven()
    lineage.ready(NEW, 1000.0)
    assert lineage.on_probation(NEW) and lineage.last_good() == GOOD
    assert not lineage.probation_over(1599.0, 600.0) and lineage.probation_over(1600.0, 600.0)
    assert lineage.pass_probation() == GOOD
    assert lineage.last_good() == NEW and not lineage.on_probation(NEW)


def test_the_first_build_replaces_none_and_a_kept_copy_is_the_last_good_of_a_fresh_daemon() -> None:
    assert proven().pass_probation() is None  # proven again: it replaced itself
    fresh = Lineage(lambda: GOOD)
    fresh.ready(NEW, 0.0)
    assert fresh.on_probation(NEW) and fresh.last_good() == GOOD


def test_a_crash_in_the_probation_marks_the_new_build_and_the_good_one_serves_again() -> None:
    lineage = proven()
    lineage.ready(NEW, 1000.0)
    lineage.exited(NEW, -signal.SIGSEGV, 1012.0)
    assert lineage.failed == {NEW.sha256: f"llama-server {NEW.short} killed by SIGSEGV 12 s into its probation"}
    assert lineage.serving == GOOD and lineage.proven and lineage.since is None


def test_a_build_that_dies_loading_is_marked_and_the_serving_one_stays() -> None:
    lineage = proven()
    lineage.exited(NEW, 1, 1000.0)  # never ready: not the serving build
    assert lineage.failed[NEW.sha256].endswith("exit status 1 while loading")
    assert lineage.serving == GOOD and lineage.proven


def test_an_exit_of_a_proven_build_or_of_the_only_build_marks_nothing() -> None:
    lineage = proven()
    lineage.exited(GOOD, -signal.SIGKILL, 5000.0)  # the liveness watch's business
    alone = Lineage(lambda: None)
    alone.ready(NEW, 0.0)
    alone.exited(NEW, -signal.SIGSEGV, 10.0)  # nothing to go back to
    assert lineage.failed == {} and alone.failed == {}


def test_the_good_builds_content_elsewhere_is_never_marked_failed() -> None:
    """A copy of the serving build at another path (a kept copy named in the configuration): a trial's
    noise or a crash of it marks nothing — the hash is the good build's."""
    lineage = proven()
    assert lineage.trial_failed(COPY, "decoded 30 % slower") is False
    lineage.ready(COPY, 1000.0)
    assert not lineage.on_probation(COPY)
    lineage.exited(COPY, -signal.SIGSEGV, 1010.0)
    assert lineage.failed == {}
    assert lineage.trial_failed(NEW, "decoded 30 % slower") is True
    assert lineage.failed == {NEW.sha256: "decoded 30 % slower"}


def test_errors_confirmed_on_probation_mark_the_serving_build_and_fall_back() -> None:
    lineage = proven()
    lineage.ready(NEW, 1000.0)
    lineage.serving_failed("answered 500 to llama-guard's own request")
    assert lineage.failed == {NEW.sha256: "answered 500 to llama-guard's own request"}
    assert lineage.serving == GOOD and lineage.proven


def test_the_last_good_build_dying_while_a_new_one_is_on_probation_is_never_marked_failed() -> None:
    """The last good build started again while a new one is on probation (a reload back to it, or its
    trial against the new one) and dying loading, or losing that trial: it stays the build to go back
    to — marking it would leave the new build, unproven, with nothing behind it (nor its kept copies)."""
    lineage = proven()
    lineage.ready(NEW, 1000.0)
    lineage.exited(GOOD, 1, 1010.0)  # died loading
    lineage.exited(COPY, -signal.SIGSEGV, 1020.0)  # its content elsewhere (a kept copy)
    assert lineage.trial_failed(GOOD, "decoded 30 % slower") is False
    assert lineage.failed == {} and lineage.last_good() == GOOD
    lineage.exited(NEW, -signal.SIGSEGV, 1030.0)  # the new build crashes: back to the good one
    assert lineage.serving == GOOD and set(lineage.failed) == {NEW.sha256}


def test_two_new_builds_in_a_row_keep_the_last_proven_one_to_go_back_to() -> None:
    lineage = proven()
    newer = Build(Path("/opt/newer/llama-server"), "c" * 64, "version: 3", "b3")
    lineage.ready(NEW, 1000.0)
    lineage.ready(newer, 1100.0)  # a second upgrade before the first one's probation ended
    assert lineage.on_probation(newer) and lineage.last_good() == GOOD
    lineage.exited(newer, -signal.SIGSEGV, 1110.0)
    assert lineage.serving == GOOD and lineage.proven and set(lineage.failed) == {newer.sha256}


def test_a_fresh_daemon_whose_new_build_fails_on_probation_goes_back_to_its_kept_copy() -> None:
    """Nothing served before in this run, a kept copy is the last good: the new build's failure is
    recorded and nothing serves until the copy is started (it is then not on probation: its content
    is the good one)."""
    lineage = Lineage(lambda: COPY)
    lineage.ready(NEW, 0.0)
    lineage.serving_failed("answered 500 to llama-guard's own request")
    assert lineage.serving is None and lineage.last_good() == COPY and set(lineage.failed) == {NEW.sha256}
    lineage.ready(COPY, 10.0)
    assert not lineage.on_probation(COPY)
    lineage.exited(COPY, -signal.SIGSEGV, 20.0)
    assert set(lineage.failed) == {NEW.sha256}


def test_one_sigkill_is_ridden_out_and_a_second_marks_the_build() -> None:
    """A SIGKILL comes from outside the build (the README's own ``kill -9``, the OOM killer taking the
    largest process): the first one during the probation, or while loading, starts the same build again;
    the second is a repeated failure and rolls back. A proven build starts from none."""
    lineage = proven()
    lineage.ready(NEW, 1000.0)
    lineage.exited(NEW, -signal.SIGKILL, 1006.0)
    assert lineage.failed == {} and lineage.serving == NEW and lineage.on_probation(NEW)
    lineage.exited(NEW, -signal.SIGKILL, 1030.0)
    assert lineage.failed[NEW.sha256] == (f"llama-server {NEW.short} killed by SIGKILL (likely the kernel's OOM "
                                          "killer, or an operator), 2 times 30 s into its probation")
    assert lineage.serving == GOOD
    loading = proven()
    loading.exited(NEW, -signal.SIGKILL, 2000.0)  # while loading: the same rule
    assert loading.failed == {}
    loading.exited(NEW, -signal.SIGKILL, 2010.0)
    assert loading.failed[NEW.sha256].endswith("2 times while loading")
