"""``bench --compare OTHER`` with the REAL llama-server and model: two builds (or two configurations)
side by side, both servers up together, their runs alternating, both medians, the spreads and the
ratio printed. The real build against a copy of itself (the report's shape; the same speed: a ratio
near 1) and against itself forced to one thread (slower by design). The two speed verdicts run in the
serial lane: they need the host's cores quiet (on this shared 2-core host at load 12, one build
against itself measured eval ratios of 1.2 and 3.6 with 3-4 runs of 32 tokens).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import SERVER_THREADS, config_text, free_port, server_pids_of
from test_insight_e2e import cli
from test_upgrade_e2e import copy_build

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]


def config(tmp_path: Path, binary: Path, model: Path, threads: int = SERVER_THREADS) -> Path:
    path = tmp_path / "bench.toml"
    path.write_text(config_text({"server": {"binary": str(binary), "model": str(model), "port": free_port(),
                                            "n_gpu_layers": 0, "ctx_size": 1024, "threads": threads},
                                 "gpu": {"enabled": "off", "memory_bandwidth_gbs": 20.0},
                                 "runtime": {"dir": str(tmp_path / "run")}}))
    return path


def one_thread(tmp_path: Path, real: Path) -> Path:
    """The real build forced to one thread (``--threads 1`` whatever it is given): slower by design."""
    path = tmp_path / "one-thread" / "llama-server"
    path.parent.mkdir()
    path.write_text(f"#!{sys.executable}\nimport os, sys\nargs = sys.argv[1:]\n"
                    "for i, a in enumerate(args[:-1]):\n"
                    "    if a in ('-t', '--threads'):\n        args[i + 1] = '1'\n"
                    f"os.execv({str(real)!r}, [{str(real)!r}, *args])\n")
    path.chmod(0o755)
    return path


def compare(cfg: Path, other: Path, *extra: str, runs: int = 3) -> Any:
    out = cli("bench", "--runs", str(runs), "--tokens", "32", "--config", str(cfg), "--compare", str(other), *extra)
    assert out.returncode == 0, out.stderr
    assert server_pids_of(int(re.search(r"port = (\d+)", cfg.read_text())[1])) == []  # type: ignore[index]
    return out


def test_a_build_against_a_copy_of_itself_prints_both_and_the_ratio(tmp_path: Path, llama_server_bin: Path,
                                                                    real_model: Path) -> None:
    copy = copy_build(llama_server_bin, tmp_path / "copy")
    cfg = config(tmp_path, llama_server_bin, real_model)
    doc = json.loads(compare(cfg, copy, "--json").stdout)
    a, b = doc["results"]
    assert a["label"].startswith(f"{llama_server_bin} (v") or a["label"].startswith(f"{llama_server_bin} (b")
    assert b["label"].startswith(f"{copy} (")
    assert a["url"] != b["url"] and a["n"] == b["n"] == 3 and doc["interleaved"] is True
    assert doc["ratio_eval"] == pytest.approx(b["eval_tokens_per_s"]["median"] / a["eval_tokens_per_s"]["median"])
    for side in (a, b):
        assert set(side["eval_tokens_per_s"]) == {"median", "min", "max", "stdev"}
    text = compare(cfg, copy).stdout.splitlines()
    evals = [line for line in text if " tokens/s median (min " in line]
    assert len(evals) == 2 and evals[0].startswith(f"{llama_server_bin} (") and evals[1].startswith(f"{copy} (")
    assert re.fullmatch(rf"{re.escape(str(copy))} \(.+\) ÷ {re.escape(str(llama_server_bin))} \(.+\): eval "
                        r"\d+\.\d{3}×, prompt \d+\.\d{3}× \(3 rounds, interleaved A, B, A, B …\)", text[-1]), text


def test_an_unknown_other_is_a_clear_error(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    cfg = config(tmp_path, llama_server_bin, real_model)
    dies = tmp_path / "dies"
    dies.write_text("#!/bin/sh\nkill -SEGV $$\n")
    dies.chmod(0o755)
    out = cli("bench", "--config", str(cfg), "--compare", str(dies))
    assert out.returncode == 78 and f"{dies} --version died by SIGSEGV" in out.stderr, out.stderr
    out = cli("bench", "--config", str(cfg), "--compare", str(tmp_path / "missing.toml"))
    assert out.returncode == 78 and "config error" in out.stderr, out.stderr


@pytest.mark.parametrize(("name", "text", "said"), [
    ("llama-server", "#!/bin/sh\nexec true\n", "is a program but not executable (mode 0644)"),
    ("empty.toml", "", "is empty"),
    ("empty", "", "is empty"),
])
def test_an_other_neither_build_nor_configuration_exits_78_and_starts_nothing(
        tmp_path: Path, llama_server_bin: Path, real_model: Path, name: str, text: str, said: str) -> None:
    """Before: a file without the execute bit was parsed as a configuration, an empty one accepted as a
    configuration of defaults (and its server started)."""
    cfg = config(tmp_path, llama_server_bin, real_model)
    other = tmp_path / name
    other.write_text(text)
    other.chmod(0o644)
    out = cli("bench", "--config", str(cfg), "--compare", str(other))
    assert out.returncode == 78 and f"bench --compare: {other} {said}" in out.stderr, out.stderr
    assert "warm-up" not in out.stderr and out.stdout == ""
    assert server_pids_of(int(re.search(r"port = (\d+)", cfg.read_text())[1])) == []  # type: ignore[index]


def test_a_build_against_a_copy_of_itself_is_as_fast(tmp_path: Path, llama_server_bin: Path,
                                                     real_model: Path) -> None:
    cfg = config(tmp_path, llama_server_bin, real_model, threads=2)
    doc = json.loads(compare(cfg, copy_build(llama_server_bin, tmp_path / "copy"), "--json", runs=5).stdout)
    assert 2 / 3 < doc["ratio_eval"] < 3 / 2, doc  # the same build: near 1 (a loose bound)


def test_a_build_forced_to_one_thread_is_the_slower_side(tmp_path: Path, llama_server_bin: Path,
                                                        real_model: Path) -> None:
    cfg = config(tmp_path, llama_server_bin, real_model, threads=2)
    doc = json.loads(compare(cfg, one_thread(tmp_path, llama_server_bin), "--json", runs=5).stdout)
    assert doc["ratio_eval"] < 0.85, doc  # one thread against two: clearly slower


def test_a_server_already_on_the_configured_port_is_never_the_one_measured(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """A running daemon's llama-server on the configured port (here a stand-in that answers ``/health``
    200 and every completion 500): ``bench --compare`` starts both of its servers on free ports and
    measures them, never the one already there. Before: side A's server could not bind, the wait for
    ``/health`` got the stand-in's 200, and the bench measured it — a running server's figures as the
    configuration's, and load on the serving box."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked: list[str] = []

    class Serving(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def do_POST(self) -> None:
            asked.append(self.path)
            self.send_response(500)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    cfg = config(tmp_path, llama_server_bin, real_model)
    port = int(re.search(r"port = (\d+)", cfg.read_text())[1])  # type: ignore[index]
    squatter = ThreadingHTTPServer(("127.0.0.1", port), Serving)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        out = cli("bench", "--runs", "1", "--tokens", "8", "--config", str(cfg), "--compare",
                  str(copy_build(llama_server_bin, tmp_path / "copy")), "--json")
    finally:
        squatter.shutdown()
        squatter.server_close()
    assert out.returncode == 0, out.stderr
    assert asked == [], asked
    assert all(r["eval_tokens_per_s"]["median"] > 0 for r in json.loads(out.stdout)["results"])
