"""The README's prerequisite line, ``.ci/run`` and the programs the tests run name the same packages,
and (on a Debian-family host) each program really comes from the package named for it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from needs import HOST_PROGRAMS

ROOT = Path(__file__).resolve().parents[2]
BUILD = {"python3-venv", "g++", "cmake", "make"}  # what `make demo` needs besides the test programs


def readme_packages() -> set[str]:
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("apt-get install ")]
    assert len(lines) == 1, lines
    return set(shlex.split(lines[0])[2:])


def ci_packages() -> set[str]:
    found = re.findall(r'^PACKAGES="([^"]+)"$', (ROOT / ".ci" / "run").read_text(), re.M)
    assert len(found) == 1, found
    return set(found[0].split())


def test_readme_and_ci_install_every_package_the_tests_need() -> None:
    wanted = set(HOST_PROGRAMS.values()) | BUILD
    assert readme_packages() == wanted
    assert ci_packages() == wanted


def test_each_program_comes_from_the_package_named_for_it() -> None:
    if shutil.which("dpkg-query") is None:
        return  # not a Debian-family host: the names above are Debian's, nothing to compare
    for program, package in HOST_PROGRAMS.items():
        path = program if os.sep in program else shutil.which(program)
        if path is None or not Path(path).exists():
            continue  # missing here: the test that runs it says so (skip, or fail under CI=true)
        owners = set()
        real = str(Path(path).resolve())
        # A merged /usr: dpkg may know the file under /lib or /bin rather than /usr/lib or /usr/bin.
        for candidate in {str(path), real, real.removeprefix("/usr"), "/usr" + real}:
            out = subprocess.run(["dpkg-query", "-S", candidate], capture_output=True, text=True, check=False)
            if out.returncode == 0:
                owners |= {o.strip() for o in out.stdout.split(":")[0].split(",")}
        assert package in owners, (program, path, owners)
