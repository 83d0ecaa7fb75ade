"""End to end (the real daemon, the test double for the crash and the hang on cue): the quarantine of
crashing requests blames no request for what the server did.

- A monitor that sends the same small prompt every second, in flight at two hangs it did not cause,
  is never refused (422), and the hangs still build the chain of identical failures that judges the
  server (the third is the verdict, exit 78).
- Variants of one poisoned prompt (another seed, other whitespace, another client id, the stream flag;
  and, of the same kind, the keys in another order, a route alias, a request id, 0.0 for 0) are one
  request: after the first is charged with its two crashes, every variant is refused without crashing
  a server, the daemon keeps serving, and innocent traffic in flight at the crashes gets 200.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_front_crash_e2e import POISON, metric, started

pytestmark = [pytest.mark.timeout(240)]


class Monitor:
    """A client that sends the same small completion every ``every_s`` seconds (each on its own
    thread, so that one that hangs does not stop the next) and keeps each answer's status."""

    def __init__(self, run: Any, every_s: float = 1.0, prompt: str = "ping") -> None:
        self._url = f"http://127.0.0.1:{run.front}/completion"
        self._every_s = every_s
        self._prompt = prompt
        self._pool = ThreadPoolExecutor(64)
        self._sent: list[tuple[float, Future[int | str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _one(self) -> int | str:
        try:
            return httpx.post(self._url, json={"prompt": self._prompt, "n_predict": 1}, timeout=120).status_code
        except httpx.HTTPError as exc:
            return type(exc).__name__

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sent.append((time.monotonic(), self._pool.submit(self._one)))
            self._stop.wait(self._every_s)

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def statuses(self, since: float = 0.0) -> list[int | str]:
        """The statuses of the requests sent from monotonic ``since`` on (waits for each)."""
        return [f.result() for t, f in list(self._sent) if t >= since]

    def count(self) -> int:
        return len(self._sent)


def wait_for(what: str, check: Any, timeout_s: float = 60.0) -> None:
    until = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < until, f"not seen within {timeout_s} s: {what}"
        time.sleep(0.1)


@pytest.fixture
def hangs(tmp_path: Path, fake_server: Path, real_model: Path) -> Iterator[Any]:
    """A daemon before the double whose completions hang while ``run.hang_file`` exists; hangs found
    within a few seconds; no confirmation wait for the chain of identical failures."""
    hang_file = tmp_path / "hang"
    with started(tmp_path, fake_server, real_model, {"FAKE_LLAMA_HANG_WHILE": str(hang_file)},
                 recovery={"stable_after_s": 120.0, "repeat_confirm_s": 0.0, "backoff_initial_s": 0.2},
                 health={"interval_s": 0.5, "hang_strikes": 2}) as run:
        run.hang_file = hang_file
        yield run


def test_a_monitor_in_flight_at_two_hangs_is_never_refused_and_the_hangs_still_chain(hangs: Any) -> None:
    run = hangs
    with Monitor(run) as monitor:
        wait_for("a first answer", lambda: monitor.count() >= 2)
        run.hang_file.touch()  # every completion hangs now, the monitor's included (a wedged decode)
        run.wait_event("server_hang", 90)
        run.wait_event("server_hang", 90, skip=1)  # the next server hung too, under the monitor's replay
        run.hang_file.unlink()
        run.wait_event("server_ready", 60, skip=2)
        healthy = time.monotonic()
        wait_for("five requests to the healthy server", lambda: len(monitor.statuses(healthy)) >= 5)
        after = monitor.statuses(healthy)
        during = monitor.statuses()
    assert 422 not in during, during
    assert after and all(status == 200 for status in after), after
    assert "front_request_refused" not in run.names()
    assert metric(run, "llama_guard_front_crash_refusals_total") == 0
    # The hangs were the server's: with a third the chain of identical failures is a verdict.
    run.hang_file.touch()
    threading.Thread(target=lambda: httpx.post(f"http://127.0.0.1:{run.front}/completion", timeout=120,
                                               json={"prompt": "ping", "n_predict": 1}), daemon=True).start()
    assert run.wait_exit(90) == 78
    verdict = run.wait_event("server_failure_repeated")
    assert verdict["consecutive_starts"] == 3, verdict


ISSUE_VARIANTS = [  # the attack's: a new seed, other whitespace, another client id, the stream flag
    ("/completion", {"prompt": f"{POISON} now", "n_predict": 1}),
    ("/completion", {"prompt": f"{POISON} now", "n_predict": 1, "seed": 1234}),
    ("/completion", {"prompt": f"  {POISON}\n\tnow ", "n_predict": 1}),
    ("/completion", {"prompt": f"{POISON} now", "n_predict": 1, "user": "client-2", "id": "req-99"}),
    ("/completion", {"prompt": f"{POISON} now", "n_predict": 1, "stream": True}),
]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{POISON} please"}]
UNSEEN_VARIANTS = [  # of the same kind, not shown: route aliases, key order, ids, 0.0 for 0
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "temperature": 0, "user": "alice"}),
    ("/chat/completions", {"user": "bob", "temperature": 0.0, "max_tokens": 1, "messages": CHAT}),
    ("/v1/chat/completions?client_id=7", {"messages": CHAT, "max_tokens": 1, "temperature": 0,
                                          "metadata": {"trace": "t-1"}, "request_id": "r-2"}),
    ("/v1/chat/completions", {"temperature": 0, "messages": CHAT, "max_tokens": 1, "stream": True,
                              "stream_options": {"include_usage": True}, "seed": 7}),
    ("/v1/chat/completions", {"messages": [{"content": "be brief", "role": "system"},
                                           {"content": f" {POISON}  please", "role": "user"}],
                              "max_tokens": 1, "temperature": 0}),
]


def post_raw(run: Any, target: str, body: dict[str, Any], *, indent: int | None = None) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{run.front}{target}", content=json.dumps(body, indent=indent).encode(),
                      headers={"Content-Type": "application/json"}, timeout=120)


