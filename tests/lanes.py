"""The suite's three lanes, one list each (file stems), so that ``make test`` runs fast first:

* ``fast`` (:data:`FAST_MODULES`, ``make test-fast``, ``pytest --fast``): modules that start no process and use
  no socket — seconds, run first and alone;
* ``serial`` (:data:`SERIAL_TESTS`, ``pytest -m serial``): the few tests that load the CPU on purpose — run
  last, one at a time, so that their load decides no other test's verdict;
* everything else — the real llama-server, journald, systemd — runs in parallel (``pytest -n``,
  pytest-xdist), each worker with its own ports (harness.free_port) and directories (``tmp_path``); the tests
  of a module-scoped fixture stay on one worker (an ``xdist_group`` per module, ``--dist loadgroup``).

A module nobody listed runs in the parallel lane. Under ``--fast`` a guard records
every process start (``subprocess``, ``fork``, ``posix_spawn``) and every socket ``bind``,
``connect`` or ``sendto`` a test makes, and fails the test at teardown naming the first one — even
when the code under test caught the error the guard raised. ``socket.socketpair`` (asyncio's own
wake-up pipe) is allowed: it reaches nothing outside the process.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: Test modules (file stems) that start no process and open no socket: ``make test-fast``.
FAST_MODULES: frozenset[str] = frozenset((
    "test_bench_size",
    "test_binary_problem",
    "test_budget",
    "test_ceiling",
    "test_classify",
    "test_compare_other",
    "test_decay",
    "test_front_decoded",
    "test_front_hold",
    "test_front_resume",
    "test_gpu_h200_fixture",
    "test_gpu_nvml",
    "test_gpu_watch",
    "test_h200_daemon_fixture",
    "test_judgement",
    "test_kubernetes_manifests",
    "test_layers",
    "test_metrics_table",
    "test_offload",
    "test_phase_table",
    "test_policy",
    "test_policy_edges",
    "test_policy_error_run",
    "test_policy_lend",
    "test_policy_phase_data",
    "test_policy_port",
    "test_policy_reset",
    "test_policy_reset_save",
    "test_policy_restart_asked",
    "test_policy_stop_drain",
    "test_policy_vram",
    "test_policy_window",
    "test_port_scan",
    "test_preflight_gpu",
    "test_public_reports",
    "test_readiness",
    "test_recovery_defaults",
    "test_reload_values",
    "test_repeat",
    "test_restart_cause",
    "test_restart_time",
    "test_schedule",
    "test_schedule_source",
    "test_settings_declared",
    "test_slots_files",
    "test_slots_rolling",
    "test_slots_store",
    "test_stderr_output",
    "test_suspects",
    "test_tasks",
    "test_transparency",
    "test_upgrade_figures",
    "test_upgrade_follows_records",
    "test_upgrade_lineage",
    "test_upgrade_rollback_lane",
    "test_vram_wait_h200_fixture",
))

#: Tests (``module::test``, or a whole module) that must not share the CPU with other tests: they load it on
#: purpose for a minute, which would starve the fast-probing tests of the other workers, or their promise is
#: a bound on a real server's stop and load that 4 workers on 2 cores can break.
SERIAL_TESTS: frozenset[str] = frozenset((
    # the trials of a new build: their verdicts compare two builds' decode speeds measured a minute apart
    "test_upgrade_trial_e2e",
    "test_upgrade_errors_e2e::test_a_build_that_passes_its_trial_then_answers_500_is_rolled_back_in_its_probation",
    # 40 s of long-prompt batches at the shipped liveness defaults: busy, never hung
    "test_judgement_real::test_busy_with_long_prompt_batches_is_never_hung_at_shipped_defaults",
    # a process spinning a core until the silence bound (20 s here)
    "test_liveness_real::test_a_spinning_process_whose_server_answers_nothing_is_hung_within_the_silence_bound",
    # the canary between a conversation's turns: a turn that runs long on a loaded host leaves no idle slot
    "test_liveness_real::test_liveness_rounds_between_turns_never_displace_the_conversation",
    # one daemon for the module whose cron fires at the next minute: on a loaded host a test runs late and
    # the fire lands inside the next test (llama-server then answers 503 "Loading model" to it)
    "test_schedule_e2e",
    # the next server must be ready within [front].hold_timeout_s of the drain's end: under 4 workers on 2
    # cores its stop, start and load once took longer (3 held requests 503 in a clean-clone CI run)
    "test_front_e2e::test_planned_restart_whose_drain_outlasts_hold_timeout_fails_no_request",
    # the connection ramp must outpace llama-server's keep-alive (5 s) to hold its RLIMIT_NOFILE full: on a
    # loaded host the server answered /health again at the limit (a clean-clone run under load)
    "test_limits_e2e::test_limit_low_fires_before_the_server_stops_accepting",
    # tune's trial servers beside a daemon that lends the GPU: they load both cores on purpose
    "test_tune_window_e2e",
    # tune's verdict that the flags it applied decode faster (its own stop mid-trial, and flag sets priced out
    # of a stated VRAM size, are verdicts on what ran, not on how fast: they run in parallel)
    "test_tune_e2e::test_tune_finds_faster_flags_within_the_floors_and_applies_them",
    # a build against itself and against itself on one thread, measured side by side: the verdicts need the
    # host's two cores free
    "test_bench_compare::test_a_build_against_a_copy_of_itself_is_as_fast",
    "test_bench_compare::test_a_build_forced_to_one_thread_is_the_slower_side",
))


class FastLaneViolation(RuntimeError):
    """Raised by the guard where a fast test started a process or used a socket."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", default=False,
                     help="run only the FAST_MODULES of tests/lanes.py, failing any that starts a process "
                          "or uses a socket")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fast: starts no process and uses no socket (tests/lanes.py)")
    config.addinivalue_line("markers", "serial: runs alone, after the parallel lane (tests/lanes.py)")


