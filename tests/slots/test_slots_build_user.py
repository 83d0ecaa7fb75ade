"""The slots watcher identifies the build it fingerprints (``--version``) as llama-server runs — as
``[server].user`` — never as root: a build that account can replace must not gain root's privileges."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_guard.config import Config
from llama_guard.model.watcher import Context
from llama_guard.slots.watcher import SlotsSource


@pytest.fixture
def build_dir() -> Iterator[Path]:
    """A build that prints the uid it runs as, with a model, where another user reaches them (pytest's
    tmp_path is 0700, root's)."""
    where = Path(tempfile.mkdtemp(prefix="llama-guard-build-"))
    where.chmod(0o755)
    exe = where / "llama-server"
    exe.write_text("#!/bin/sh\necho \"version: 1 (uid $(id -u))\"\n")
    exe.chmod(0o755)
    (where / "model.gguf").write_bytes(b"GGUF" + bytes(64))
    yield where
    shutil.rmtree(where)


async def test_the_fingerprinted_build_runs_its_version_as_the_server_user(build_dir: Path) -> None:
    exe = build_dir / "llama-server"
    cfg = Config.model_validate({"server": {"binary": str(exe), "model": str(build_dir / "model.gguf"),
                                            "user": "nobody"}})
    events: list[tuple[str, dict[str, object]]] = []
    ctx = Context(get_config=lambda: cfg, emit=lambda name, **f: events.append((name, f)), post=lambda i: None,
                  post_threadsafe=lambda i: None, clock=lambda: 0.0, loop=asyncio.get_running_loop())
    source = SlotsSource()
    source._binary = (exe, {})
    assert await source._fingerprint(ctx, cfg.server) is not None, events
    assert [build.version for build in source._builds.values()] == ["version: 1 (uid 65534)"]
