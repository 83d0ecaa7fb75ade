"""The suite's lanes (tests/lanes.py): the fast lane's guard fails a listed module that starts a process or
uses a socket, even when the code under test swallowed the guard's error; every listed module exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lanes import FAST_MODULES, SERIAL_TESTS

TESTS = Path(__file__).resolve().parents[1]

OFFENDERS = '''
import os, socket, subprocess

def test_starts_a_process():
    subprocess.run(["true"], check=False)

def test_connects_and_swallows_the_error():
    try:
        with socket.socket() as s:
            s.connect(("127.0.0.1", 9))
    except Exception:
        pass

def test_sends_a_datagram():
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"x", "/nonexistent")

def test_forks():
    os.fork()

def test_only_a_socketpair_and_arithmetic():
    a, b = socket.socketpair()
    a.close(); b.close()
    assert 2 + 2 == 4
'''


def run_fast(tmp_path: Path, stem: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / f"{stem}.py").write_text(OFFENDERS)
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, COLUMNS="400", PYTHONPATH=path)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "lanes",
                           "-p", "no:xdist", "--fast", f"{stem}.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_the_fast_lane_fails_each_process_and_socket_use_and_passes_the_rest(tmp_path: Path) -> None:
    stem = sorted(FAST_MODULES)[0]  # a listed name: the guard is armed for it
    out = run_fast(tmp_path, stem)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    for name in ("test_starts_a_process", "test_connects_and_swallows_the_error", "test_sends_a_datagram",
                 "test_forks"):
        assert f"ERROR {stem}.py::{name} - Failed: a fast test must start no process" in text, (name, text)
    assert f"PASSED {stem}.py::test_only_a_socketpair_and_arithmetic" in text, text


def test_a_module_not_listed_is_not_in_the_fast_lane(tmp_path: Path) -> None:
    out = run_fast(tmp_path, "test_nobody_listed_this")
    assert "5 deselected" in out.stdout, out.stdout + out.stderr


def test_every_listed_module_and_test_exists_and_none_is_in_two_lanes() -> None:
    files = {p.stem: p for p in TESTS.rglob("test_*.py")}
    assert set(files) >= FAST_MODULES, sorted(FAST_MODULES - set(files))
    for entry in SERIAL_TESTS:
        stem, _, name = entry.partition("::")
        assert stem in files and stem not in FAST_MODULES, entry
        assert not name or f"def {name}(" in files[stem].read_text(), entry
