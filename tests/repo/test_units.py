"""The shipped systemd units, journal catalog and install script, checked with systemd's own tools."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from llama_guard.config import load_config
from llama_guard.config.sections import RecoveryConfig
from llama_guard.core.privileges import (
    CAP_NUMBERS,
    DAEMON_CAPABILITIES,
    RESET_CAPABILITIES,
    Credentials,
    ServerIdentity,
    identity_problem,
    reset_precondition,
)
from llama_guard.core.service import STOP_MARGIN_S
from llama_guard.model.types import Params
from llama_guard.vocab.events import CATALOG
from systemd_fixtures import require, unit_capabilities

ROOT = Path(__file__).resolve().parents[2]
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
CATALOG_FILE = ROOT / "deploy" / "journald" / "llama-guard.catalog"

pytestmark = pytest.mark.systemd


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections → key → values (repeated keys accumulate), comments and continuations handled."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def rewritten(unit: Path, dest: Path, binary: str = "/bin/true") -> Path:
    """A copy of ``unit`` in ``dest`` whose ExecStart binary exists on this host."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / unit.name
    out.write_text(unit.read_text().replace("/opt/llama-guard/bin/llama-guard", binary))
    return out


def verify(*paths: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` under a private /run/systemd, so the host stays untouched."""
    require("systemd-analyze", "unshare", what="unit verification")
    args = " ".join(f"'{p}'" for p in paths)
    return subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs tmpfs /run/systemd && systemd-analyze verify --recursive-errors=yes --man=no {args}"],
        capture_output=True, text=True, timeout=60, check=False)


def test_units_are_shipped() -> None:
    assert [u.name for u in UNITS] == ["llama-guard.service", "llama-guard@.service"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify(unit: Path, tmp_path: Path) -> None:
    copy = rewritten(unit, tmp_path)
    result = verify(copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""
    assert result.stderr.strip() == ""
    if "@" in unit.name:  # an instance too, with %i expanded
        instance = copy.with_name(unit.name.replace("@", "@0"))
        shutil.copy(copy, instance)
        result = verify(instance)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_socket_unit_verifies_with_its_service_and_matches_the_shipped_config(tmp_path: Path) -> None:
    from llama_guard.front.activation import FRONT_NAME
    from llama_guard.front.app import LISTEN_BACKLOG

    socket_unit = ROOT / "deploy" / "systemd" / "llama-guard.socket"
    copy = tmp_path / socket_unit.name
    copy.write_text(socket_unit.read_text())
    result = verify(copy, rewritten(UNITS[0], tmp_path))
    assert result.returncode == 0 and (result.stdout + result.stderr).strip() == "", result.stdout + result.stderr
    sock = parse_unit(socket_unit.read_text())["Socket"]
    shipped = load_config(ROOT / "etc" / "llama-guard.toml")
    assert sock["ListenStream"] == [shipped.front.listen]
    assert sock["FileDescriptorName"] == [FRONT_NAME]
    assert sock["Backlog"] == [str(LISTEN_BACKLOG)]


def test_verify_catches_a_typo(tmp_path: Path) -> None:
    """The check above is real: an unknown key fails it."""
    copy = rewritten(UNITS[0], tmp_path)
    copy.write_text(copy.read_text().replace("WatchdogSec=", "WatchdogSecs="))
    result = verify(copy)
    assert result.returncode != 0
    assert "WatchdogSecs" in result.stderr


def _seconds(value: str) -> float:
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(min|ms|s|h)?", value):
        total += float(number) * {"": 1, "s": 1, "ms": 0.001, "min": 60, "h": 3600}[unit]
    return total


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_contract(unit: Path) -> None:
    u = parse_unit(unit.read_text())
    svc, unit_section = u["Service"], u["Unit"]

    def one(key: str) -> str:
        assert key in svc, f"{unit.name} lacks {key}="
        return svc[key][-1]

    assert one("Type") == "notify"
    assert one("NotifyAccess") == "main"
    assert _seconds(one("WatchdogSec")) >= 10
    assert one("Restart") == "on-failure"
    assert "78" in one("RestartPreventExitStatus").split()
    assert one("KillMode") == "mixed"
    # The worst stop at the defaults: the server's stop (grace, SIGKILL, its wait), or a GPU reset
    # command that a stop waits for (twice reset_timeout_s with the persistence retry, + 30 s of
    # NVML checks), plus the cleanup margin; EXTEND_TIMEOUT_USEC covers larger settings.
    rec = RecoveryConfig()
    server_stop = rec.stop_grace_s + Params().kill_wait_s
    reset_command = rec.reset_timeout_s * (2 if rec.reset_toggles_persistence else 1) + 30.0
    assert _seconds(one("TimeoutStopSec")) >= max(server_stop, reset_command) + STOP_MARGIN_S
    assert one("LimitNOFILE") == "1048576"
    assert one("LimitMEMLOCK") == "infinity"
    assert int(one("TasksMax")) >= 4096
    assert one("ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one("OOMPolicy") == "continue"
    assert "StartLimitIntervalSec" in unit_section
    assert "StartLimitBurst" in unit_section
    env = " ".join(svc["Environment"])
    assert "OMP_NUM_THREADS=8" in env
    # llama-guard runs as root (no User=); llama-server's account is [server].user (see below).
    assert svc.get("User", ["root"])[-1] in ("root", "0")
    assert "SupplementaryGroups" not in svc
    assert one("RuntimeDirectoryMode") == "0700"
    # Hardening that leaves the GPU, GPU reset and /dev/kmsg.
    assert one("NoNewPrivileges") == "yes"
    assert one("ProtectSystem") == "strict"
    assert one("DevicePolicy") == "closed"
    allowed = svc["DeviceAllow"]
    assert "char-nvidia-frontend rw" in allowed
    assert "char-nvidia-uvm rw" in allowed
    assert "/dev/kmsg r" in allowed
    assert one("AmbientCapabilities") == ""  # nothing passes through exec to llama-server
    for forbidden in ("PrivateDevices", "ProtectKernelLogs", "MemoryDenyWriteExecute"):
        assert forbidden not in svc, f"{forbidden}= would break the GPU or /dev/kmsg"
    if "@" in unit.name:
        assert one("ExecStart") == "/opt/llama-guard/bin/llama-guard run --config /etc/llama-guard/%i.toml"
        assert "CUDA_VISIBLE_DEVICES=%i" in env
        assert "LLAMA_GUARD_RUNTIME__DIR=/run/llama-guard/%i" in env
        assert one("RuntimeDirectory") == "llama-guard/%i"
    else:
        assert one("ExecStart") == (
            "/opt/llama-guard/bin/llama-guard run --config /etc/llama-guard/llama-guard.toml")
        assert "CUDA_VISIBLE_DEVICES=0" in env
        assert one("RuntimeDirectory") == "llama-guard"


def unit_credentials(unit: Path) -> Credentials:
    """The credentials llama-guard gets from ``unit``: its User= (root when absent) and the
    bounding set, which systemd gives a root service as its effective and permitted sets."""
    caps = unit_capabilities(unit.read_text())
    user = (caps["User"] or ["root"])[-1]
    uid = 0 if user in ("root", "0") else 1000
    mask = 0
    for name in caps["CapabilityBoundingSet"]:
        mask |= 1 << CAP_NUMBERS[name]
    ambient = 0
    for name in caps["AmbientCapabilities"]:
        ambient |= 1 << CAP_NUMBERS[name]
    eff = mask if uid == 0 else ambient
    return Credentials(uid, uid, (), eff, eff, 0, ambient, mask, True)


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_and_reset_precondition_agree(unit: Path) -> None:
    """One source of truth: the unit's User=/capabilities are the code's list, and under them the
    reset precondition holds and llama-server can be started as another user."""
    caps = unit_capabilities(unit.read_text())
    assert set(caps["CapabilityBoundingSet"]) == set(DAEMON_CAPABILITIES)
    assert caps["AmbientCapabilities"] == []
    assert set(RESET_CAPABILITIES) <= set(caps["CapabilityBoundingSet"])
    creds = unit_credentials(unit)
    assert reset_precondition(creds) == "", reset_precondition(creds)
    assert identity_problem(ServerIdentity(65534, 65534, (44,), "nobody"), creds) == ""
    # ... and the check can fail: without CAP_SYS_ADMIN in the unit, no reset.
    text = re.sub(r"\bCAP_SYS_ADMIN\b", "", unit.read_text())
    assert "CAP_SYS_ADMIN" not in unit_capabilities(text)["CapabilityBoundingSet"]
    mask = sum(1 << CAP_NUMBERS[c] for c in unit_capabilities(text)["CapabilityBoundingSet"])
    assert "CAP_SYS_ADMIN" in reset_precondition(Credentials(0, 0, (), mask, mask, 0, 0, mask, True))


def test_install_script_creates_the_configured_server_user() -> None:
    """deploy/install.sh creates the account the shipped config names as [server].user/group."""
    script = (ROOT / "deploy" / "install.sh").read_text()
    match = re.search(r"^SERVER_USER=(\S+)$", script, re.M)
    assert match is not None
    shipped = load_config(ROOT / "etc" / "llama-guard.toml").server
    assert shipped.user == match.group(1) and shipped.group == match.group(1)
    assert set(shipped.supplementary_groups) == {"video", "render"}
    assert "--groups video,render" in script
    assert tomllib.loads((ROOT / "etc" / "llama-guard.toml").read_text())["server"]["api_key_file"] == ""


# --- journal catalog -------------------------------------------------------------------------

def test_catalog_matches_the_event_catalogue() -> None:
    """deploy/journald/llama-guard.catalog is exactly what scripts/gen_catalog.py generates."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_catalog.py"), "--check"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    ids = re.findall(r"^-- ([0-9a-f]{32})$", CATALOG_FILE.read_text(), re.M)
    assert sorted(ids) == sorted(spec.message_id for spec in CATALOG.values())


def test_journalctl_indexes_the_catalog(tmp_path: Path) -> None:
    require("journalctl", what="catalog check")
    catalog_dir = tmp_path / "usr" / "local" / "lib" / "systemd" / "catalog"
    catalog_dir.mkdir(parents=True)
    shutil.copy(CATALOG_FILE, catalog_dir)
    update = subprocess.run(["journalctl", f"--root={tmp_path}", "--update-catalog"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert update.returncode == 0, update.stderr
    listed = subprocess.run(["journalctl", f"--root={tmp_path}", "--list-catalog"],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    listed_ids = {line.split()[0] for line in listed.splitlines() if line.strip()}
    assert listed_ids == {spec.message_id for spec in CATALOG.values()}
    oom = CATALOG["server_oom"].message_id
    dump = subprocess.run(["journalctl", f"--root={tmp_path}", "--dump-catalog", oom],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert "Subject: llama-server ran out of GPU memory" in dump


# --- install script --------------------------------------------------------------------------

def test_install_script_stages_every_file(tmp_path: Path) -> None:
    script = ROOT / "deploy" / "install.sh"
    assert subprocess.run(["sh", "-n", str(script)], check=False).returncode == 0
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DESTDIR": str(tmp_path), "PREFIX": "/opt/lg"}
    for _ in range(2):  # idempotent; the second run keeps the existing config
        result = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True,
                                timeout=60, check=False)
        assert result.returncode == 0, result.stderr
    assert "keeping /etc/llama-guard/llama-guard.toml" in result.stdout
    for rel in ("etc/llama-guard/llama-guard.toml", "etc/llama-guard/llama-guard.toml.dist",
                "etc/systemd/system/llama-guard.service", "etc/systemd/system/llama-guard@.service",
                "etc/systemd/system/llama-guard.socket", "usr/local/lib/systemd/catalog/llama-guard.catalog",
                "opt/lg/share/doc/llama-guard/systemd.md"):
        assert (tmp_path / rel).is_file(), rel
    unit = (tmp_path / "etc/systemd/system/llama-guard.service").read_text()
    assert "ExecStart=/opt/lg/bin/llama-guard run --config /etc/llama-guard/llama-guard.toml" in unit
    assert (tmp_path / "etc/llama-guard/llama-guard.toml").read_text() == (
        ROOT / "etc" / "llama-guard.toml").read_text()
