"""A roll-back finds the build to go back to while a kept copy is being made: the copy (seconds to
minutes for a build's libraries) runs on the upgrade watcher's file lane, the checks before a start on
a lane of their own. Before, both shared one lane of one call: a slow build rolled back during a copy
found no build (every hash "busy") and the daemon ended with exit 78 ("server_boot_failure")."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from llama_guard.config import Config
from llama_guard.host.build import Build, file_sha256
from llama_guard.upgrade.watcher import UpgradeSource


async def test_a_copy_under_way_does_not_hide_the_serving_build_from_a_roll_back(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_bytes(b"#!/bin/sh\necho serving build\n")
    serving = Build(binary, file_sha256(binary), "version: 1", "v1")
    failing = Build(tmp_path / "new" / "llama-server", "f" * 64, "version: 2", "v2")
    source = UpgradeSource()
    source.lineage.serving = serving
    copying = threading.Event()
    copy = asyncio.ensure_future(source._files.run(copying.wait, 30.0, "keeping a build"))
    await asyncio.sleep(0.05)  # the copy holds the file lane
    try:
        config = Config.model_validate({"runtime": {"dir": str(tmp_path / "run")}})
        found = await source._last_good(config, exclude=failing)
    finally:
        copying.set()
        await copy
    assert found is not None and found[0] is serving and found[1].binary == binary
