#!/usr/bin/env python3
"""A small test double of llama-server, for the faults a CPU cannot produce (CUDA OOM, GPU errors).

It accepts llama-server's argv (only ``--host`` and ``--port`` matter), prints real-format log
lines (docs/llama-server.md), serves ``/health``, ``/completion``, ``/v1/chat/completions``,
``/slots`` and ``/metrics``, and misbehaves on cue, chosen by ``$FAKE_LLAMA_FAULT``:

- ``oom_at_load``: the allocation failure block of a model that does not fit, then exit 1.
- ``oom_abort_at_load``: the CUDA OOM abort during context creation (seen on the H200), SIGABRT.
- ``oom_runtime``: ready, then on the first completion a CUDA OOM block and SIGABRT.
- ``cuda_error_hang``: ready, then on the first completion an illegal-memory-access block, after
  which the process stays alive, /health keeps answering 200 and completions hang.
- ``crash_first_request``: ready, then on the first completion an illegal-memory-access block and
  SIGABRT — on every start (a build regression on this GPU).
- ``gpu_unavailable``: the "no usable GPU" lines, then a normal (CPU) start.
- ``ignore_term``: ready, ignores SIGTERM (the supervisor must escalate to SIGKILL).
- ``ready_line_no_health``: prints "listening" but /health stays 503.
- ``busy_http``: ready, then for ``$FAKE_LLAMA_BUSY_S`` seconds (default 40) one big batch holds the
  HTTP loop (as reported for the ik_llama.cpp fork): ``/slots``, ``/metrics`` and completions wait
  until it ends, ``/health`` still answers, and a thread burns CPU the whole time.
- ``completion_hang``: ready, then every completion hangs without a line (a decode wedged in a
  kernel that never returns): /health answers 200, /slots and /metrics show the slot processing
  with counters that never move, and the process uses no CPU.
- ``completion_500``: ready, /health, /slots and /metrics answer, and every completion answers
  HTTP 500 with llama-server's error body (``{"error": {"code": 500, "message": ..., "type":
  "server_error"}}``), as a server whose compute fails per request does.
- ``wedged``: a wedged server (a reported router-child failure): ready, /health answers 200, /slots shows
  idle slots, /metrics answers, every completion answers HTTP 500 as ``completion_500`` does, and SIGTERM
  is ignored. With ``$FAKE_LLAMA_WEDGED_ONCE`` naming a file, only the server that creates that file is
  wedged; the later ones (the replacement) answer normally.
- ``ptx_unsupported``: ready, then every request prints the "provided PTX was compiled with an
  unsupported toolchain" abort block (as a CUDA binary on a too-old driver does) and aborts (SIGABRT).
- ``alloc_recovered``: at load the failed-allocation block of a pipeline-parallel compute buffer,
  llama.cpp's "retrying without pipeline parallelism", then a normal start.

- ``replay_request_abort``: ready, then on every completion it prints the lines of the file named by
  ``$FAKE_LLAMA_REPLAY`` (a report's log excerpt, tests/fixtures/public_reports/) and aborts (SIGABRT).
- ``replay_load_abort``: prints those lines while loading, then aborts.

``$FAKE_LLAMA_ABORT_PROMPT``: whatever the mode, a POST whose body holds this text (a prompt that
trips a crash, as reported for grammars, JSON schemas, chat templates and images) makes the server print
an abort line and die by SIGABRT after the decode delay (for a stream, after sending its headers first,
as llama-server does when it takes the request). ``$FAKE_LLAMA_DECODE_S`` (default 0): how long a
completion takes (so that other requests are in flight when it ends). Every POST is appended to the file
``$FAKE_LLAMA_REQUESTS`` names, as ``<pid> <method> <path> <first 60 bytes of the body>``.
``$FAKE_LLAMA_HEADERS_THEN_ABORT`` names a file that counts these deaths: while it counts fewer than
``$FAKE_LLAMA_HEADERS_THEN_ABORT_TIMES`` (default 1), a completion sends its status line and headers
(``Content-Length``, or a stream's) and dies by SIGABRT before its body — as a server does that crashes
in a stream's prefill, or whose other thread crashes between cpp-httplib's header and body writes; then
servers answer normally.

``$FAKE_LLAMA_HEADERS_THEN_SIGNAL`` (default ``ABRT``): the signal those deaths are by — ``KILL`` stands for a
kill -9 from outside (no crash a request causes). ``$FAKE_LLAMA_PING_FIRST`` (``1``): a stream sends an SSE
comment (``:``, llama-server's ping) right after its headers, also before such a death.

``$FAKE_LLAMA_SILENT_AFTER`` (a number N): a completion sends its headers (a stream's, or a whole answer's
``Content-Length``) and N events, then nothing more, ever (a decode wedged while the HTTP thread lives); with
``$FAKE_LLAMA_PING_S``, the silence is filled with SSE pings that often (as llama-server's
``--sse-ping-interval`` does). ``$FAKE_LLAMA_CUT_AFTER`` (a number N): a stream sends N events, then the
server dies by SIGKILL — once: the file ``$FAKE_LLAMA_CUT_MARK`` names counts it.

A ``/completion`` with ``"stream": true`` is answered as llama-server streams (Server-Sent Events, one HTTP
chunk per event, the headers first): ``n_predict`` events of one token each, ``$FAKE_LLAMA_EVENT_S``
(default 0.013 s) apart, then the final event with ``timings``; when ``$FAKE_LLAMA_STREAM_GATE`` names a
file, the second event waits until that file exists (a client can hold the first before the second is sent).
Then the connection is closed, as llama-server closes it after a streamed answer (``$FAKE_LLAMA_CLOSE_AFTER_S``
later, default 0: a test widens the moment in which a client could still send on it).

``$FAKE_LLAMA_OOM_WHILE`` names a file: while it exists, the server behaves as ``oom_at_load`` (a
test creates it when another process is made to hold the GPU's memory, and removes it with that).
``$FAKE_LLAMA_HANG_WHILE`` names a file: while it exists, every completion hangs as in ``completion_hang``
(once one has hung, the others do too, the file gone or not: a test makes the servers started meanwhile
hang, whatever request they get, and lets the next one be healthy).

``--version`` prints ``version: 4242 (fake0001)`` and a "built with" line, as llama.cpp does;
``--help`` prints a usage listing of the flags of :data:`HELP_FLAGS` (llama-server's spelling) and exits 0.
``$FAKE_LLAMA_LOAD_S`` delays readiness (default 0.2 s); ``$FAKE_LLAMA_LOAD_GATE`` names a file: /health
answers 503 ("Loading model") until it exists (a load, or a slot restore, that takes as long as a test wants).
``$FAKE_LLAMA_MARKS`` names a file to which
every printed line is appended as ``<pid> <time.time() just before the write> <line>`` (the wall-clock
emission time, for benchmarks/bench_supervision.py); the output itself is unchanged. Only the real llama-server is used
where it can produce the fault; this double stands in for what needs a GPU.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULT = os.environ.get("FAKE_LLAMA_FAULT", "")
_OOM_WHILE = os.environ.get("FAKE_LLAMA_OOM_WHILE", "")
if _OOM_WHILE and os.path.exists(_OOM_WHILE):
    FAULT = "oom_at_load"
LOAD_S = float(os.environ.get("FAKE_LLAMA_LOAD_S", "0.2"))
LOAD_GATE = os.environ.get("FAKE_LLAMA_LOAD_GATE", "")
MARKS = os.environ.get("FAKE_LLAMA_MARKS", "")
T0 = time.monotonic()
READY = threading.Event()
WEDGED = threading.Event()
BUSY_S = float(os.environ.get("FAKE_LLAMA_BUSY_S", "40"))
ABORT_PROMPT = os.environ.get("FAKE_LLAMA_ABORT_PROMPT", "").encode()
DECODE_S = float(os.environ.get("FAKE_LLAMA_DECODE_S", "0"))
REQUESTS = os.environ.get("FAKE_LLAMA_REQUESTS", "")
EVENT_S = float(os.environ.get("FAKE_LLAMA_EVENT_S", "0.013"))
STREAM_GATE = os.environ.get("FAKE_LLAMA_STREAM_GATE", "")
CLOSE_AFTER_S = float(os.environ.get("FAKE_LLAMA_CLOSE_AFTER_S", "0"))
HEADERS_THEN_ABORT = os.environ.get("FAKE_LLAMA_HEADERS_THEN_ABORT", "")
HANG_WHILE = os.environ.get("FAKE_LLAMA_HANG_WHILE", "")
HEADERS_THEN_ABORT_TIMES = int(os.environ.get("FAKE_LLAMA_HEADERS_THEN_ABORT_TIMES", "1"))
HEADERS_THEN_SIGNAL = getattr(signal, "SIG" + os.environ.get("FAKE_LLAMA_HEADERS_THEN_SIGNAL", "ABRT"))
PING_FIRST = os.environ.get("FAKE_LLAMA_PING_FIRST", "") == "1"
SILENT_AFTER = int(os.environ.get("FAKE_LLAMA_SILENT_AFTER", "-1"))
PING_S = float(os.environ.get("FAKE_LLAMA_PING_S") or "0")
CUT_AFTER = int(os.environ.get("FAKE_LLAMA_CUT_AFTER", "-1"))
CUT_MARK = os.environ.get("FAKE_LLAMA_CUT_MARK", "")
BUSY_UNTIL = [0.0]  # monotonic end of the busy batch (busy_http)
LOCK = threading.Lock()
COUNTERS = {"n_decode_total": 0, "tokens_predicted_total": 0}
# The one slot as /slots shows it: no "id_task" until a request ran; then the last request's params.
SLOT: dict[str, object] = {"id": 0, "n_ctx": 2048}
COMPLETION_ERROR = "llama_decode failed: compute error (fake)"
WEDGED_ONCE = os.environ.get("FAKE_LLAMA_WEDGED_ONCE", "")


def wedged_now() -> bool:
    """Whether this server is the wedged one (``wedged``; with ``$FAKE_LLAMA_WEDGED_ONCE``, only the first)."""
    if FAULT != "wedged":
        return False
    if not WEDGED_ONCE:
        return True
    try:
        os.close(os.open(WEDGED_ONCE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True


COMPUTE_FAILS = FAULT == "completion_500"  # every completion answers 500 (set at start for ``wedged``)


def mark(text: str, when: float) -> None:
    """Note that ``text`` was written at wall-clock ``when`` (``$FAKE_LLAMA_MARKS``)."""
    if MARKS:
        with open(MARKS, "a", encoding="utf-8") as f:
            f.writelines(f"{os.getpid()} {when:.6f} {line}\n" for line in text.split("\n"))


def log(level: str, comp: str, text: str) -> None:
    ms = int((time.monotonic() - T0) * 1000)
    stamp = f"{ms // 3600000}.{ms // 60000 % 60:02d}.{ms // 1000 % 60:02d}.{ms % 1000:03d}"
    line = f"{stamp} {level} {comp} {text}"
    when = time.time()
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    mark(line, when)


def raw(text: str) -> None:
    when = time.time()
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    mark(text, when)


def cuda_block(message: str) -> None:
    log("E", "", f"CUDA error: {message}")
    log("E", "", "  current device: 0, in function ggml_cuda_mul_mat at /src/ggml/src/ggml-cuda/ggml-cuda.cu:1432")
    log("E", "", "  cublasGemmEx(ctx.cublas_handle(id), CUBLAS_OP_T, CUBLAS_OP_N, ...)")
    raw("/src/ggml/src/ggml-cuda/ggml-cuda.cu:96: CUDA error")
    raw("[New LWP 4242]\n#0  0x00007f2a in __GI___wait4 () at ../sysdeps/unix/sysv/linux/wait4.c:30")


def replay_and_abort() -> None:
    """Print ``$FAKE_LLAMA_REPLAY``'s lines as the server's own output, then abort (SIGABRT)."""
    with open(os.environ["FAKE_LLAMA_REPLAY"], encoding="utf-8") as f:
        for line in f.read().splitlines():
            raw(line)
    os.kill(os.getpid(), signal.SIGABRT)


def burn_cpu(until: float) -> None:
    """Spin (CPU time) until monotonic ``until``, as a prompt batch does."""
    x = 0
    while time.monotonic() < until:
        x = (x * 31 + 7) % 1000003


def deaths_so_far() -> int:
    """How many servers died after their headers ($FAKE_LLAMA_HEADERS_THEN_ABORT's lines)."""
    try:
        with open(HEADERS_THEN_ABORT, encoding="utf-8") as f:
            return len(f.read().splitlines())
    except FileNotFoundError:
        return 0


def wait_busy() -> None:
    """While the busy batch runs, the HTTP loop's other endpoints wait for it (busy_http)."""
    while time.monotonic() < BUSY_UNTIL[0]:
        time.sleep(0.05)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:  # keep stdout for "llama-server" lines
        return

    def reply(self, code: int, body: object) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def stream(self, tokens: int, timings: dict[str, float]) -> None:
        """``tokens`` SSE events of one token each, as llama-server's streamed ``/completion`` sends them
        (the headers at once, then one HTTP chunk per event, TCP_NODELAY): each event ``$FAKE_LLAMA_EVENT_S``
        after the one before (the first after the headers) — but when ``$FAKE_LLAMA_STREAM_GATE`` names a
        file, the second not before that file exists; then the final event with ``timings``."""
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.stream_headers()
        events = [{"content": "x", "stop": False, "tokens_predicted": i + 1} for i in range(tokens)]
        events.append({"content": "", "stop": True, "timings": {**timings, "predicted_n": tokens}})
        cut = CUT_AFTER >= 0 and not os.path.exists(CUT_MARK)
        for i, event in enumerate(events):
            if i == SILENT_AFTER:
                self.silence()
            if cut and i == CUT_AFTER:
                with open(CUT_MARK, "a", encoding="utf-8") as f:
                    f.write(f"{os.getpid()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
            if i == 1 and STREAM_GATE:
                while not os.path.exists(STREAM_GATE):
                    time.sleep(0.01)
            else:
                time.sleep(EVENT_S)
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.write(b"0\r\n\r\n")
        time.sleep(CLOSE_AFTER_S)
        self.close_connection = True  # as llama-server does after a streamed answer (its Keep-Alive header aside)

    def stream_headers(self) -> None:
        """A stream's status line and headers (and a ping, with ``$FAKE_LLAMA_PING_FIRST``)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if PING_FIRST:
            self.wfile.write(b"3\r\n:\n\n\r\n")
        self.wfile.flush()

    def silence(self) -> None:
        """Send nothing more, ever — but a ping each ``$FAKE_LLAMA_PING_S`` (a chunked stream only)."""
        while True:
            time.sleep(PING_S or 3600)
            if PING_S:
                self.wfile.write(b"3\r\n:\n\n\r\n")
                self.wfile.flush()

    def do_GET(self) -> None:
        if self.path != "/health":
            wait_busy()
        if self.path == "/health":
            if READY.is_set():
                self.reply(200, {"status": "ok"})
            else:
                self.reply(503, {"error": {"code": 503, "message": "Loading model"}})
        elif self.path == "/slots":
            with LOCK:
                slot = {**SLOT, "is_processing": WEDGED.is_set()}
            if WEDGED.is_set():
                slot["next_token"] = [{"has_next_token": True, "n_decoded": 3}]
            self.reply(200, [slot])
        elif self.path == "/metrics":
            with LOCK:
                text = "".join(f"llamacpp:{k} {v}\n" for k, v in COUNTERS.items())
                text += f"llamacpp:requests_processing {int(WEDGED.is_set())}\nllamacpp:requests_deferred 0\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text.encode())
        else:
            self.reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(length)
        if REQUESTS:
            with LOCK, open(REQUESTS, "a", encoding="utf-8") as f:
                f.write(f"{os.getpid()} POST {self.path} {data[:60].decode(errors='replace')}\n")
        try:
            body = json.loads(data or b"{}")
        except ValueError:
            body = {}
        wait_busy()
        if self.path.startswith("/slots/"):  # as llama-server started without --slot-save-path answers
            self.reply(501, {"error": {"code": 501, "message": "This server does not support slots action.",
                                       "type": "not_supported_error"}})
            return
        if ABORT_PROMPT and ABORT_PROMPT in data:
            if body.get("stream"):  # llama-server sends a stream's headers when it takes the request
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
            time.sleep(DECODE_S)
            log("I", "slot", "launch_slot_: id  0 | task 1 | processing task, is_child = 0")
            raw("/src/common/json-schema-to-grammar.cpp:42: GGML_ASSERT(!rule.empty()) failed")
            os.kill(os.getpid(), signal.SIGABRT)
            return
        time.sleep(DECODE_S)
        if HEADERS_THEN_ABORT and deaths_so_far() < HEADERS_THEN_ABORT_TIMES:
            with open(HEADERS_THEN_ABORT, "a", encoding="utf-8") as f:
                f.write(f"{os.getpid()}\n")
            if body.get("stream"):
                self.stream_headers()
            else:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "227")
                self.end_headers()
                self.wfile.flush()
            if HEADERS_THEN_SIGNAL == signal.SIGABRT:
                raw("/src/ggml/src/ggml-cuda/ggml-cuda.cu:97: CUDA error")
            os.kill(os.getpid(), HEADERS_THEN_SIGNAL)
            return
        if SILENT_AFTER == 0 and not body.get("stream"):  # a whole answer's headers, then no byte of it
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "227")
            self.end_headers()
            self.wfile.flush()
            self.silence()
        if FAULT == "replay_request_abort":
            replay_and_abort()
            return
        if COMPUTE_FAILS:
            log("E", "srv ", f"   send_error: task id = 1, error: {COMPLETION_ERROR}")
            self.reply(500, {"error": {"code": 500, "message": COMPLETION_ERROR, "type": "server_error"}})
            return
        with LOCK:  # the slot now holds this request's prompt
            SLOT.update({"id_task": int(SLOT.get("id_task", -1)) + 1,  # type: ignore[call-overload]
                         "n_prompt_tokens": 4,
                         "params": {"seed": body.get("seed", 4294967295), "n_predict": body.get("n_predict", -1)}})
        if FAULT == "ptx_unsupported":
            raw("/src/ggml/src/ggml-cuda/ggml-cuda.cu:97: CUDA error\nggml_cuda_compute_forward: SCALE failed\n"
                "CUDA error: the provided PTX was compiled with an unsupported toolchain.")
            os.kill(os.getpid(), signal.SIGABRT)
            return
        if FAULT == "crash_first_request":
            log("I", "slot", "launch_slot_: id  0 | task 1 | processing task, is_child = 0")
            cuda_block("an illegal memory access was encountered")
            os.kill(os.getpid(), signal.SIGABRT)
            return
        if FAULT == "oom_runtime":
            log("I", "slot", "launch_slot_: id  0 | task 1 | processing task, is_child = 0")
            cuda_block("out of memory")
            os.kill(os.getpid(), signal.SIGABRT)
            return
        if FAULT == "completion_hang" or (HANG_WHILE and os.path.exists(HANG_WHILE)):
            WEDGED.set()
            time.sleep(3600)
            return
        if FAULT == "cuda_error_hang" or WEDGED.is_set():
            if not WEDGED.is_set():
                WEDGED.set()
                cuda_block("an illegal memory access was encountered")
            time.sleep(3600)
            return
        with LOCK:
            COUNTERS["n_decode_total"] += 2
            COUNTERS["tokens_predicted_total"] += 1
        timings = {"prompt_n": 4, "prompt_ms": 1.0, "prompt_per_second": 4000.0,
                   "predicted_n": 1, "predicted_ms": 1.0, "predicted_per_second": 1000.0}
        if body.get("stream"):
            self.stream(int(body.get("n_predict", 1)), timings)
            return
        self.reply(200, {"content": "x", "choices": [{"message": {"role": "assistant", "content": "x"}}],
                         "timings": timings})


# The flags this double's --help lists (it accepts any argv; only --host and --port matter).
HELP_FLAGS = ("-h, --help", "--version", "-t, --threads N", "-tb, --threads-batch N", "-c, --ctx-size N",
              "-b, --batch-size N", "-ub, --ubatch-size N", "-fa, --flash-attn [on|off|auto]", "--mlock",
              "-ctk, --cache-type-k TYPE", "-ctv, --cache-type-v TYPE", "-ngl, --gpu-layers, --n-gpu-layers N",
              "-m, --model FNAME", "--host HOST", "--port PORT", "-np, --parallel N", "--metrics",
              "--api-key-file FNAME", "--slot-save-path PATH", "-cram, --cache-ram N", "--slots, --no-slots")


def main(argv: list[str]) -> int:
    if "--version" in argv:
        raw("version: 4242 (fake0001)\nbuilt with GNU 12.2.0 for Linux x86_64")
        return 0
    if "--help" in argv:
        sys.stdout.write("----- common params -----\n\n" + "".join(f"{flag}\n" for flag in HELP_FLAGS))
        return 0
    host, port = "127.0.0.1", 8080
    for i, word in enumerate(argv):
        if word == "--host":
            host = argv[i + 1]
        elif word == "--port":
            port = int(argv[i + 1])
    global COMPUTE_FAILS
    if wedged_now():
        COMPUTE_FAILS = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if FAULT == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log("I", "srv ", "llama_server: initializing ...")
    if FAULT == "gpu_unavailable":
        log("E", "", "ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected")
        raw("warning: no usable GPU found, --gpu-layers option will be ignored")
    log("I", "srv ", "  load_model: loading model 'fake.gguf'")
    if FAULT == "oom_at_load":
        log("E", "", "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9216.00 MiB on device 0: "
                     "cudaMalloc failed: out of memory")
        log("E", "", "alloc_tensor_range: failed to allocate CUDA0 buffer of size 9663676416")
        log("E", "", "llama_model_load: error loading model: unable to allocate CUDA0 buffer")
        log("E", "srv ", "llama_server: exiting due to model loading error")
        return 1
    if FAULT == "alloc_recovered":
        log("E", "", "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 51748.72 MiB on device 1: "
                     "cudaMalloc failed: out of memory")
        log("E", "", "ggml_gallocr_reserve_n_impl: failed to allocate CUDA1 buffer of size 54262464512")
        log("E", "", "graph_reserve: failed to allocate compute buffers")
        log("W", "", "sched_reserve: compute buffer allocation failed, retrying without pipeline parallelism")
        log("I", "srv ", "  load_model: initializing, n_slots = 1, n_ctx_slot = 50176, kv_unified = 'false'")
    if FAULT == "replay_load_abort":
        time.sleep(LOAD_S)
        replay_and_abort()
        return 134
    if FAULT == "oom_abort_at_load":
        time.sleep(LOAD_S)
        log("E", "", "CUDA error: out of memory")
        log("E", "", "  current device: 0, in function stream at /src/ggml/src/ggml-cuda/common.cuh:1080")
        raw("/src/ggml/src/ggml-cuda/ggml-cuda.cu:96: CUDA error")
        os.kill(os.getpid(), signal.SIGABRT)
        return 134
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(LOAD_S)
    while LOAD_GATE and not os.path.exists(LOAD_GATE):
        time.sleep(0.05)
    log("I", "srv ", "llama_server: model loaded")
    log("I", "srv ", f"llama_server: listening on http://{host}:{port}")
    if FAULT != "ready_line_no_health":
        READY.set()
    if FAULT == "busy_http":
        BUSY_UNTIL[0] = time.monotonic() + BUSY_S
        log("I", "slot", "launch_slot_: id  0 | task 0 | processing task (one batch holds the HTTP loop)")
        threading.Thread(target=burn_cpu, args=(BUSY_UNTIL[0],), daemon=True).start()
    while True:  # SIGTERM (default action) ends the process, as it does llama-server's HTTP loop
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
