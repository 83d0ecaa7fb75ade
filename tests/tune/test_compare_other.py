"""``bench --compare OTHER`` refuses an OTHER that is neither a build nor a configuration, naming why,
before anything starts: a file without the execute bit is no longer parsed as a configuration, an empty
file no longer accepted as one (all defaults). The CLI's exit status and that no server started:
tests/e2e/test_bench_compare.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_guard.config import Config
from llama_guard.tune.compare import CompareError, sides

USAGE = "OTHER is a llama-server executable or a configuration file (.toml)"


def _file(tmp_path: Path, name: str, text: str, mode: int = 0o644) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(("name", "text", "said"), [
    ("llama-server", "#!/bin/sh\nexec /opt/llama/llama-server \"$@\"\n",
     "is a program but not executable (mode 0644): chmod +x it to compare that build"),
    ("llama-server-b7200", "\x7fELF\x02\x01\x01 …",
     "is a program but not executable (mode 0644): chmod +x it to compare that build"),
    ("notes.txt", "[server]\nthreads = 4\n", f"is neither executable nor a .toml file: {USAGE}"),
    ("other", "", f"is empty: {USAGE}"),
    ("other.toml", "", f"is empty: {USAGE}"),
    ("other.toml", "\n   \n", f"is empty: {USAGE}"),
    ("other.toml", "# flash attention off\n\n# [server]\n", f"is empty (no setting, only comments): {USAGE}"),
])
def test_an_other_that_is_neither_a_build_nor_a_configuration_is_refused(
        tmp_path: Path, name: str, text: str, said: str) -> None:
    other = _file(tmp_path, name, text)
    with pytest.raises(CompareError) as caught:
        sides(tmp_path / "a.toml", Config(), other)
    assert str(caught.value) == f"{other} {said}"


def test_a_directory_is_refused_and_a_configuration_still_loads(tmp_path: Path) -> None:
    with pytest.raises(CompareError, match=f"^{tmp_path} is a directory: "):
        sides(tmp_path / "a.toml", Config(), tmp_path)
    other = _file(tmp_path, "b.toml", "[server]\nthreads = 3\nport = 18111\n")  # its own port: none picked
    _, b = sides(tmp_path / "a.toml", Config(), other)
    assert b.label == "b.toml" and b.config.server.threads == 3
