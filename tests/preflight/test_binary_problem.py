"""``[server].binary`` that cannot be started, named for what it is: not found, a directory, a FIFO or a
socket (whatever its mode says), not executable — in ``check``, in a reload's refusal, in the upgrade preflight and at a
start. Before: a directory was "not found", and a file without the execute bit reached the preflight as
"--version: Permission denied" (a reload) or "is not executable" (check) alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from llama_guard.config import Config
from llama_guard.core.reload import startable
from llama_guard.preflight.server import check_binary
from llama_guard.upgrade.preflight import preflight
from llama_guard.vocab.verdicts import Verdict


def _kinds(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each kind of unusable path and what its problem must say."""
    directory = tmp_path / "build"
    directory.mkdir()
    plain = tmp_path / "llama-server"
    plain.write_text("#!/bin/sh\necho version: 1\n")
    plain.chmod(0o644)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    runnable_fifo = tmp_path / "runnable-fifo"
    os.mkfifo(runnable_fifo, 0o755)  # its mode says executable; exec and a hash read of it do not work
    os.mknod(tmp_path / "sock", 0o755 | stat.S_IFSOCK)  # the inode a bound unix socket leaves
    not_regular = "not a regular file: not the llama-server executable"
    return {"directory": (directory, f"{directory} is a directory, not the llama-server executable"),
            "not executable": (plain, f"{plain} is not executable (mode 0644)"),
            "a FIFO without the execute bit": (fifo, f"{fifo} is a FIFO, {not_regular}"),
            "an executable FIFO": (runnable_fifo, f"{runnable_fifo} is a FIFO, {not_regular}"),
            "an executable socket": (tmp_path / "sock", f"{tmp_path / 'sock'} is a socket, {not_regular}"),
            "missing": (tmp_path / "gone", f"'{tmp_path / 'gone'}' not found")}


@pytest.mark.parametrize("kind", ["directory", "not executable", "a FIFO without the execute bit", "an executable FIFO",
                                  "an executable socket", "missing"])
def test_an_unusable_binary_is_named_for_what_it_is_everywhere(tmp_path: Path, kind: str) -> None:
    path, said = _kinds(tmp_path)[kind]
    config = Config.model_validate({"server": {"binary": str(path), "model": str(tmp_path / "m.gguf")}})
    assert startable(config) == f"server.binary: {said}"  # a reload's refusal (config_error)
    [result] = check_binary(config)
    assert result.verdict is Verdict.FAIL and result.detail == f"{said} (set [server].binary)"
    refused = preflight(config, path)  # a build found at a start, or a reload's new build
    assert refused.build is None and refused.cause == said


def test_a_name_on_path_that_is_not_there_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_guard.config.argv import binary_problem

    (tmp_path / "llama-server").mkdir()  # a directory of that name on $PATH is no executable either
    monkeypatch.setenv("PATH", str(tmp_path))
    assert binary_problem("llama-server") == "'llama-server' not found on $PATH"
    good = tmp_path / "bin"
    good.mkdir()
    (good / "llama-server").write_text("#!/bin/sh\n")
    (good / "llama-server").chmod(0o755)
    monkeypatch.setenv("PATH", str(good))
    assert binary_problem("llama-server") == ""
    assert binary_problem(str(good / "llama-server")) == ""
