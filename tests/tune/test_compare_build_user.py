"""``bench --compare BUILD`` names both builds by their ``--version``, run as llama-server runs — as
``[server].user`` — never as root, like every other run of a build."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_guard.config import Config
from llama_guard.tune.compare import sides


@pytest.fixture
def builds() -> Iterator[tuple[Path, Path]]:
    """Two builds that print the uid they run as, where another user reaches them (pytest's tmp_path
    is 0700, root's)."""
    where = Path(tempfile.mkdtemp(prefix="llama-guard-builds-"))
    where.chmod(0o755)
    paths = []
    for name in ("llama-server", "llama-server-new"):
        path = where / name
        path.write_text('#!/bin/sh\necho "version: $(id -u) (abc1234)"\n')
        path.chmod(0o755)
        paths.append(path)
    yield paths[0], paths[1]
    shutil.rmtree(where)


def test_both_builds_are_named_as_the_server_user_runs_them(tmp_path: Path, builds: tuple[Path, Path]) -> None:
    ours, other = builds
    config = Config.model_validate({"server": {"binary": str(ours), "user": "nobody"}})
    a, b = sides(tmp_path / "a.toml", config, other)
    assert (a.label, b.label) == (f"{ours} (b65534 (abc1234))", f"{other} (b65534 (abc1234))")
