"""Journald to a central box: llama-guard's events reach a collector through the real
``systemd-journal-upload`` → ``systemd-journal-remote`` pair (HTTP on loopback) with every field intact,
and can be filtered there by ``LLAMA_GUARD_EVENT``.

The daemon (``python -m llama_guard run``, ``[log].format = "journald"``) writes to the default journal
socket, which a private mount namespace binds to a private journald (tests/systemd_fixtures.py). The
server is the fake llama-server and the GPU the NVML double (an OOM, an Xid and a hot GPU cannot be had
on this host); the journal, the uploader and the collector are the real ones. The recipe: docs/journal.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import FAKE_NVML_RUN, FAKE_SERVER, DaemonRun, base_sections, free_port, merge, server_pids_of
from needs import unavailable
from systemd_fixtures import PrivateJournald, require

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(120)]

TESTS = Path(__file__).resolve().parents[1]
REMOTE = Path("/usr/lib/systemd/systemd-journal-remote")
UPLOAD = Path("/usr/lib/systemd/systemd-journal-upload")
STUB = TESTS / "stub_reset.py"
# The mount namespace of the daemon: /run/systemd/journal (where journald's socket is expected) is the
# private journald's run directory.
BIND_JOURNAL = ('mount -t tmpfs tmpfs /run/systemd && mkdir /run/systemd/journal '
                '&& mount --bind "$0" /run/systemd/journal && exec "$@"')
# Fields the journal itself assigns per file or per receiving side: a cursor, a sequence number.
PER_FILE = ("__CURSOR", "__SEQNUM", "__SEQNUM_ID")


def read_journal(directory: Path, *matches: str) -> list[dict[str, Any]]:
    """``journalctl -D directory -o json matches…``, byte-array values decoded."""
    out = subprocess.run(["journalctl", "-D", str(directory), "-o", "json", "--all", "--no-pager", *matches],
                         capture_output=True, timeout=30, check=False)
    assert out.returncode in (0, 1), out.stderr.decode(errors="replace")
    entries = []
    for line in out.stdout.decode().splitlines():
        if line.strip():
            entry = json.loads(line)
            entries.append({k: bytes(v).decode("utf-8", "replace") if isinstance(v, list) else v
                            for k, v in entry.items()})
    return entries


class Collector:
    """``systemd-journal-remote --listen-http`` on a loopback port, writing under ``dir``."""

    def __init__(self, base: Path) -> None:
        self.dir = base / "remote"
        self.dir.mkdir(parents=True)
        self.port = free_port()
        self.log = base / "journal-remote.log"
        self.proc = subprocess.Popen(
            [str(REMOTE), f"--listen-http=127.0.0.1:{self.port}", f"--output={self.dir}/all.journal",
             "--split-mode=none"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"),
            start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        self.proc.kill()
        self.proc.wait(5)
        raise AssertionError(f"journal-remote did not listen: {self.log.read_text()}")

    def entries(self, *matches: str) -> list[dict[str, Any]]:
        return read_journal(self.dir, *matches)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # closes (and so completes) its journal file
            self.proc.wait(10)


@pytest.fixture
def journald(tmp_path: Path) -> Iterator[PrivateJournald]:
    if os.geteuid() != 0:
        unavailable("the daemon's private journal socket needs root (a mount namespace)")
    require(REMOTE, UPLOAD, "unshare", what="journal forwarding")
    journal = PrivateJournald(tmp_path / "journal").start()
    yield journal
    journal.stop()


@pytest.fixture
def collector(tmp_path: Path, journald: PrivateJournald) -> Iterator[Collector]:
    remote = Collector(tmp_path)
    yield remote
    remote.stop()


@pytest.fixture
def uploader(tmp_path: Path, journald: PrivateJournald, collector: Collector) -> Iterator[subprocess.Popen[bytes]]:
    """``systemd-journal-upload`` following the private journal's files, sending to the collector."""
    proc = subprocess.Popen(
        [str(UPLOAD), f"--url=http://127.0.0.1:{collector.port}", f"--directory={journald.logs_dir}",
         f"--save-state={tmp_path / 'upload-state'}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=(tmp_path / "upload.log").open("wb"),
        start_new_session=True)
    yield proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def wait_for(read: Any, what: str, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found: list[dict[str, Any]] = read()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout} s")


def test_events_reach_the_collector_with_every_field_and_filter_there(
        tmp_path: Path, journald: PrivateJournald, collector: Collector, uploader: subprocess.Popen[bytes]) -> None:

    port = free_port()
    model = tmp_path / "fake.gguf"
    model.write_bytes(b"GGUF" + bytes(28))  # the fake server never reads it; the daemon checks the magic
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"server_on_gpu": True}))
    sections = merge(base_sections(tmp_path, str(FAKE_SERVER), str(model), port), {
        "server": {"n_gpu_layers": 99, "env": {"FAKE_LLAMA_FAULT": "oom_runtime", "FAKE_LLAMA_LOAD_S": "0.2"}},
        "health": {"canary": False},
        "gpu": {"enabled": "on", "index": 0, "sample_interval_s": 0.2, "vram_release_timeout_s": 3.0,
                "server_on_gpu_timeout_s": 5.0, "kmsg_path": str(tmp_path / "no-kmsg"), "temperature_warn_c": 80},
        "recovery": {"reset_command": [sys.executable, str(STUB), "--tag", str(tmp_path), "--gpu-reset", "-i",
                                       "{index}"], "reset_timeout_s": 3.0, "max_resets": 3},
        "log": {"format": "journald", "level": "info"},
    })
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p),
           "FAKE_NVML_SCRIPT": str(nvml), "FAKE_NVML_STATE": str(tmp_path / "nvml-state.json"),
           "STUB_RESET_RECORD": str(tmp_path / "reset-record.jsonl"), "STUB_RESET_MODE": "ok"}
    run = DaemonRun(tmp_path, sections, env=env, command=FAKE_NVML_RUN,
                    prefix=["unshare", "--mount", "--propagation", "private", "sh", "-c", BIND_JOURNAL,
                            str(journald.run_dir)])
    try:
        run.start()

        def local(match: str) -> Any:
            return lambda: journald.entries("SYSLOG_IDENTIFIER=llama-guard", match)

        first = int(wait_for(local("LLAMA_GUARD_EVENT=server_ready"), "server_ready", 30)[0]["SERVER_PID"])
        nvml.write_text(json.dumps({"server_on_gpu": True, "values": {"temperature": 91}}))
        wait_for(local("LLAMA_GUARD_EVENT=gpu_temperature_high"), "gpu_temperature_high", 15)
        nvml.write_text(json.dumps({"server_on_gpu": True, "values": {"temperature": 60}, "xids": [48]}))
        wait_for(local("LLAMA_GUARD_EVENT=gpu_xid"), "gpu_xid", 15)
        wait_for(lambda: [e for e in journald.entries("LLAMA_GUARD_EVENT=server_ready")
                          if int(e["SERVER_PID"]) != first], "a second server_ready", 30)
        # the newest in journal order (not the largest pid: pids wrap around at pid_max)
        second = [int(e["SERVER_PID"]) for e in journald.entries("LLAMA_GUARD_EVENT=server_ready")][-1]
        with pytest.raises(httpx.HTTPError):  # the fake server's CUDA OOM block, then SIGABRT
            httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "x", "n_predict": 1}, timeout=10)
        [oom] = wait_for(local("LLAMA_GUARD_EVENT=server_oom"), "server_oom", 15)
        assert int(oom["SERVER_PID"]) == second

        # On the collector: the OOM, filtered by its field, as on the box.
        [remote_oom] = wait_for(lambda: collector.entries("LLAMA_GUARD_EVENT=server_oom"), "remote server_oom", 30)
        run.signal(signal.SIGTERM)
        assert run.wait_exit(30) == 0
        wait_for(local("LLAMA_GUARD_EVENT=daemon_exit"), "daemon_exit", 10)
    finally:
        run.stop()
        for pid in server_pids_of(port):
            os.kill(pid, signal.SIGKILL)

    # Every llama-guard entry of the box arrives, each field byte for byte (the journal's own
    # per-file cursor and sequence numbers aside).
    sent = journald.entries("SYSLOG_IDENTIFIER=llama-guard")
    deadline = time.monotonic() + 30
    while len(collector.entries("SYSLOG_IDENTIFIER=llama-guard")) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.2)
    uploader.send_signal(signal.SIGTERM)
    uploader.wait(10)
    collector.stop()
    received = collector.entries("SYSLOG_IDENTIFIER=llama-guard")

    def strip(entry: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in entry.items() if k not in PER_FILE}

    assert [strip(e) for e in received] == [strip(e) for e in sent]
    events = {e["LLAMA_GUARD_EVENT"] for e in received}
    assert {"server_starting", "server_ready", "gpu_temperature_high", "gpu_xid", "gpu_reset", "server_oom",
            "server_restart", "daemon_exit"} <= events
    hot = next(e for e in received if e["LLAMA_GUARD_EVENT"] == "gpu_temperature_high")
    assert hot["GPU_UUID"].startswith("GPU-") and hot["GPU_TEMP_C"] == "91"
    xid = next(e for e in received if e["LLAMA_GUARD_EVENT"] == "gpu_xid")
    assert xid["XID"] == "48" and int(xid["SERVER_PID"]) == first
    assert remote_oom == next(e for e in received if e["LLAMA_GUARD_EVENT"] == "server_oom") | {
        k: remote_oom[k] for k in PER_FILE if k in remote_oom}
    assert int(remote_oom["SERVER_PID"]) == second and "out of memory" in remote_oom["LINE"]
    assert remote_oom["PRIORITY"] == oom["PRIORITY"] and remote_oom["MESSAGE_ID"] == oom["MESSAGE_ID"]
    # Fields the box's journald added (trusted, underscore-prefixed) travel too.
    assert remote_oom["_TRANSPORT"] == "journal" and remote_oom["_PID"] == oom["_PID"]
