"""The privilege model's pieces in-process: credentials from /proc, user/group resolution, and the
`check` lines for the server's account (the end-to-end run is test_privileges_e2e.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from llama_guard.config import Config
from llama_guard.core.child import GATE_CLOSED, ChildSetup, popen
from llama_guard.core.privileges import (
    CAP_NUMBERS,
    Credentials,
    ServerIdentity,
    identity_problem,
    read_credentials,
    resolve_identity,
)
from llama_guard.preflight.process import check_credentials

ALL = (1 << 41) - 1
ROOT_CREDS = Credentials(0, 0, (), ALL, ALL, 0, 0, ALL, False)

STATUS = """Name:\tllama-server
Uid:\t65534\t65534\t65534\t65534
Gid:\t65534\t65534\t65534\t65534
Groups:\t44 109
NoNewPrivs:\t1
CapInh:\t0000000000000000
CapPrm:\t0000000000000000
CapEff:\t0000000000200000
CapBnd:\t000001ffffffffff
CapAmb:\t0000000000000000
"""


def test_read_credentials_parses_status(tmp_path: Path) -> None:
    path = tmp_path / "status"
    path.write_text(STATUS)
    c = read_credentials(path)
    assert (c.uid, c.gid, c.groups, c.no_new_privs) == (65534, 65534, (44, 109), True)
    assert c.has("CAP_SYS_ADMIN") and not c.has("CAP_SETUID")
    assert c.cap_bnd == ALL


def test_read_credentials_of_this_process() -> None:
    c = read_credentials()
    assert c.uid == os.geteuid() and c.gid == os.getegid()


def test_resolve_identity() -> None:
    nobody = resolve_identity("nobody", "", [])
    assert nobody.uid == 65534 and nobody.groups == ()
    numeric = resolve_identity("4242", "4343", ["44", "44"])
    assert (numeric.uid, numeric.gid, numeric.groups) == (4242, 4343, (44,))
    assert resolve_identity("", "", []).uid is None
    with pytest.raises(ValueError, match="no such user 'no-such-user-lg'"):
        resolve_identity("no-such-user-lg", "", [])
    with pytest.raises(ValueError, match="supplementary_groups: no such group 'no-such-group-lg'"):
        resolve_identity("nobody", "", ["no-such-group-lg"])
    with pytest.raises(ValueError, match="need"):
        resolve_identity("", "video", [])


@pytest.mark.parametrize("cap", ["CAP_SETUID", "CAP_SETGID"])
def test_switching_users_needs_setuid_and_setgid(cap: str) -> None:
    identity = ServerIdentity(65534, 65534, (), "uid 65534 (nobody)")
    assert identity_problem(identity, ROOT_CREDS) == ""
    without = Credentials(0, 0, (), ALL & ~(1 << CAP_NUMBERS[cap]), ALL, 0, 0, ALL, False)
    assert cap in identity_problem(identity, without)
    assert identity_problem(ServerIdentity(None, None, None, "own"), without) == ""


def test_check_credentials_names_an_unreachable_model() -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # /tmp is world-searchable; pytest's tmp_path is not
    base.chmod(0o755)
    private = base / "private"
    private.mkdir(mode=0o700)
    model = private / "m.gguf"
    model.write_bytes(b"GGUF")
    cfg = Config.model_validate({"server": {"binary": "/bin/true", "model": str(model), "user": "nobody"}})
    rows = check_credentials(cfg, creds=ROOT_CREDS)
    assert rows[0].verdict == "OK" and "uid 65534" in rows[0].detail
    [bad] = [r for r in rows if r.verdict == "FAIL"]
    assert f"model {model}: {private} is not searchable" in bad.detail, bad
    private.chmod(0o755)
    model.chmod(0o600)
    [bad] = [r for r in check_credentials(cfg, creds=ROOT_CREDS) if r.verdict == "FAIL"]
    assert "not readable" in bad.detail
    model.chmod(0o644)
    assert all(r.verdict == "OK" for r in check_credentials(cfg, creds=ROOT_CREDS))
    shutil.rmtree(base)


def test_check_credentials_warns_for_a_root_server() -> None:
    cfg = Config.model_validate({"server": {"binary": "/bin/true"}})
    [row] = check_credentials(cfg, creds=ROOT_CREDS)
    assert row.verdict == "WARN" and "root" in row.detail
    cfg = Config.model_validate({"server": {"binary": "/bin/true", "user": "no-such-user-lg"}})
    [row] = check_credentials(cfg, creds=ROOT_CREDS)
    assert row.verdict == "FAIL" and "no such user" in row.detail


def test_the_child_runs_nothing_before_its_gate_opens_and_exits_if_it_never_does(tmp_path: Path) -> None:
    """The parent sets the rlimits while the child waits at the gate; a parent that gives up (or dies)
    before opening it leaves the child to exit 125 without running its program."""
    marker = tmp_path / "ran"
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(ChildSetup().argv(["touch", str(marker)]), stdin=read_end)
    os.close(read_end)
    os.close(write_end)  # never opened
    assert proc.wait(30) == GATE_CLOSED and not marker.exists()
    opened = popen(["touch", str(marker)], os.environ, ChildSetup(), stdout=subprocess.DEVNULL)
    assert opened.wait(30) == 0 and marker.exists()
