"""The build a verdict names (``--version``, read by action: core/facts.py) is read as llama-server runs —
as ``[server].user``, with ``[server].env`` — never as root: a build that account can replace must not
gain root's privileges, and a build that needs its ``[server].env`` (LD_LIBRARY_PATH) to load is named."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_guard.config.server import ServerConfig
from llama_guard.core.facts import read_build
from llama_guard.core.offload import Lane, LaneKind


@pytest.fixture
def build_dir() -> Iterator[Path]:
    """A build that prints the uid it runs as and a variable of its environment, where another user
    reaches it (pytest's tmp_path is 0700, root's)."""
    where = Path(tempfile.mkdtemp(prefix="llama-guard-build-"))
    where.chmod(0o755)
    exe = where / "llama-server"
    exe.write_text("#!/bin/sh\necho \"version: 1 (uid $(id -u), $LG_TEST_MARK)\"\n")
    exe.chmod(0o755)
    yield where
    shutil.rmtree(where)


async def test_the_build_a_verdict_names_is_read_as_the_server_user(build_dir: Path) -> None:
    server = ServerConfig(binary=str(build_dir / "llama-server"), model=build_dir / "m.gguf", user="nobody",
                          env={"LG_TEST_MARK": "its env"})
    info = await read_build(server, Lane(LaneKind.PROBE))
    assert info.text == "version: 1 (uid 65534, its env)"
