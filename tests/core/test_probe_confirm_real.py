"""The confirming liveness round (``ServerProbe.liveness(confirm=True)``), against the real llama-server:
after a run of 5xx client answers the front door holds new requests and one round must tell at once whether
completions work. With one slot that holds a conversation (``--parallel 1`` after the first request) an
ordinary round sends no canary (it never displaces a conversation); the confirming one sends it anyway, on the
slot llama-server picks, so that the run is confirmed or cleared by the server itself."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import free_port, terminate
from llama_guard.core.probes import CanaryOutcome, ServerProbe

pytestmark = [pytest.mark.real, pytest.mark.timeout(180)]


@pytest.fixture
def server(llama_server_bin: Path, real_model: Path) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([str(llama_server_bin), "--model", str(real_model), "--host", "127.0.0.1",
                             "--port", str(port), "--parallel", "1", "--ctx-size", "1024", "--threads", "2",
                             "--metrics"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120  # a bound for the failure only: the marker is /health 200
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield port
    finally:
        terminate(proc, 10.0)


async def test_a_confirming_round_sends_the_canary_where_an_ordinary_one_would_not(server: int) -> None:
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"http://127.0.0.1:{server}/completion",
                                   json={"prompt": "Once upon a time", "n_predict": 4}, timeout=120)
    assert answer.status_code == 200  # the one slot now holds this conversation
    probe = ServerProbe(f"http://127.0.0.1:{server}", timeout_s=10.0, canary_timeout_s=60.0)
    try:
        await probe.liveness()  # the first round: the completion above counts as traffic
        ordinary = await probe.liveness()
        assert ordinary.canary is CanaryOutcome.NOT_SENT and "holds a conversation" in ordinary.detail, ordinary
        confirming = await probe.liveness(confirm=True)
        assert confirming.canary is CanaryOutcome.OK, confirming
    finally:
        await probe.aclose()