def is_fast(item: pytest.Item) -> bool:
    return Path(str(item.fspath)).stem in FAST_MODULES


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads xdist_group into each node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        stem = Path(str(item.fspath)).stem
        if stem in FAST_MODULES:
            item.add_marker(pytest.mark.fast)
        if stem in SERIAL_TESTS or f"{stem}::{getattr(item, 'originalname', item.name)}" in SERIAL_TESTS:
            item.add_marker(pytest.mark.serial)
        if _shares_a_fixture(item):  # one worker sets the module's fixture up once (--dist loadgroup)
            item.add_marker(pytest.mark.xdist_group(stem))
    if config.getoption("--fast"):
        keep = [i for i in items if is_fast(i)]
        config.hook.pytest_deselected(items=[i for i in items if not is_fast(i)])
        items[:] = keep


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture wider than one test (module, class or package scope, not session)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope in ("module", "class", "package") for chain in defs for d in chain)


def _guarded(what: str, seen: list[str], real: Callable[..., Any],
             allow: Callable[..., bool] = lambda *a, **k: False) -> Callable[..., Any]:
    def guard(*args: Any, **kwargs: Any) -> Any:
        if allow(*args, **kwargs):
            return real(*args, **kwargs)
        detail = f"{what} {args[1:2] or args[:1]!r}"
        seen.append(detail)
        raise FastLaneViolation(f"a fast test {detail}: move the module out of FAST_MODULES (tests/lanes.py)")
    return guard


@pytest.fixture(autouse=True)
def _fast_lane_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if not request.config.getoption("--fast"):
        yield
        return
    seen: list[str] = []
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _guarded("started a process", seen,
                                                                       subprocess.Popen._execute_child))  # type: ignore[attr-defined]
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _guarded(f"called os.{name}", seen, getattr(os, name)))
    for name in ("bind", "connect", "connect_ex", "sendto"):
        monkeypatch.setattr(socket.socket, name, _guarded(f"socket.{name}", seen, getattr(socket.socket, name)))
    yield
    if seen:
        pytest.fail(f"a fast test must start no process and use no socket; it did: {'; '.join(seen)} "
                    f"(take {Path(str(request.node.fspath)).stem} out of FAST_MODULES in tests/lanes.py)")
