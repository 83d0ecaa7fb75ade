"""A ``tune`` that asks the serving daemon for the GPU on tune.sock and is gone before the window is
granted (its connection closed, its process killed): the window is cancelled — the drain under way is
undone and the same llama-server serves on, no restart (before: the drain went on into a restart
labelled ``restart_cause: crash``), and ``lend_cancelled`` names the cause.

A long completion is in flight through the front door when the ask comes, so that the drain is still
waiting for it when the peer goes (1,000 tokens at one thread: tens of seconds here; the peer goes
milliseconds after the ask)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_upgrade_e2e import serving

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

ASKER = ("import socket, sys\n"
         "s = socket.socket(socket.AF_UNIX)\n"
         "s.connect(sys.argv[1])\n"
         "s.sendall(b'{\"minutes\": 1}\\n')\n"
         "print('asked', flush=True)\n"
         "s.recv(4096)\n")


@pytest.mark.parametrize("gone", ["connection closed", "process killed"])
def test_tune_gone_before_the_grant_cancels_the_window_and_the_server_serves_on(
        tmp_path: Path, llama_server_bin: Path, real_model: Path, gone: str) -> None:
    with serving(tmp_path, llama_server_bin, real_model, server={"threads": 1},
                 schedule={"drain_timeout_s": 300.0}) as run:
        pid = run.wait_event("server_ready")["server_pid"]
        sock_path = str(tmp_path / "run" / "tune.sock")
        body = {"prompt": "Count slowly:", "n_predict": 1000, "stream": True}
        with httpx.Client(timeout=300) as client, \
                client.stream("POST", f"http://127.0.0.1:{run.front}/completion", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # in flight: its first token came
            if gone == "connection closed":
                with socket.socket(socket.AF_UNIX) as asker:
                    asker.connect(sock_path)
                    asker.sendall(b'{"minutes": 1}\n')
                    run.wait_event("lend_requested", 60)
            else:
                proc = subprocess.Popen([sys.executable, "-c", ASKER, sock_path], stdout=subprocess.PIPE, text=True)
                assert proc.stdout is not None and proc.stdout.readline().strip() == "asked"
                run.wait_event("lend_requested", 60)
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
            cancelled = run.wait_event("lend_cancelled", 60)
        assert cancelled["outcome"] == "the drain is undone: the server serves on", cancelled
        assert "is gone before the window was granted" in cancelled["cause"], cancelled
        assert cancelled["server_pid"] == pid
        answer = httpx.post(f"http://127.0.0.1:{run.front}/completion", json={"prompt": "Hi", "n_predict": 2},
                            timeout=120)
        assert answer.status_code == 200, answer.text
        names = run.names()
        assert not {"server_restart", "server_stopped", "lend_granted", "lend_returned"} & set(names), names
        assert run.wait_event("lend_requested")["server_pid"] == pid
