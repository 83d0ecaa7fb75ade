"""What a build's ``--version`` prints reaches events, ``status`` and ``/metrics`` clean and bounded, from
one reader (host/build.py): ANSI escapes, carriage returns, NUL and other control characters, bidi
overrides removed; the text capped at VERSION_SHOWN_MAX characters. Before: the preflight's reader kept
them all, and a second reader (config/argv.py ``build_of``, for the verdicts that name the build) kept
them too."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from llama_guard.config.server import ServerConfig
from llama_guard.core.facts import read_build
from llama_guard.core.offload import Lane, LaneKind
from llama_guard.host.build import VERSION_SHOWN_MAX, identify, version_line

NASTY = {
    "ansi": (r"\033[1;31mversion: 4242 (abc1234)\033[0m\n\033]0;owned\007built with cc\n",
             "version: 4242 (abc1234); built with cc", "b4242 (abc1234)"),
    "carriage return": (r"version: 4242 (abc1234)\rversion: 9999 (fffffff)\n",
                        "version: 4242 (abc1234); version: 9999 (fffffff)", "b4242 (abc1234)"),
    "nul and bell": (r"ver\000sion: 1.2.3\007\010\n", "version: 1.2.3", "v1.2.3"),
    "bidi override": (r"version: 1.0.0 \342\200\256lamrof\n", "version: 1.0.0 lamrof", "v1.0.0"),
    # string sequences: the payload goes with the escape (DCS: a sixel; APC; OSC ended by ST)
    "dcs": (r"version: 1.0.0\033Pq#0;2;0;0;0#1~~-rm -rf\033\\ built\n", "version: 1.0.0 built", "v1.0.0"),
    "apc and osc": (r"version: 2.0.0\033_payload\033\\\033]8;;http://x\033\\ ok\n", "version: 2.0.0 ok", "v2.0.0"),
    # the C1 forms (U+0090 DCS, U+009B CSI, U+009C ST, in UTF-8)
    "c1": (r"version: 3.0.0\302\220payload\302\234 \302\2331;31mred\n", "version: 3.0.0 red", "v3.0.0"),
}


def _build(tmp_path: Path, printed: str) -> Path:
    path = tmp_path / "llama-server"
    path.write_text(f"#!/bin/sh\nprintf '{printed}'\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("kind", list(NASTY))
def test_version_text_is_cleaned_at_its_one_reader(tmp_path: Path, kind: str) -> None:
    printed, shown, release = NASTY[kind]
    binary = _build(tmp_path, printed)
    build, cause = identify(binary)
    assert cause == "" and build is not None
    assert (build.version, build.release) == (shown, release)
    assert version_line(binary) == shown
    server = ServerConfig(binary=str(binary), model=tmp_path / "m.gguf")
    info = asyncio.run(read_build(server, Lane(LaneKind.PROBE)))  # the verdicts' reader: the same text
    assert info.text == shown


def test_a_long_version_text_is_capped(tmp_path: Path) -> None:
    binary = _build(tmp_path, "version: 1.2.3 " + "x" * 5000 + r"\n")
    build, _ = identify(binary)
    assert build is not None and len(build.version) == VERSION_SHOWN_MAX + 1 and build.version.endswith("…")
    assert version_line(binary) == build.version and build.release == "v1.2.3"


def test_a_failing_version_names_the_cause_cleanly(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nprintf 'error: \\033[31mlibcuda.so.1\\000 missing\\033[0m\\n' >&2\nexit 127\n")
    binary.chmod(0o755)
    build, cause = identify(binary)
    assert build is None and cause == f"{binary} --version exited with status 127: error: libcuda.so.1 missing"
