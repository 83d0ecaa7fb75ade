"""One rule for a test whose precondition is missing on this host: skip locally, fail under ``CI=true``.

CI must never turn a missing real component (a binary, root, a kernel setting) into a silent skip.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def unavailable(why: str) -> NoReturn:
    """Skip the test with ``why`` — or fail it when ``CI=true``."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why + " (CI=true: a missing precondition fails the run)")
    pytest.skip(why)
