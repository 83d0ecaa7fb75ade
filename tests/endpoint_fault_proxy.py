#!/usr/bin/env python3
"""A llama-server build with one broken endpoint: the real llama-server behind a small HTTP proxy that
answers 500 on the paths it is told to break, and passes everything else through unchanged — the way a
build regression shows (a backend rename after which ``/completion`` answers 500 while ``/health`` and
``/v1/chat/completions`` work). The double of an attack that put such a proxy in front of the real server.

Usage (as ``[server].binary``, through a small shell script that sets the environment)::

    ENDPOINT_FAULT_PATHS=/completion ENDPOINT_FAULT_AFTER=0 endpoint_fault_proxy.py REAL_LLAMA_SERVER ARGS...

* ``--version`` / ``--help``: the real build answers (exec).
* otherwise: the real build runs with ``ARGS`` on another loopback port; this process listens on the
  ``--host``/``--port`` of ``ARGS`` and forwards each request (answers are buffered, not streamed). A
  request to one of ``ENDPOINT_FAULT_PATHS`` (comma-separated, the path without its query) answers
  ``500`` with llama-server's error body once ``ENDPOINT_FAULT_AFTER`` requests to those paths passed.
  Until the real server listens, every request answers 503 (llama-server's answer while loading).
* SIGTERM/SIGINT go to the real server; this process exits as it does (its status, or its signal).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection", "te",
       "upgrade", "trailer"}


def _arg(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else default


def main() -> None:
    real, args = sys.argv[1], sys.argv[2:]
    if "--version" in args or "--help" in args:
        os.execv(real, [real, *args])
    host, port = _arg(args, "--host", "127.0.0.1"), int(_arg(args, "--port", "8080"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        inner = int(s.getsockname()[1])
    inner_args = list(args)
    if "--port" in inner_args:
        inner_args[inner_args.index("--port") + 1] = str(inner)
    else:
        inner_args += ["--port", str(inner)]
    if "--host" in inner_args:
        inner_args[inner_args.index("--host") + 1] = "127.0.0.1"
    paths = {p for p in os.environ.get("ENDPOINT_FAULT_PATHS", "").split(",") if p}
    after = int(os.environ.get("ENDPOINT_FAULT_AFTER", "0"))
    seen = [0]
    lock = threading.Lock()
    child = subprocess.Popen([real, *inner_args])

    def stop(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: object) -> None:
            return

        def _answer(self, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str, kind: str) -> None:
            body = json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()
            self._answer(status, body, [("Content-Type", "application/json; charset=utf-8")])

        def _any(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if self.path.split("?", 1)[0] in paths:
                with lock:
                    seen[0] += 1
                    broken = seen[0] > after
                if broken:
                    self._error(500, "the endpoint fault proxy answers 500 here", "server_error")
                    return
            conn = http.client.HTTPConnection("127.0.0.1", inner, timeout=600)
            try:
                conn.request(self.command, self.path, body=body or None,
                             headers={k: v for k, v in self.headers.items() if k.lower() not in HOP})
                resp = conn.getresponse()
                data = resp.read()
            except OSError:
                self._error(503, "Loading model", "unavailable_error")
                return
            finally:
                conn.close()
            self._answer(resp.status, data, [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP])

        do_GET = do_POST = do_PUT = do_DELETE = do_OPTIONS = _any

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = child.wait()
    server.server_close()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    main()
