"""One rule for a test whose precondition is missing on this host: skip locally, fail under ``CI=true``.

CI must never turn a missing real component (a binary, root, a kernel setting) into a silent skip.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

#: Every host program the test suite runs, and the Debian/Ubuntu package that ships it. The README's
#: prerequisite line and ``.ci/run`` install exactly these packages (tests/repo/test_prerequisites.py keeps
#: the three in step), so a fresh machine runs the whole suite with nothing skipped.
HOST_PROGRAMS: dict[str, str] = {
    "/usr/lib/systemd/systemd-journald": "systemd",   # the private journald (systemd_fixtures.py)
    "/usr/lib/systemd/systemd": "systemd",            # the private systemd --user manager
    "systemctl": "systemd",
    "journalctl": "systemd",
    "systemd-analyze": "systemd",                     # unit verification (test_units.py)
    "unshare": "util-linux",                          # mount/cgroup namespaces for the manager
    "setpriv": "util-linux",                          # the unit's credentials, uid 65534 (privileges, limits)
    "promtool": "prometheus",                         # alert rules and dashboard queries
    "prometheus": "prometheus",                       # scrapes a daemon run for the dashboard test
    "/usr/lib/systemd/systemd-journal-remote": "systemd-journal-remote",  # journald to a central box
    "/usr/lib/systemd/systemd-journal-upload": "systemd-journal-remote",
    "haproxy": "haproxy",                             # the balancer pool before two boxes (test_haproxy_e2e.py)
}


def unavailable(why: str) -> NoReturn:
    """Skip the test with ``why`` — or fail it when ``CI=true``."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why + " (CI=true: a missing precondition fails the run)")
    pytest.skip(why)
