"""A new llama-server build whose answers fail while ``/health`` is fine (a backend rename after which an
endpoint answers 500): a serving daemon pointed at it (reload) ends up serving on the last good build,
with the cause named, whether the trial finds it (the native ``/completion``) or its probation does
(``[front].hold_after_errors`` client requests answered 5xx, in a row or not, confirmed by llama-guard's
own requests). Client requests that any build answers 500 (an out-of-range token to ``/detokenize``, an
image to a text model) do not roll a good new build back: llama-guard's own requests answer 2xx.

The bad builds are the real llama-server behind a small proxy that answers 500 on the endpoints it is
told to break (tests/endpoint_fault_proxy.py) — what an attack put in front of the real server, where a
build answering 67 × 500 against 1 × 200 passed its trial and its probation and became the last good build.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from test_upgrade_e2e import ClientLoop, copy_build, reload_with, script, serving, started_binaries, status_when

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

PROXY = Path(__file__).resolve().parent.parent / "endpoint_fault_proxy.py"
HOLD_S = 600.0
TRIAL = {"probation_s": 600.0, "trial_runs": 1, "trial_tokens": 8, "max_slowdown_pct": 95.0,
         "trial_timeout_s": 300.0}


def broken_endpoints(path: Path, real: Path, paths: str, after: int = 0) -> Path:
    """The real build behind the proxy: ``paths`` (comma-separated) answer 500 once ``after`` requests
    to them passed."""
    return script(path, f'ENDPOINT_FAULT_PATHS="{paths}" ENDPOINT_FAULT_AFTER={after} '
                        f'exec "{sys.executable}" "{PROXY}" "{real}" "$@"\n')


def test_a_build_whose_native_completion_answers_500_fails_its_trial(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """Before: the trial measured /v1/chat/completions alone, the build was kept and served 500s."""
    bad = broken_endpoints(tmp_path / "llama-server-no-completion", llama_server_bin, "/completion")
    with serving(tmp_path, llama_server_bin, real_model, upgrade=TRIAL, front={"hold_timeout_s": HOLD_S},
                 server={"threads": 1}) as run, ClientLoop(run.front, HOLD_S + 60) as clients:
        reload_with(run, bad)
        run.wait_event("upgrade_preflight_passed", 120)
        back = run.wait_event("upgrade_rolled_back", 600)
        assert back["from_binary"] == str(bad) and back["to_binary"] == str(llama_server_bin), back
        assert "POST /completion answered HTTP 500" in back["cause"], back
        run.wait_event("server_ready", 300, skip=1)
        assert started_binaries(run) == [str(llama_server_bin), str(bad), str(llama_server_bin)]
        assert "upgrade_trial_passed" not in run.names() and "upgrade_kept" not in run.names()
    assert clients.failures == [] and clients.done >= 1


@pytest.mark.parametrize(("endpoint", "body"), [
    ("/completion", {"prompt": "Hello", "n_predict": 2}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
])
def test_a_run_of_5xx_in_its_probation_rolls_the_build_back(
        tmp_path: Path, llama_server_bin: Path, real_model: Path, endpoint: str,
        body: dict[str, object]) -> None:
    """No trial (``trial_runs`` 0): the build is ready and on probation; clients' requests to the broken
    endpoint answer 500 — a run of ``hold_after_errors`` (3) of them fails the build, the daemon restarts
    on the last good build, and the same requests answer 200 again. Before: counted and reported
    (``server_http_errors``), the build kept after its probation."""
    bad = broken_endpoints(tmp_path / "llama-server-broken", llama_server_bin, endpoint)
    with serving(tmp_path, llama_server_bin, real_model, upgrade={"probation_s": 600.0},
                 front={"hold_after_errors": 3}) as run:
        reload_with(run, bad)
        run.wait_event("upgrade_preflight_passed", 120)
        run.wait_event("server_ready", 120, skip=1)
        url = f"http://127.0.0.1:{run.front}{endpoint}"
        statuses = [httpx.post(url, json=body, timeout=120).status_code for _ in range(3)]
        assert statuses == [500, 500, 500]
        back = run.wait_event("upgrade_rolled_back", 120)
        assert back["from_binary"] == str(bad) and back["to_binary"] == str(llama_server_bin), back
        assert "3 client requests with HTTP 5xx (the last 500)" in back["cause"], back
        assert "into its probation" in back["cause"], back
        assert f"llama-guard's own request too: POST {endpoint} answered HTTP 500" in back["cause"], back
        run.wait_event("server_ready", 120, skip=2)
        assert started_binaries(run) == [str(llama_server_bin), str(bad), str(llama_server_bin)]
        assert httpx.post(url, json=body, timeout=120).status_code == 200
        status = status_when(tmp_path, lambda s: s["build"]["refused"] is not None)
        assert status["build"]["serving"]["binary"] == str(llama_server_bin)
        assert "HTTP 5xx" in status["build"]["refused"]["cause"]
        assert "upgrade_kept" not in run.names()


def test_a_build_that_passes_its_trial_then_answers_500_is_rolled_back_in_its_probation(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """The chat endpoint answers its first 2 requests (the trial's warm-up and run) and 500 after: the
    trial keeps the build, a run of client 5xx in its probation rolls it back."""
    bad = broken_endpoints(tmp_path / "llama-server-later", llama_server_bin, "/v1/chat/completions", after=2)
    with serving(tmp_path, llama_server_bin, real_model, upgrade=TRIAL, front={"hold_timeout_s": HOLD_S},
                 server={"threads": 1}) as run:
        reload_with(run, bad)
        assert run.wait_event("upgrade_trial_passed", 600)["binary"] == str(bad)
        url = f"http://127.0.0.1:{run.front}/v1/chat/completions"
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert [httpx.post(url, json=chat, timeout=120).status_code for _ in range(3)] == [500, 500, 500]
        back = run.wait_event("upgrade_rolled_back", 120)
        assert back["from_binary"] == str(bad) and back["to_binary"] == str(llama_server_bin), back
        assert "client requests with HTTP 5xx" in back["cause"], back
        assert "own request too: POST /v1/chat/completions answered HTTP 500" in back["cause"], back
        run.wait_event("server_ready", 300, skip=2)
        assert httpx.post(url, json=chat, timeout=120).status_code == 200
        assert started_binaries(run) == [str(llama_server_bin), str(bad), str(llama_server_bin)]


def test_a_broken_endpoint_hidden_in_mixed_traffic_is_rolled_back_in_its_probation(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """Clients alternate the broken chat endpoint (500) with the native one (200): no run of 5xx in a
    row, yet 3 client 5xx on a build on probation are checked, llama-guard's own chat request answers 500
    and the build is rolled back. Before: each 200 reset the run, and the build was kept after its
    probation."""
    bad = broken_endpoints(tmp_path / "llama-server-no-chat", llama_server_bin, "/v1/chat/completions")
    with serving(tmp_path, llama_server_bin, real_model, upgrade={"probation_s": 600.0},
                 front={"hold_after_errors": 3}) as run:
        reload_with(run, bad)
        run.wait_event("server_ready", 120, skip=1)
        chat = (f"http://127.0.0.1:{run.front}/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        native = (f"http://127.0.0.1:{run.front}/completion", {"prompt": "Hello", "n_predict": 2})
        statuses = [httpx.post(url, json=body, timeout=120).status_code
                    for url, body in (chat, native, chat, native, chat)]
        assert statuses == [500, 200, 500, 200, 500]
        back = run.wait_event("upgrade_rolled_back", 120)
        assert back["from_binary"] == str(bad) and back["to_binary"] == str(llama_server_bin), back
        assert "POST /v1/chat/completions answered HTTP 500" in back["cause"], back
        run.wait_event("server_ready", 120, skip=2)
        assert httpx.post(chat[0], json=chat[1], timeout=120).status_code == 200
        # back to the good build, then to the failed one again: refused at the reload, saying why (before:
        # reloaded, then quietly started as the good build, no event)
        reload_with(run, llama_server_bin)
        run.wait_event("config_reloaded", 60, skip=1)
        reload_with(run, bad)
        refused = run.wait_event("upgrade_refused", 120)
        assert refused["binary"] == str(bad) and "it failed here before" in refused["cause"], refused
        assert "POST /v1/chat/completions answered HTTP 500" in refused["cause"], refused
        assert httpx.post(chat[0], json=chat[1], timeout=120).status_code == 200
        # the good build's path named again restarts it (the file named the failed one); the failed one never again
        assert started_binaries(run) == [str(llama_server_bin), str(bad), str(llama_server_bin), str(llama_server_bin)]


@pytest.mark.parametrize(("endpoint", "body"), [
    ("/detokenize", {"tokens": [999_999_999]}),  # llama-server: 500 vector::_M_range_check
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 2}),
])
def test_client_requests_that_any_build_fails_do_not_roll_a_good_build_back(
        tmp_path: Path, llama_server_bin: Path, real_model: Path, endpoint: str, body: dict[str, object]) -> None:
    """A good new build (the real one, a byte appended: another content hash) on probation; a client sends
    requests that llama-server answers 500 whatever its build. llama-guard's own requests answer 2xx
    (``upgrade_errors_not_confirmed``) and the build stays. Before: 3 such requests rolled it back, and it
    stayed refused for the daemon's life."""
    new = copy_build(llama_server_bin, tmp_path / "new-build")
    with new.open("ab") as f:
        f.write(b"\0another build\0")
    with serving(tmp_path, llama_server_bin, real_model, upgrade={"probation_s": 600.0},
                 front={"hold_after_errors": 3}) as run:
        reload_with(run, new)
        run.wait_event("server_ready", 120, skip=1)
        url = f"http://127.0.0.1:{run.front}{endpoint}"
        assert [httpx.post(url, json=body, timeout=120).status_code for _ in range(3)] == [500, 500, 500]
        checked = run.wait_event("upgrade_errors_not_confirmed", 120)
        assert checked["errors"] == 3 and checked["status"] == 500, checked
        assert "upgrade_rolled_back" not in run.names()
        assert started_binaries(run) == [str(llama_server_bin), str(new)]
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert httpx.post(f"http://127.0.0.1:{run.front}/v1/chat/completions", json=chat, timeout=120).status_code \
            == 200
