"""End to end, the REAL llama-server on the REAL model: the front door shows clients what llama-server
would show under the user's own flags, not what llama-guard enables for itself (``--metrics``,
``--slots``, its own ``--slot-save-path``), and it listens on every address of ``[front].listen``."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import SERVER_THREADS, free_port, terminate

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


@contextlib.contextmanager
def bare_server(binary: Path, model: Path, *flags: str) -> Iterator[str]:
    """llama-server alone with ``flags`` (what a user without llama-guard runs): its base URL once
    ``/health`` answers 200."""
    port = free_port()
    proc = subprocess.Popen([str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                             "--ctx-size", "512", "--threads", str(SERVER_THREADS), *flags],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"bare llama-server exited {proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        terminate(proc, 10)


def answer(resp: httpx.Response) -> tuple[int, str, bytes]:
    return resp.status_code, resp.headers.get("content-type", ""), resp.content


def test_metrics_the_user_did_not_enable_answer_as_llama_server_without_metrics(
        door: Any, llama_server_bin: Path, real_model: Path) -> None:
    """llama.cpp's test_metrics_disabled through the front door: 501, byte for byte llama-server's own
    answer without ``--metrics``, whatever the path's spelling; llama-guard's own probes still read them."""
    run = door(extra={"server": {"ctx_size": 512}})
    front = f"http://127.0.0.1:{run.front}"
    with bare_server(llama_server_bin, real_model) as bare:
        want = answer(httpx.get(bare + "/metrics", timeout=30))
        assert want[0] == 501
        for target in ("/metrics", "/metrics?format=prometheus", "/metric%73", "/%6detrics"):
            assert answer(httpx.get(front + target, timeout=30)) == want, target
            assert answer(httpx.get(bare + target, timeout=30)) == want, target
        head = httpx.head(front + "/metrics", timeout=30)
        assert head.status_code == httpx.head(bare + "/metrics", timeout=30).status_code == 501
    assert httpx.post(front + "/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=120).status_code == 200
    assert "/metrics lacks" not in str(run.events())  # the liveness probe still reads llama-server's own


def test_metrics_the_user_enabled_pass_through(door: Any) -> None:
    run = door(extra={"server": {"ctx_size": 512, "extra_args": ["--metrics"]}})
    resp = httpx.get(f"http://127.0.0.1:{run.front}/metrics", timeout=30)
    assert resp.status_code == 200 and "llamacpp:prompt_tokens_total" in resp.text
    started = run.wait_event("server_starting")
    assert started["argv"].count("--metrics") == 1  # the user's flag is not repeated


def test_slots_and_slot_actions_the_user_did_not_enable_never_reach_the_server(
        door: Any, llama_server_bin: Path, real_model: Path, tmp_path: Path) -> None:
    """``--no-slots``: GET /slots is llama-server's 501 while llama-guard's own probes keep /slots;
    without the user's ``--slot-save-path`` a slot action is llama-server's 501 and writes nothing in
    llama-guard's slot directory (it would have saved a file there, named by the client)."""
    slots_dir = tmp_path / "slots"
    run = door(extra={"server": {"ctx_size": 512, "extra_args": ["--no-slots"]}, "slots": {"dir": str(slots_dir)}})
    front = f"http://127.0.0.1:{run.front}"
    assert "--slots" in run.wait_event("server_starting")["argv"].split()
    assert "--no-slots" not in run.wait_event("server_starting")["argv"].split()
    assert httpx.post(front + "/completion", json={"prompt": "Hi", "n_predict": 2, "id_slot": 0},
                      timeout=120).status_code == 200
    with bare_server(llama_server_bin, real_model, "--no-slots") as bare:
        for method, target in (("GET", "/slots"), ("GET", "/slot%73"), ("POST", "/slots/0?action=save"),
                               ("POST", "/slots/0?action=erase"), ("POST", "/slot%73/0?action=restore")):
            body = {"filename": "client.bin"} if method == "POST" else None
            want = answer(httpx.request(method, bare + target, json=body, timeout=30))
            got = answer(httpx.request(method, front + target, json=body, timeout=30))
            assert want[0] == 501 and got == want, (method, target, got)
    assert not list(slots_dir.glob("client.bin*"))


def test_slot_actions_of_the_users_own_slot_save_path_pass_through(door: Any, tmp_path: Path) -> None:
    own = tmp_path / "own-slots"
    own.mkdir()
    run = door(extra={"server": {"ctx_size": 512, "extra_args": ["--slot-save-path", str(own)]},
                      "slots": {"enabled": False}})
    front = f"http://127.0.0.1:{run.front}"
    assert httpx.post(front + "/completion", json={"prompt": "Hi", "n_predict": 2, "id_slot": 0},
                      timeout=120).status_code == 200
    resp = httpx.post(front + "/slots/0?action=save", json={"filename": "mine.bin"}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert (own / "mine.bin").is_file()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("hosts", [("127.0.0.1", "127.0.0.2"),
                                   pytest.param(("127.0.0.1", "[::1]"), marks=pytest.mark.skipif(
                                       not _ipv6_loopback(), reason="no IPv6 loopback on this host"))])
def test_front_listens_on_every_address(door: Any, hosts: tuple[str, str]) -> None:
    """llama.cpp's test_server_multiple_addresses: ``--host 127.0.0.1,::1`` answers on both."""
    port = free_port()
    run = door(front={"listen": ",".join(f"{host}:{port}" for host in hosts)}, extra={"server": {"ctx_size": 512}})
    listening = run.wait_event("front_listening")
    assert listening["listen"] == ",".join(f"{host}:{port}" for host in hosts)
    for host in hosts:
        resp = httpx.post(f"http://{host}:{port}/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=120)
        assert resp.status_code == 200 and resp.json()["tokens_predicted"] == 2, host


def test_a_missing_own_slot_save_path_is_refused_as_llama_server_would_and_not_created(
        door: Any, llama_server_bin: Path, real_model: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    bare = subprocess.run([str(llama_server_bin), "--model", str(real_model), "--slot-save-path", str(missing),
                           "--port", str(free_port())], capture_output=True, timeout=60, check=False)
    assert bare.returncode != 0 and b"not a directory" in bare.stdout + bare.stderr
    with pytest.raises(AssertionError, match=r"daemon exited \(78\)"):
        door(extra={"server": {"extra_args": ["--slot-save-path", str(missing)]}})
    assert not missing.exists()
