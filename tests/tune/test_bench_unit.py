"""bench's pieces without a server: the summary, the progress bar (a terminal only), the report lines,
a refused connection, and the CPU wording of the ceiling."""

from __future__ import annotations

import io
from typing import Any

import pytest
from harness import free_port
from llama_guard.insight.ceiling import Ceiling
from llama_guard.tune.bench import BenchError, BenchResult, Progress, RunTimings, Spread, describe, run_bench


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_spread_is_median_min_max_and_population_sd() -> None:
    s = Spread.of([10.0, 30.0, 20.0, 40.0])
    assert (s.median, s.min, s.max) == (25.0, 10.0, 40.0)
    assert s.stdev == pytest.approx(11.1803, abs=1e-4)


def test_progress_bar_only_on_a_terminal() -> None:
    pipe, tty = io.StringIO(), Tty()
    for stream in (pipe, tty):
        bar = Progress(4, "x ", stream=stream, width=8)
        bar.update(2, "650.0 tokens/s")
        bar.close()
    assert pipe.getvalue() == ""
    assert "\rx [####....] 2/4 650.0 tokens/s" in tty.getvalue() and tty.getvalue().endswith("\n")


def test_report_lines_and_context() -> None:
    runs = [RunTimings(256, v, 40, 400.0 + v) for v in (600.0, 650.0, 640.0)]
    r = BenchResult(url="http://x", runs=runs, tokens=256, label="a.toml",
                    ceiling={"verdict": "ceiling 49,000 tokens/s ..."})
    assert r.context == 296 and r.eval.median == 640.0
    lines = describe(r)
    assert lines[0].startswith("a.toml: eval 640.0 tokens/s median (min 600.0, max 650.0")
    assert "3 runs × 256 tokens, context 296" in lines[0] and lines[1] == "  ceiling 49,000 tokens/s ..."
    assert r.as_dict()["eval_tokens_per_s"]["median"] == 640.0


def test_a_refused_connection_is_a_bench_error() -> None:
    with pytest.raises(BenchError, match="completion failed"):
        run_bench(f"http://127.0.0.1:{free_port()}", runs=1, tokens=1, timeout_s=2, warmup=False)
    with pytest.raises(BenchError, match="at least 1"):
        run_bench("http://127.0.0.1:1", runs=0)


def test_cpu_ceiling_names_compute() -> None:
    c = Ceiling(bandwidth=20e9, source="stated", weights_read=97_000_000, kv_read=0, context=100, measured=6.0,
                on_gpu=False)
    assert "CPU's arithmetic binds" in c.verdict() and c.as_dict()["binding_limit"] == "CPU compute"


