"""A serving daemon pointed at a new llama-server build (a reload, or the binary overwritten in place)
ends up serving: on the new build when it is good, on the last good build when it is not, with the
cause named — and a client loop through the front door sees no failed request meanwhile.

The bad builds are small scripts in front of the real llama-server (a ``--help`` without a flag, a
death by SIGSEGV while loading) or in front of the test double (a crash on the first completion,
which the real build cannot be made to do); the good new build is the real one copied elsewhere.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import FAKE_SERVER, ROOT, RunPool, free_port, merge
from llama_guard.status.status import read_status

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def help_without(path: Path, real: Path, flag: str) -> Path:
    """A build without ``flag`` (llama.cpp removed it): its --help lacks it and a start that passes
    it fails as llama-server does; otherwise ``real``."""
    return script(path, f'case "$*" in *--help*) "{real}" "$@" 2>&1 | grep -v -- "{flag}"; exit 0;; esac\n'
                        f'case "$*" in *"{flag} "*) echo "error: invalid argument: {flag}" >&2; exit 1;; esac\n'
                        f'exec "{real}" "$@"\n')


def dies_loading(path: Path, real: Path) -> Path:
    """A build that answers --version and --help but dies by SIGSEGV as it loads the model."""
    return script(path, f'case "$*" in *--version*|*--help*) exec "{real}" "$@";; esac\n'
                        'echo "load_tensors: loading model tensors, this can take a while... (mmap = true)" >&2\n'
                        "kill -SEGV $$\n")


def copy_build(real: Path, into: Path) -> Path:
    """The real build (its executable and the shared libraries beside it) copied into ``into``."""
    into.mkdir(parents=True)
    for entry in real.parent.iterdir():
        if entry == real or entry.name.startswith("lib"):
            shutil.copy2(entry, into / entry.name, follow_symlinks=False)
    return into / real.name


class ClientLoop:
    """Completions through the front door, one after another, until stopped; every answer that is not
    200 (or a transport error) is kept in :attr:`failures`."""

    def __init__(self, port: int, timeout_s: float = 120.0) -> None:
        self.port = port
        self.timeout_s = timeout_s
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                try:
                    answer = client.post(f"http://127.0.0.1:{self.port}/completion",
                                         json={"prompt": "Hello", "n_predict": 2})
                    if answer.status_code != 200:
                        self.failures.append(f"{answer.status_code} {answer.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.done += 1

    def __enter__(self) -> ClientLoop:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 30)


@contextlib.contextmanager
def serving(tmp_path: Path, binary: Path, model: Path, **extra: dict[str, object]) -> Iterator[Any]:
    """A started daemon with the front door on ``binary``, ready; ``extra`` sections' keys over the test's own."""
    pool = RunPool()
    front = free_port()
    # No trial of a new build's speed unless a test asks for one (test_upgrade_trial_e2e.py): these
    # tests are about loads, answers and crashes.
    sections = merge({"front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": 120.0},
                      "health": {"canary": False, "interval_s": 1.0, "timeout_s": 5.0, "hang_strikes": 5},
                      "recovery": {"max_restarts": 10, "stable_after_s": 1.0},
                      "upgrade": {"probation_s": 1.0, "trial_runs": 0}}, extra)
    run: Any = pool.new(tmp_path, str(binary), str(model), sections)
    run.front = front
    run.start()
    try:
        run.wait_event("server_ready", 120)
        yield run
    finally:
        leftovers = pool.finish()
    if leftovers:
        pytest.fail(f"server pids {leftovers} outlived their daemon")


def reload_with(run: Any, binary: Path) -> None:
    """Point the running daemon's configuration at ``binary`` and reload it (SIGHUP)."""
    text = run.config.read_text()
    old = next(line for line in text.splitlines() if line.startswith("binary = "))
    run.config.write_text(text.replace(old, f'binary = "{binary}"'))
    run.signal(signal.SIGHUP)


