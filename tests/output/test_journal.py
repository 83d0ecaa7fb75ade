"""The journald sink against a real, private systemd-journald (see tests/systemd_fixtures.py)."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import textwrap
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from llama_guard.output.eventlog import Emitter
from llama_guard.output.journal import (
    JournalSink,
    fallback_line,
    field_name,
    field_value,
    journal_fields,
    journald_enabled,
    stderr_is_journal,
)
from llama_guard.vocab.events import CATALOG

if TYPE_CHECKING:
    from systemd_fixtures import PrivateJournald, PrivateUserManager

pytestmark = pytest.mark.systemd


def _emitter(sink: JournalSink) -> Emitter:
    return Emitter(stream=io.StringIO(), sinks=[sink], fmt="json")


@pytest.fixture
def sink(private_journald: PrivateJournald) -> Any:
    fallback = io.StringIO()
    s = JournalSink(private_journald.socket_path, fallback=fallback, level_prefix=False)
    yield s
    s.close()


def test_events_arrive_with_fields(private_journald: PrivateJournald, sink: JournalSink) -> None:
    stderr = io.StringIO()
    em = Emitter(stream=stderr, sinks=[sink], fmt="json")
    em.emit("server_ready", server_pid=4242, load_s=12.5)
    em.emit("server_exited", server_pid=4242, exit_status=134, signal="SIGABRT",
            exit_text="killed by SIGABRT", restart_count=2)
    em.emit("gpu_temperature_high", gpu_index=0, gpu_temp_c=91, threshold_c=85)
    assert sink.flush()

    entries = private_journald.entries("SYSLOG_IDENTIFIER=llama-guard")
    by_event = {e["LLAMA_GUARD_EVENT"]: e for e in entries}
    assert set(by_event) == {"server_ready", "server_exited", "gpu_temperature_high"}

    ready = by_event["server_ready"]
    assert ready["MESSAGE"] == "llama-server pid 4242 ready after 12.50 s"
    assert ready["PRIORITY"] == "5"
    assert ready["MESSAGE_ID"] == CATALOG["server_ready"].message_id
    assert ready["SERVER_PID"] == "4242"
    assert ready["LOAD_S"] == "12.5"
    assert ready["_TRANSPORT"] == "journal"

    exited = by_event["server_exited"]
    assert exited["PRIORITY"] == "3"
    assert (exited["EXIT_STATUS"], exited["SIGNAL"], exited["RESTART_COUNT"]) == ("134", "SIGABRT", "2")

    hot = by_event["gpu_temperature_high"]
    assert (hot["GPU_INDEX"], hot["GPU_TEMP_C"], hot["PRIORITY"]) == ("0", "91", "4")
    assert "°C" in hot["MESSAGE"]
    for entry in entries:  # no lower-case or internal keys leak
        assert "LEVEL" not in entry
        assert "EVENT" not in entry
        assert "SEVERITY" not in entry  # journald has PRIORITY; severity is the JSON lines' name for it
    assert sink.sent == 3
    assert sink.fallback_count == 0

    # The JSON lines on stderr: the syslog severity by name beside Python's level (which has no
    # notice), and a timestamp with its UTC offset.
    lines = {d["event"]: d for d in map(json.loads, stderr.getvalue().splitlines())}
    assert [(lines[n]["level"], lines[n]["severity"]) for n in ("server_ready", "server_exited")] == [
        ("info", "notice"), ("error", "error")]
    keys = list(lines["server_ready"])
    assert keys[keys.index("level") + 1] == "severity"
    stamp = datetime.fromisoformat(lines["server_ready"]["timestamp"])
    assert stamp.utcoffset() is not None and abs(stamp.timestamp() - time.time()) < 60


def test_filter_by_event(private_journald: PrivateJournald, sink: JournalSink) -> None:
    em = _emitter(sink)
    for pid in (1, 2, 3):
        em.emit("server_starting", server_pid=pid, argv=["llama-server", "-m", "m.gguf"])
    em.emit("server_oom", server_pid=3, line="CUDA error: out of memory")
    assert sink.flush()
    oom = private_journald.entries("LLAMA_GUARD_EVENT=server_oom")
    assert [e["SERVER_PID"] for e in oom] == ["3"]
    assert oom[0]["LINE"] == "CUDA error: out of memory"
    starting = private_journald.entries("LLAMA_GUARD_EVENT=server_starting")
    assert [e["SERVER_PID"] for e in starting] == ["1", "2", "3"]
    assert starting[0]["ARGV"] == "llama-server -m m.gguf"


def test_multiline_message_survives(private_journald: PrivateJournald, sink: JournalSink) -> None:
    reason = "line 1: unknown key 'sever'\nline 7: port must be <= 65535\n\ttab and ümlaut"
    _emitter(sink).emit("config_error", reason=reason)
    assert sink.flush()
    [entry] = private_journald.entries("LLAMA_GUARD_EVENT=config_error")
    assert entry["MESSAGE"] == "configuration error: " + reason
    assert entry["REASON"] == reason


def test_server_lines_low_priority_and_marked(private_journald: PrivateJournald, sink: JournalSink) -> None:
    em = _emitter(sink)
    em.emit("server_line", server_pid=77, line="srv  load_model: loading model 'x.gguf'", stream="stderr")
    em.emit("server_ready", server_pid=77, load_s=0.8)
    assert sink.flush()
    [line] = private_journald.entries("LLAMA_SERVER_LINE=1")
    assert line["MESSAGE"] == "srv  load_model: loading model 'x.gguf'"
    assert line["PRIORITY"] == "7"
    assert line["SYSLOG_IDENTIFIER"] == "llama-guard"
    assert line["LLAMA_GUARD_EVENT"] == "server_line"
    assert line["SERVER_PID"] == "77"
    assert line["STREAM"] == "stderr"
    assert "LINE" not in line  # the line is the MESSAGE, not repeated
    # Events at warning and above do not include the server's lines.
    assert [e["LLAMA_GUARD_EVENT"] for e in private_journald.entries("-p", "notice")] == ["server_ready"]


def test_large_message_goes_through_memfd(private_journald: PrivateJournald, sink: JournalSink) -> None:
    big = "x" * 400_000  # above the datagram limit: sent as a sealed memfd
    _emitter(sink).emit("server_line", server_pid=5, line=big)
    assert sink.flush()
    [entry] = private_journald.entries("LLAMA_SERVER_LINE=1")
    assert len(entry["MESSAGE"]) == len(big)
    assert sink.fallback_count == 0


def test_socket_removed_mid_run_falls_back_and_recovers(private_journald: PrivateJournald) -> None:
    fallback = io.StringIO()
    sink = JournalSink(private_journald.socket_path, fallback=fallback, level_prefix=True)
    em = _emitter(sink)
    try:
        em.emit("server_ready", server_pid=10, load_s=1.0)
        assert sink.flush()
        assert sink.sent == 1

        private_journald.socket_path.unlink()
        em.emit("server_exited", server_pid=10, exit_status=1, exit_text="exit status 1")
        em.emit("config_error", reason="two\nlines")
        assert sink.flush()
        assert sink.fallback_active
        assert sink.fallback_count == 2
        out = fallback.getvalue()
        assert "journal socket" in out
        assert "unusable" in out
        assert "<3>server_exited: llama-server pid 10 exited: exit status 1" in out
        assert "SERVER_PID=10 EXIT_STATUS=1" in out
        assert "<3>config_error: configuration error: two\\nlines" in out  # one event, one line

        # journald comes back (a new instance on the same directories): the sink uses it again.
        from systemd_fixtures import PrivateJournald

        base = private_journald.base
        private_journald.stop()
        again = PrivateJournald(base).start()
        try:
            em.emit("server_ready", server_pid=11, load_s=2.0)
            assert sink.flush()
            assert not sink.fallback_active
            assert "is back" in fallback.getvalue()
            assert [e["SERVER_PID"] for e in again.entries("LLAMA_GUARD_EVENT=server_ready")] == ["10", "11"]
        finally:
            again.stop()
    finally:
        sink.close()


def test_socket_missing_from_the_start_uses_default_stderr(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sink = JournalSink(tmp_path / "no-such-socket", level_prefix=False)
    try:
        _emitter(sink).emit("crash_loop", restart_count=5, window_s=600)
        assert sink.flush()
    finally:
        sink.close()
    err = capsys.readouterr().err
    assert "crash_loop: llama-server failed 5 times within 600 s; giving up" in err
    assert sink.sent == 0
    assert sink.fallback_count == 1


def test_a_frozen_journald_never_blocks_the_caller(private_journald: PrivateJournald) -> None:
    assert private_journald.proc is not None
    fallback = io.StringIO()
    sink = JournalSink(private_journald.socket_path, fallback=fallback, queue_size=50, send_timeout_s=0.05)
    # Who sends: never the caller (the sink's own thread does, each send bounded by send_timeout_s).
    senders: list[str] = []
    send_one = sink._send_one

    def recorded(fields: Any) -> None:
        senders.append(threading.current_thread().name)
        send_one(fields)

    sink._send_one = recorded  # type: ignore[method-assign]
    em = _emitter(sink)
    os.kill(private_journald.proc.pid, signal.SIGSTOP)
    try:
        for i in range(2000):
            em.emit("server_line", server_pid=1, line=f"line {i} " + "y" * 200)
        # All 2000 returned with journald stopped: the queue (50) filled and the rest were dropped, not waited for.
        assert sink.dropped > 0
        assert senders and set(senders) == {"journal-sink"}, set(senders)
    finally:
        os.kill(private_journald.proc.pid, signal.SIGCONT)
    assert sink.flush(timeout_s=10)
    sink.close()
    assert "dropped" in fallback.getvalue() or sink.fallback_count > 0


def test_sink_never_raises_after_close(private_journald: PrivateJournald) -> None:
    sink = JournalSink(private_journald.socket_path)
    sink.close()
    sink.close()
    sink.write({"event": "server_ready", "message": "m", "priority": 5})
    assert sink.dropped == 1


# --- pure parts ------------------------------------------------------------------------------

def test_journal_fields_encoding() -> None:
    fields = dict(journal_fields({
        "event": "server_starting", "message": "m", "priority": 6, "message_id": "ab" * 16,
        "level": "info", "server_pid": 7, "argv": ["llama-server", "--alias", "a b"],
        "ok": True, "none": None, "ratio": 0.25, "nested": {"a": [1, 2]}, "path": Path("/x"),
        "_trusted": "dropped?", "9lives": 9, "weird-key.name": "v", "x" * 80: "long",
    }))
    assert fields["MESSAGE"] == "m"
    assert fields["PRIORITY"] == "6"
    assert fields["SYSLOG_IDENTIFIER"] == "llama-guard"
    assert fields["LLAMA_GUARD_EVENT"] == "server_starting"
    assert fields["MESSAGE_ID"] == "ab" * 16
    assert fields["SERVER_PID"] == "7"
    assert fields["ARGV"] == "llama-server --alias 'a b'"
    assert fields["OK"] == "true"
    assert "NONE" not in fields
    assert fields["RATIO"] == "0.25"
    assert fields["NESTED"] == '{"a": [1, 2]}'
    assert fields["PATH"] == "/x"
    assert fields["TRUSTED"] == "dropped?"  # leading underscore stripped: not a trusted field
    assert fields["LIVES"] == "9"
    assert fields["WEIRD_KEY_NAME"] == "v"
    assert fields["X" * 64] == "long"
    assert "LEVEL" not in fields
    assert "EVENT" not in fields


def test_field_helpers() -> None:
    assert field_name("gpu_temp_c") == "GPU_TEMP_C"
    assert field_name("___") is None
    assert field_value(None) is None
    assert field_value(b"\x00raw") == b"\x00raw"
    assert field_value(object()) is not None


def test_server_line_priority_is_always_7() -> None:
    fields = dict(journal_fields({"event": "server_line", "priority": 3, "message": "x", "line": "x"}))
    assert fields["PRIORITY"] == "7"
    assert fields["LLAMA_SERVER_LINE"] == "1"
    assert "LINE" not in fields


def test_fallback_line() -> None:
    fields = journal_fields({"event": "gpu_xid", "message": "GPU 0 reported Xid 79: bus\nfell",
                             "priority": 3, "gpu_index": 0, "xid": 79})
    assert fallback_line(fields, level_prefix=True) == (
        "<3>gpu_xid: GPU 0 reported Xid 79: bus\\nfell GPU_INDEX=0 XID=79\n")
    assert fallback_line(fields, level_prefix=False).startswith("gpu_xid: ")


# --- when journald output is on ----------------------------------------------------------------

def test_journald_enabled_by_format_and_stream(tmp_path: Path) -> None:
    f = tmp_path / "stderr"
    with open(f, "w") as fh:
        st = os.fstat(fh.fileno())
        match = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert stderr_is_journal(match, fh.fileno())
        assert journald_enabled("auto", environ=match, stderr_fd=fh.fileno())
        assert not journald_enabled("json", environ=match, stderr_fd=fh.fileno())
        assert not journald_enabled("console", environ=match, stderr_fd=fh.fileno())
        other = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}
        assert not journald_enabled("auto", environ=other, stderr_fd=fh.fileno())
        assert journald_enabled("journald", environ={}, stderr_fd=fh.fileno())
        for bad in ("", "garbage", "1:x", ":"):
            assert not stderr_is_journal({"JOURNAL_STREAM": bad}, fh.fileno())
    assert not stderr_is_journal(match, 987654)  # closed descriptor


def test_under_a_real_unit_stderr_is_the_journal_and_the_default_socket_works(
        private_user_manager_with_journal: tuple[PrivateUserManager, PrivateJournald]) -> None:
    """A unit with stderr on the journal: ``journald_enabled("auto")`` is true, and a sink on the
    default socket path (bind-mounted to the private journald) delivers."""
    manager, journal = private_user_manager_with_journal
    script = manager.base / "probe.py"
    script.write_text(textwrap.dedent("""
        import sys
        from llama_guard.output.journal import JournalSink, journald_enabled
        print("enabled", journald_enabled("auto"), journald_enabled("json"), file=sys.stderr)
        sink = JournalSink()
        sink.write({"event": "daemon_started", "message": "probe", "priority": 6, "version": "t"})
        sink.close()
        print("sent", sink.sent, file=sys.stderr)
    """))
    manager.install_unit("probe.service", textwrap.dedent(f"""
        [Service]
        Type=oneshot
        ExecStart={sys.executable} {script}
        StandardError=journal
    """))
    result = manager.systemctl("start", "probe.service")
    assert result.returncode == 0, result.stderr
    messages = [e["MESSAGE"] for e in journal.entries()]
    assert "enabled True False" in messages
    assert "sent 1" in messages
    [entry] = journal.entries("LLAMA_GUARD_EVENT=daemon_started")
    assert entry["VERSION"] == "t"
    # journald sees the host's cgroup path (the manager's cgroup namespace is private).
    assert entry["_SYSTEMD_CGROUP"].endswith("/app.slice/probe.service")