@pytest.mark.parametrize("variants", [ISSUE_VARIANTS, UNSEEN_VARIANTS], ids=["issue", "unseen"])
def test_variants_of_a_poisoned_prompt_cost_two_crashes_in_all_and_innocents_get_200(
        tmp_path: Path, fake_server: Path, real_model: Path, variants: list[tuple[str, dict[str, Any]]]) -> None:
    # max_restarts at its default (7): before, each variant cost two crashes and the fourth ended the daemon.
    # The two crashes chain (the same abort line): without the charge, the start after the second would be
    # held back repeat_confirm_s (300 s), and the innocents held for it would get 503 after hold_timeout_s.
    with started(tmp_path, fake_server, real_model, {"FAKE_LLAMA_ABORT_PROMPT": POISON, "FAKE_LLAMA_DECODE_S": "0.5"},
                 recovery={"max_restarts": 7, "stable_after_s": 60.0, "repeat_confirm_s": 300.0}) as run:
        with Monitor(run, every_s=0.3, prompt="hello") as innocent:  # in flight at the crashes, same body each time
            first = post_raw(run, *variants[0])
            answers = [(target, post_raw(run, target, body, indent=2 if i % 2 else None))
                       for i, (target, body) in enumerate(variants[1:])]
            innocents = innocent.statuses()
        assert first.status_code == 422, first.text
        assert "in flight at two llama-server crashes" in first.json()["error"]["message"], first.text
        assert [answer.status_code for _, answer in answers] == [422] * len(answers), [
            (target, answer.status_code, answer.text) for target, answer in answers]
        others = [line for line in run.requests.read_text().splitlines()
                  if '"hello"' not in line and " POST /slots/" not in line]  # not the monitor's, nor a slot save
        assert len(others) == 2, others  # no variant reached a server after the first two
        names = run.names()
        assert names.count("server_exited") == 2 and names.count("front_request_refused") == 1, names
        assert "crash_loop" not in names and "daemon_exit" not in names and run.proc.poll() is None, names
        assert innocents and all(status == 200 for status in innocents), innocents
        assert httpx.post(f"http://127.0.0.1:{run.front}/completion", json={"prompt": "after", "n_predict": 1},
                          timeout=60).status_code == 200
