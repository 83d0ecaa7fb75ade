"""harness.free_port under parallel workers: no two test processes are handed the same port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import harness
import pytest

TESTS = Path(__file__).resolve().parents[1]
TAKE = "import sys; sys.path.insert(0, sys.argv[1]); import harness; print(*(harness.free_port() for _ in range(200)))"


def test_parallel_processes_never_share_a_port(tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path))  # a claim directory of this test's own
    procs = [subprocess.Popen([sys.executable, "-c", TAKE, str(TESTS)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(4)]
    ports = [int(p) for proc in procs for p in proc.communicate(timeout=120)[0].split()]
    assert all(proc.returncode == 0 for proc in procs)
    assert len(ports) == 800 and len(set(ports)) == 800, len(set(ports))


def test_a_claim_older_than_the_hold_is_handed_out_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "PORT_DIR", tmp_path)
    port = harness.free_port()
    claim = tmp_path / str(port)
    assert claim.exists()
    os.utime(claim, (0, 0))  # claimed long ago
    monkeypatch.setattr(harness.socket.socket, "getsockname", lambda self: ("127.0.0.1", port))
    assert harness.free_port() == port  # the kernel offers it again, and the old claim no longer holds it
    monkeypatch.setattr(harness, "PORT_HOLD_S", 1e12)
    with pytest.raises(RuntimeError, match="no unclaimed loopback port"):
        harness.free_port()  # a fresh claim holds it: 1000 offers of the same port are all refused
