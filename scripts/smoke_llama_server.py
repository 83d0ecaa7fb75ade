"""Start a llama-server on a model, ask for one completion, and fail with the cause and the fix if it
does not answer (`scripts/get-real-components.sh` runs it after every build).

Usage: python smoke_llama_server.py LLAMA_SERVER MODEL.gguf   (exit 0: answered; 1: with the cause)

Standard library only: it runs in the build's own venv. A build made with GGML_NATIVE=ON can pass
`--version` and still die by SIGILL (or SIGSEGV at an AMX `ldtilecfg`) as soon as it computes.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import IO

DEADLINE_S = 120.0
FIX = ("rebuild it portable: rm -rf .work/real/venv and run scripts/get-real-components.sh "
       "(it builds with -DGGML_NATIVE=OFF); a server built elsewhere can also run with --no-repack")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(binary: str, model: str) -> int:
    with tempfile.TemporaryFile() as log:
        return run(binary, model, log)


def run(binary: str, model: str, log: IO[bytes]) -> int:
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "512", "-np", "1"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return died(proc.returncode, log)
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/completion",
                    data=json.dumps({"prompt": "Hello", "n_predict": 4}).encode(),
                    headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    body = json.load(resp)
                if body.get("tokens_predicted", 0) >= 1:
                    print(f"llama-server answered a completion ({body['tokens_predicted']} tokens)",
                          file=sys.stderr)
                    return 0
            except OSError:
                time.sleep(0.2)
                continue
        print(f"llama-server did not answer a completion within {DEADLINE_S:.0f} s", file=sys.stderr)
        return 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def died(returncode: int, log: IO[bytes]) -> int:
    log.seek(0)
    tail = log.read().decode(errors="replace").splitlines()[-5:]
    if returncode < 0:
        name = signal.Signals(-returncode).name
        cause = {"SIGILL": "an illegal instruction: it was built for CPU instructions this machine cannot run",
                 "SIGSEGV": "a segmentation fault as it computed (seen with AMX builds made with GGML_NATIVE=ON)",
                 }.get(name, f"signal {name}")
        print(f"llama-server died with {cause}; {FIX}", file=sys.stderr)
    else:
        print(f"llama-server exited with status {returncode} before answering", file=sys.stderr)
    print("its last lines:\n  " + "\n  ".join(tail), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
