"""A pytest plugin loaded into llama.cpp's server test suite (``-p suite_plugin``): the suite runs
offline — its session fixture that downloads every preset's model (``ServerPreset.load_all``) does
nothing; the wrapper (``$LLAMA_SERVER_BIN_PATH``) starts every server on the local test model."""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    import utils  # the suite's own module (tools/server/tests/utils.py), on sys.path from its rootdir

    utils.ServerPreset.load_all = staticmethod(lambda: None)
