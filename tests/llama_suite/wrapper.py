"""What llama.cpp's server test suite starts as "llama-server" (its ``LLAMA_SERVER_BIN_PATH``), in one of
two modes (``$LLAMA_SUITE_MODE``):

- ``bare``: the real llama-server (``$LLAMA_SERVER_BIN``) with the suite's flags;
- ``guarded``: ``llama-guard run`` on a configuration written from the same flags: the suite's
  ``--host``/``--port`` become ``[front].listen`` (every address, one port), llama-server moves to a free
  private port, the flags llama-guard types (``--ctx-size``, ``--parallel`` ...) become ``[server]`` keys —
  at llama-server's own defaults where the suite gives none — ``--api-key K`` becomes
  ``[server].api_key_file``, every other flag goes to ``extra_args`` verbatim.

In both modes the suite's model, which it would download (``--hf-repo``/``--hf-file``/``--model-url``),
is the offline test model ``$LLAMA_GUARD_TEST_MODEL``. A start without a model (llama-server's router
mode, which llama-guard cannot run) exits 2 in both modes: those tests are excluded, with the reason.
Execs the server or the daemon, so that the suite's SIGTERM reaches it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

DOWNLOADS = {"--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model-url", "-mu"}
# llama-guard's typed [server] keys: flag -> (key, conversion)
TYPED = {"--ctx-size": "ctx_size", "-c": "ctx_size", "--parallel": "parallel", "-np": "parallel",
         "--batch-size": "batch_size", "-b": "batch_size", "--ubatch-size": "ubatch_size", "-ub": "ubatch_size",
         "--threads": "threads", "-t": "threads", "--n-gpu-layers": "n_gpu_layers", "-ngl": "n_gpu_layers",
         "-ctk": "cache_type_k", "--cache-type-k": "cache_type_k", "-ctv": "cache_type_v",
         "--cache-type-v": "cache_type_v", "-fa": "flash_attn", "--flash-attn": "flash_attn"}
INTS = {"ctx_size", "parallel", "batch_size", "ubatch_size", "threads", "n_gpu_layers"}
# llama-server's defaults (common/common.h; tools/server/server.cpp: parallel -1 = auto = 4, unified KV)
DEFAULTS: dict[str, object] = {"ctx_size": 0, "batch_size": 2048, "ubatch_size": 512, "n_gpu_layers": 0,
                               "cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": "auto",
                               "threads": os.cpu_count() or 1}


def split(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The suite's flags: ``({flag: value} of the flags with a value we read, the others in order)``."""
    valued = {"--host", "--port", "--model", "-m", "--api-key", *DOWNLOADS, *TYPED}
    known: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in valued and i + 1 < len(argv):
            known[arg] = argv[i + 1]
            i += 2
            continue
        rest.append(arg)
        i += 1
    return known, rest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def toml(sections: dict[str, dict[str, object]]) -> str:
    lines = []
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    known, rest = split(argv)
    model = os.environ["LLAMA_GUARD_TEST_MODEL"]
    if not any(flag in known for flag in ("--model", "-m", *DOWNLOADS)):
        sys.exit("llama-server's router mode (no model): llama-guard cannot run it")
    mode = os.environ["LLAMA_SUITE_MODE"]
    hosts = [h.strip() for h in known.get("--host", "127.0.0.1").split(",") if h.strip()]
    port = known.get("--port", "8080")
    if mode == "bare":
        server = [os.environ["LLAMA_SERVER_BIN"], "--model", model, "--host", ",".join(hosts), "--port", port]
        server += [item for flag, value in known.items() if flag in TYPED or flag == "--api-key"
                   for item in (flag, value)]
        os.execv(server[0], [*server, *rest])
    work = Path(tempfile.mkdtemp(prefix="llama-guard-", dir=os.environ.get("LLAMA_SUITE_TMP")))
    keys: dict[str, object] = {**DEFAULTS, "parallel": 4}
    extra = list(rest)
    if not any(flag in known for flag in ("--parallel", "-np")) and "--kv-unified" not in extra:
        extra.append("--kv-unified")  # llama-server's auto parallel: 4 slots on one unified KV cache
    for flag, key in TYPED.items():
        if flag in known:
            keys[key] = int(known[flag]) if key in INTS else known[flag]
    keys["ubatch_size"] = min(int(str(keys["ubatch_size"])), int(str(keys["batch_size"])))  # as llama-server clamps
    server: dict[str, object] = {"binary": os.environ["LLAMA_SERVER_BIN"], "model": model, "port": free_port(),
                                 **keys, "extra_args": extra}
    if "--api-key" in known:
        key_file = work / "api-key"
        key_file.write_text(known["--api-key"] + "\n")
        server["api_key_file"] = str(key_file)
    listen = ",".join(f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts)
    config = work / "llama-guard.toml"
    config.write_text(toml({
        "server": server,
        "front": {"listen": listen, "stop_drain_s": 0.0},
        "gpu": {"enabled": "off"},
        "schedule": {"restart_cron": ""},
        "runtime": {"dir": str(work / "run")},
        "slots": {"dir": str(work / "slots")},
        "log": {"format": "json"},
    }))
    daemon = [os.environ["LLAMA_SUITE_PYTHON"], "-m", "llama_guard", "run", "--config", str(config)]
    # LLAMA_GUARD_* names are configuration overrides to the daemon: none of the test run's may reach it
    os.execve(daemon[0], daemon, {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")})


if __name__ == "__main__":
    main(sys.argv[1:])