def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``condition`` (a positive marker) until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def status_when(tmp_path: Path, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The daemon's status.json once ``condition`` holds for it (it is rewritten every 2 s)."""
    found: list[dict[str, Any]] = []

    def ready() -> bool:
        status = read_status(tmp_path / "run")
        if status is not None and "build" in status and condition(status):
            found.append(status)
            return True
        return False
    wait_until(ready, 30)
    return found[-1]


def started_binaries(run: Any) -> list[str]:
    return [str(e["argv"]).split()[0] for e in run.events() if e["event"] == "server_starting"]


def test_a_build_whose_help_lacks_a_flag_is_refused_and_the_old_server_goes_on_serving(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """Before: the reload stopped the serving server, the new build refused --metrics and the daemon
    ended with exit 78."""
    new = help_without(tmp_path / "llama-server-new", llama_server_bin, "--metrics")
    with serving(tmp_path, llama_server_bin, real_model) as run, ClientLoop(run.front) as clients:
        pid = run.wait_event("server_ready")["server_pid"]
        reload_with(run, new)
        refused = run.wait_event("upgrade_refused", 60)
        assert "does not know --metrics" in refused["cause"], refused
        assert refused["binary"] == str(new)
        assert "go on serving" in refused["outcome"]
        assert "server_stopped" not in run.names() and "server_exited" not in run.names()
        status = status_when(tmp_path, lambda s: s["build"]["refused"] is not None)
        assert status["build"]["serving"]["binary"] == str(llama_server_bin)
        assert status["build"]["refused"]["binary"] == str(new)
        assert "--metrics" in status["build"]["refused"]["cause"]
        assert status["server_pid"] == pid and status["phase"] == "ready"
        shown = subprocess.run([sys.executable, "-m", "llama_guard", "status", "--config", str(run.config)],
                               capture_output=True, text=True, timeout=60, cwd=str(ROOT)).stdout
        assert f"at {llama_server_bin}" in shown, shown
        assert f"at {new}: " in shown and "does not know --metrics" in shown, shown
        run.signal(signal.SIGHUP)  # the same bad build again: reported again
        assert "does not know --metrics" in run.wait_event("upgrade_refused", 60, skip=1)["cause"]
        wait_until(lambda: clients.done >= 3, 120)
    assert clients.failures == [] and clients.done >= 3


def test_a_build_that_dies_loading_is_rolled_back_to_the_serving_one(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    new = dies_loading(tmp_path / "llama-server-new", llama_server_bin)
    with serving(tmp_path, llama_server_bin, real_model) as run, ClientLoop(run.front) as clients:
        reload_with(run, new)
        run.wait_event("upgrade_preflight_passed", 60)
        back = run.wait_event("upgrade_rolled_back", 120)
        assert back["from_binary"] == str(new) and back["to_binary"] == str(llama_server_bin)
        assert "SIGSEGV" in back["cause"] and "while loading" in back["cause"], back
        run.wait_event("server_ready", 120, skip=1)
        assert started_binaries(run) == [str(llama_server_bin), str(new), str(llama_server_bin)]
        status = status_when(tmp_path, lambda s: s["build"]["refused"] is not None)
        assert status["build"]["refused"]["binary"] == str(new)
        assert status["build"]["serving"]["binary"] == str(llama_server_bin)
    assert clients.failures == [] and clients.done >= 1
    assert "daemon_exit" not in [e["event"] for e in run.events()][:-1]


def test_a_good_new_build_is_kept_and_a_copy_of_it_made(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    new = copy_build(llama_server_bin, tmp_path / "new-build")
    metrics = free_port()
    with serving(tmp_path, llama_server_bin, real_model, metrics={"listen": f"127.0.0.1:{metrics}"}) as run, \
            ClientLoop(run.front) as clients:
        run.wait_event("upgrade_copy_kept", 60)  # the first build, after its probation
        reload_with(run, new)
        passed = run.wait_event("upgrade_preflight_passed", 60)
        assert passed["binary"] == str(new)
        kept = run.wait_event("upgrade_kept", 120)
        assert kept["binary"] == str(new)
        run.wait_event("upgrade_copy_kept", 60, skip=1)
        assert started_binaries(run) == [str(llama_server_bin), str(new)]
        assert "upgrade_rolled_back" not in run.names() and "upgrade_refused" not in run.names()
        info = [line for line in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=30).text.splitlines()
                if line.startswith("llama_guard_server_build_info{")]
        assert len(info) == 1 and f'binary="{new}"' in info[0] and info[0].endswith(" 1.0"), info
        assert 'release="v' in info[0] or 'release="b' in info[0], info
    assert clients.failures == [] and clients.done >= 1


def test_a_good_build_overwritten_in_place_by_a_bad_one_is_rolled_back_to_the_kept_copy(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """The binary at the configured path is replaced (``make install``) by a build that lacks a flag;
    the next start (a planned restart) runs the kept copy instead."""
    path = copy_build(llama_server_bin, tmp_path / "bin")
    with serving(tmp_path, path, real_model) as run, ClientLoop(run.front) as clients:
        copied = run.wait_event("upgrade_copy_kept", 60)
        kept_dir = Path(copied["dir"])
        assert kept_dir.parent == tmp_path / "run" / "builds"
        for entry in [kept_dir, *kept_dir.iterdir()]:
            assert not entry.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH), entry
        path.unlink()
        help_without(path, llama_server_bin, "--cache-type-v")
        run.signal(signal.SIGUSR1)  # llama-guard restart
        refused = run.wait_event("upgrade_refused", 60)
        assert "does not know --cache-type-v" in refused["cause"]
        back = run.wait_event("upgrade_rolled_back", 60)
        assert back["from_binary"] == str(path) and Path(back["to_binary"]).parent == kept_dir
        run.wait_event("server_ready", 120, skip=1)
        assert started_binaries(run)[-1] == str(kept_dir / path.name)
    assert clients.failures == [] and clients.done >= 1


def test_a_build_that_crashes_on_its_first_completion_is_rolled_back(tmp_path: Path, real_model: Path) -> None:
    """The test double's ``crash_first_request`` (a build regression on this GPU) as the new build:
    kept through preflight and load, it crashes on its first request within its probation; the
    request is replayed and answered by the last good build."""
    new = script(tmp_path / "llama-server-crashy",
                 f'FAKE_LLAMA_FAULT=crash_first_request exec "{FAKE_SERVER}" "$@"\n')
    with serving(tmp_path, FAKE_SERVER, real_model, upgrade={"probation_s": 600.0}) as run:
        reload_with(run, new)
        run.wait_event("upgrade_preflight_passed", 60)
        run.wait_event("server_ready", 60, skip=1)
        answer = httpx.post(f"http://127.0.0.1:{run.front}/completion", json={"prompt": "Hi", "n_predict": 1},
                            timeout=120)
        assert answer.status_code == 200, answer.text
        back = run.wait_event("upgrade_rolled_back", 60)
        assert back["from_binary"] == str(new) and back["to_binary"] == str(FAKE_SERVER)
        assert "SIGABRT" in back["cause"] and "into its probation" in back["cause"], back
        assert started_binaries(run) == [str(FAKE_SERVER), str(new), str(FAKE_SERVER)]


def test_status_without_a_daemon_binary_change_is_unchanged(tmp_path: Path, real_model: Path) -> None:
    """A reload that changes nothing of [server] runs no build and says nothing of upgrades."""
    with serving(tmp_path, FAKE_SERVER, real_model) as run:
        run.signal(signal.SIGHUP)
        run.wait_event("config_reloaded", 60)
        assert not [n for n in run.names() if n.startswith("upgrade_") and n != "upgrade_copy_kept"]



def test_a_build_overwritten_while_the_daemon_was_stopped_is_found_at_its_next_start(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """The kept copy outlives the daemon (state directory): the next daemon's first start finds the
    configured path holding a build that dies at --version and starts the copy instead."""
    path = copy_build(llama_server_bin, tmp_path / "bin")
    with serving(tmp_path, path, real_model) as run:
        kept_dir = Path(run.wait_event("upgrade_copy_kept", 60)["dir"])
        run.signal(signal.SIGTERM)
        assert run.wait_exit(60) == 0
        path.unlink()
        script(path, "kill -SEGV $$\n")
        run.start()
        refused = run.wait_event("upgrade_refused", 60)
        assert refused["cause"] == f"{path} --version died by SIGSEGV", refused
        back = run.wait_event("upgrade_rolled_back", 60)
        assert Path(back["to_binary"]) == kept_dir / path.name
        run.wait_event("server_ready", 120, skip=1)
        assert httpx.post(f"http://127.0.0.1:{run.front}/completion", json={"prompt": "Hi", "n_predict": 1},
                          timeout=120).status_code == 200