def test_compared_servers_take_their_runs_in_turn() -> None:
    """``run_interleaved``: one warm-up on each, then A, B, A, B … (two small HTTP servers here answer
    as llama-server does and note the order of the requests they get)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from llama_guard.tune.bench import Target, run_interleaved

    order: list[str] = []

    def server(name: str, speed: float) -> ThreadingHTTPServer:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                order.append(name)
                body = json.dumps({"timings": {"predicted_n": 4, "predicted_per_second": speed + len(order),
                                               "prompt_n": 9, "prompt_per_second": 100.0}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                return None

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return httpd

    a, b = server("A", 100.0), server("B", 50.0)
    try:
        results = run_interleaved([Target(f"http://127.0.0.1:{s.server_address[1]}") for s in (a, b)],
                                  runs=3, tokens=4, timeout_s=10)
    finally:
        a.shutdown()
        b.shutdown()
    assert order == ["A", "B"] * 4  # the warm-ups, then three rounds
    assert [r.predicted_per_second for r in results[0].runs] == [103.0, 105.0, 107.0]
    assert [r.predicted_per_second for r in results[1].runs] == [54.0, 56.0, 58.0]


def _answering(answers: dict[str, tuple[int, bytes]]) -> object:
    """A small HTTP server that answers each path of ``answers`` with its (status, body)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = answers[self.path]
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            return None

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.mark.parametrize(("body", "named"), [
    (b'{"choices": []}', 'POST /v1/chat/completions answered without "timings"'),
    (b'{"timings": {"predicted_n": 4, "prompt_n": 9, "prompt_per_second": 1.0}}',
     'POST /v1/chat/completions answered "timings" without predicted_per_second'),
    (b'{"timings": {"predicted_n": 4, "predicted_per_second": null, "prompt_n": 9, "prompt_per_second": 1}}',
     '"timings" that are not numbers'),
    (b'["timings"]', 'answered without "timings"'),
    (b"<html>proxy</html>", "answered no JSON"),
])
def test_an_answer_without_its_timings_names_what_is_missing_and_where(body: bytes, named: str) -> None:
    """Before: ``completion failed: KeyError('timings')`` (the trial's cause text in the upgrade event)."""
    import re

    from llama_guard.tune.bench import decode_speed

    httpd: Any = _answering({"/v1/chat/completions": (200, body), "/completion": (200, b"{}")})
    try:
        with pytest.raises(BenchError, match=re.escape(named)) as caught:
            decode_speed(f"http://127.0.0.1:{httpd.server_address[1]}", "", 1, 1, 10.0)
    finally:
        httpd.shutdown()
    assert "KeyError" not in str(caught.value) and "TypeError" not in str(caught.value)


@pytest.mark.parametrize("status", [500, 404])
def test_the_trial_measurement_fails_when_the_native_completion_does_not_answer_2xx(status: int) -> None:
    """A build whose ``/completion`` answers 500 while the chat endpoint works: the trial's figure is an
    error naming the endpoint and the status (before: the chat figure alone, and the build was kept)."""
    from llama_guard.tune.bench import decode_speed

    chat = b'{"timings": {"predicted_n": 4, "predicted_per_second": 9.0, "prompt_n": 9, "prompt_per_second": 1}}'
    httpd: Any = _answering({"/v1/chat/completions": (200, chat), "/completion": (status, b'{"error": "x"}')})
    try:
        with pytest.raises(BenchError, match=f"POST /completion answered HTTP {status}"):
            decode_speed(f"http://127.0.0.1:{httpd.server_address[1]}", "", 1, 1, 10.0)
    finally:
        httpd.shutdown()
    ok: Any = _answering({"/v1/chat/completions": (200, chat), "/completion": (200, b"{}")})
    try:
        assert decode_speed(f"http://127.0.0.1:{ok.server_address[1]}", "", 1, 1, 10.0) == 9.0
    finally:
        ok.shutdown()


def test_a_cancelled_measurement_cuts_its_request_under_way_and_sends_no_more() -> None:
    """The daemon's stop in a trial sets the measurement's Cancel: the request under way fails at once
    (its connection closed: llama-server stops that task) and none follows."""
    import socket
    import threading

    from llama_guard.core.client import Cancel
    from llama_guard.tune.bench import decode_speed

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    asked, closed = threading.Event(), threading.Event()

    def never_answer() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        asked.set()
        if conn.recv(65536) == b"":  # the client closed it
            closed.set()
        conn.close()
    threading.Thread(target=never_answer, daemon=True).start()
    cancel, raised = Cancel(), []

    def measure() -> None:
        try:
            decode_speed(f"http://127.0.0.1:{listener.getsockname()[1]}", "", 1, 1, 600.0, cancel)
        except BenchError as exc:
            raised.append(str(exc))
    worker = threading.Thread(target=measure)
    worker.start()
    assert asked.wait(60)
    cancel.set()
    worker.join(60)
    assert raised == ["POST /completion failed: POST /completion: cancelled"]
    assert closed.wait(60)
    listener.close()
    with pytest.raises(BenchError, match="cancelled"):  # a later measurement with it sends nothing
        decode_speed("http://127.0.0.1:1", "", 1, 1, 600.0, cancel)
