"""The shipped privilege model, end to end: llama-guard started as root with the shipped unit's
capability sets (reproduced with util-linux ``setpriv``), the real llama-server as an unprivileged
``[server].user``, and the GPU reset path (fake NVML, stub reset command) under those credentials.

Needs root (it switches users) and the real llama-server and model: in CI a missing one fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import FAKE_NVML_RUN, ROOT, DaemonRun, base_sections, free_port, merge, server_pids_of
from llama_guard.core.privileges import CAP_NUMBERS, read_credentials, unreachable
from needs import unavailable
from systemd_fixtures import unit_capabilities

TESTS = Path(__file__).resolve().parents[1]
STUB = TESTS / "stub_reset.py"
UNIT = ROOT / "deploy" / "systemd" / "llama-guard.service"
NOBODY = 65534

pytestmark = [pytest.mark.real, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _root_and_setpriv() -> None:
    missing = "root" if os.geteuid() != 0 else ("setpriv (util-linux)" if not shutil.which("setpriv") else "")
    if missing:
        unavailable(f"the privilege-model test needs {missing}")


def unit_prefix() -> tuple[list[str], int]:
    """``setpriv`` giving a root process the shipped unit's credentials: the bounding set of
    ``CapabilityBoundingSet=`` (as far as this host's own bounding set allows), nothing inheritable
    or ambient (``AmbientCapabilities=``), ``NoNewPrivileges=yes``; and the resulting mask."""
    caps = unit_capabilities(UNIT.read_text())
    assert caps["User"] in ([], ["root"]), caps["User"]
    assert caps["AmbientCapabilities"] == []
    have = read_credentials().cap_bnd
    keep = [c for c in caps["CapabilityBoundingSet"] if have >> CAP_NUMBERS[c] & 1]
    mask = sum(1 << CAP_NUMBERS[c] for c in keep)
    wanted = ",".join(["-all"] + ["+" + c.removeprefix("CAP_").lower() for c in keep])
    return ["setpriv", f"--bounding-set={wanted}", "--inh-caps=-all", "--ambient-caps=-all",
            "--no-new-privs", "--"], mask


def status_of(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the unprivileged user can reach (pytest's tmp_path is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="lg-priv-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def reachable(path: Path, shared: Path, bit: int) -> Path:
    """``path`` when uid 65534 can reach it, else a copy (of its whole directory: a binary's
    shared libraries sit next to it) in ``shared``."""
    if not unreachable(path, NOBODY, {NOBODY}, bit):
        return path
    dest = shared / f"copy-{path.parent.name}"
    if not dest.exists():
        shutil.copytree(path.parent, dest, symlinks=True)
        for item in [dest, *dest.rglob("*")]:
            item.chmod(item.stat().st_mode | 0o005 | (0o050 if item.is_dir() else 0o040))
    copied = dest / path.name
    assert not unreachable(copied, NOBODY, {NOBODY}, bit)
    return copied


def test_server_runs_unprivileged_and_the_reset_runs_as_root(
        tmp_path: Path, shared_dir: Path, llama_server_bin: Path, real_model: Path) -> None:
    prefix, mask = unit_prefix()
    assert mask >> CAP_NUMBERS["CAP_SYS_ADMIN"] & 1, "this host cannot grant what a reset needs"
    binary = reachable(llama_server_bin, shared_dir, 1)
    model = reachable(real_model, shared_dir, 4)
    port = free_port()
    script = tmp_path / "nvml.json"
    script.write_text(json.dumps({}))
    record = tmp_path / "reset-record.jsonl"
    sections = merge(base_sections(tmp_path, str(binary), str(model), port), {
        "server": {"user": "nobody", "group": str(NOBODY), "supplementary_groups": ["video"]},
        "health": {"canary": False, "timeout_s": 3.0},
        "gpu": {"enabled": "on", "index": 0, "sample_interval_s": 0.2, "require_server_on_gpu": False,
                "vram_release_timeout_s": 3.0, "kmsg_path": str(tmp_path / "no-kmsg")},
        "recovery": {"reset_command": [sys.executable, str(STUB), "--gpu-reset", "-i", "{index}"],
                     "reset_timeout_s": 10.0, "max_resets": 2, "stop_grace_s": 5.0, "reset_on": ["gpu_lost"]},
    })
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": pythonpath, "FAKE_NVML_SCRIPT": str(script),
           "FAKE_NVML_STATE": str(tmp_path / "nvml-state.json"),
           "STUB_RESET_RECORD": str(record), "STUB_RESET_SLEEP_S": "0.2"}
    run = DaemonRun(tmp_path, sections, env=env, prefix=prefix, command=FAKE_NVML_RUN)

    # `check` under the same credentials: a reset is possible, and the server user is usable.
    check = subprocess.run([*prefix, *FAKE_NVML_RUN, "check", "--config", str(run.config)],
                           env=run.env, cwd=str(ROOT), capture_output=True, text=True, timeout=60, check=False)
    reset_line = next(x for x in check.stdout.splitlines() if " gpu reset " in x)
    assert reset_line.startswith("OK") and "possible" in reset_line, check.stdout + check.stderr
    user_lines = [x for x in check.stdout.splitlines() if " server user " in x]
    assert user_lines and all(x.startswith("OK") for x in user_lines), check.stdout

    run.start()
    try:
        ready = run.wait_event("server_ready", 60)
        pid = int(ready["server_pid"])
        daemon = status_of(run.pid)
        assert daemon["Uid"].split() == ["0"] * 4
        assert int(daemon["CapEff"], 16) == mask and int(daemon["CapAmb"], 16) == 0
        assert daemon["NoNewPrivs"] == "1"
        server = status_of(pid)
        for key in ("CapEff", "CapPrm", "CapInh", "CapAmb", "CapBnd"):
            assert int(server[key], 16) == 0, (key, server[key])
        assert server["NoNewPrivs"] == "1"
        assert server["Uid"].split() == [str(NOBODY)] * 4
        assert server["Gid"].split() == [str(NOBODY)] * 4
        assert server["Groups"].split() == ["44"]

        # The GPU drops off: the server is stopped, the reset command runs as root with CAP_SYS_ADMIN.
        script.write_text(json.dumps({"lost": True}))
        second = run.wait_event("server_ready", 60, skip=1)
        reset = run.wait_event("gpu_reset")
        assert reset["outcome"] == "succeeded", reset
        [rec] = [json.loads(x) for x in record.read_text().splitlines()]
        creds = rec["credentials"]
        assert creds["euid"] == 0 and creds["cap_eff"] >> CAP_NUMBERS["CAP_SYS_ADMIN"] & 1, creds
        assert creds["cap_amb"] == 0
        again = status_of(int(second["server_pid"]))
        assert int(again["CapEff"], 16) == 0 and again["Uid"].split()[0] == str(NOBODY)
    finally:
        run.stop()
        leftovers = server_pids_of(port)
        for leftover in leftovers:
            os.kill(leftover, 9)
        assert not leftovers, "llama-server outlived its daemon"
