"""End to end, with the REAL llama-server and model: a conversation's KV cache across an upgrade of
llama-server. A slot file saved by one build is restored into another only where the new build writes
the same state format (measured by a save of its own); a file whose layout differs is refused naming
both builds, the server serves, the conversation starts from a fresh prefill and later saves go on.

The "other builds" are the real build copied elsewhere (the same content: the same build) and the
real build behind a wrapper script (another content hash, the same layout: llama.cpp's own files).
A build whose layout differs is a file as such a build would leave it: its header's state version or
its KV stream count changed, its manifest naming another build (the real build cannot be made to
write another format).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from front_fixtures import daemon_pool, start_with_front
from test_slots_e2e import Conversation, carried
from test_upgrade_e2e import copy_build, reload_with, script

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]


@pytest.fixture
def daemon(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> Iterator[Any]:
    """A started daemon on the real build: one slot, front door on, rolling save every second,
    probation of a new build 1 s."""
    with daemon_pool() as pool:
        yield start_with_front(pool, tmp_path, llama_server_bin, real_model, {
            "server": {"parallel": 1, "ctx_size": 2048},
            "front": {"hold_timeout_s": 120.0},
            "health": {"interval_s": 1.0, "hang_strikes": 5, "timeout_s": 5.0, "canary_timeout_s": 10.0},
            "recovery": {"stable_after_s": 1.0, "max_restarts": 5},
            "schedule": {"drain_timeout_s": 60.0},
            "slots": {"rolling_save_interval_s": 1.0},
            # no decode-speed trial: these upgrades are about the KV cache (tests/e2e/test_upgrade_trial_e2e.py has
            # the trial; on a loaded 2-core host its two measurements outlast the waits here)
            "upgrade": {"probation_s": 1.0, "trial_runs": 0}})


def manifest_of(saved: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The manifest of the slot file a ``slot_saved`` event names: its path and content."""
    path = Path(saved["file"]).with_name(f"llama-guard-slot-{saved['slot_id']}.json")
    return path, json.loads(path.read_text())


def upgrade_to(run: Any, binary: Path, servers_before: int) -> int:
    """Reload ``run`` onto ``binary`` and wait until the new server serves; its pid."""
    reload_with(run, binary)
    assert run.wait_event("upgrade_preflight_passed", 60, skip=servers_before - 1)["binary"] == str(binary)
    return int(run.wait_event("server_ready", 120, skip=servers_before)["server_pid"])


def test_a_conversation_survives_upgrades_to_builds_of_the_same_layout(daemon: Any, llama_server_bin: Path,
                                                                       tmp_path: Path) -> None:
    chat = Conversation("tools", facts=10)
    chat.turn(daemon.front, "Which item weighs the most?")
    daemon.wait_event("slot_saved", 60, where=lambda e: e["server_pid"] == daemon.first)
    daemon.wait_event("upgrade_copy_kept", 60)  # the first build's probation is over
    # The same build copied elsewhere: the same content hash, restored as after any restart.
    second = upgrade_to(daemon, copy_build(llama_server_bin, tmp_path / "copy"), 1)
    restored = daemon.wait_event("slot_restored", 30, where=lambda e: e["server_pid"] == second)
    assert restored["cache_n"] >= restored["n_tokens"] - 1
    assert carried(chat.turn(daemon.front, "And which item costs the least?")), chat.messages
    saved = daemon.wait_event("slot_saved", 60, where=lambda e: e["server_pid"] == second)
    daemon.wait_event("upgrade_kept", 60)
    # Another build (another content hash) that writes the same format: measured, restored, verified.
    (tmp_path / "wrapped").mkdir()
    wrapper = script(tmp_path / "wrapped" / "llama-server", f'exec "{llama_server_bin}" "$@"\n')
    third = upgrade_to(daemon, wrapper, 2)
    restored = daemon.wait_event("slot_restored", 30, where=lambda e: e["server_pid"] == third)
    assert restored["cache_n"] >= restored["n_tokens"] - 1
    assert carried(chat.turn(daemon.front, "How many items are there?")), chat.messages
    saved = daemon.wait_event("slot_saved", 60, where=lambda e: e["server_pid"] == third)
    path, manifest = manifest_of(saved)
    assert manifest["fingerprint"]["build"]["sha256"] == hashlib.sha256(wrapper.read_bytes()).hexdigest()
    assert manifest["fingerprint"]["build"]["path"] == str(wrapper)
    assert manifest["fingerprint"]["build"]["release"].startswith(("v", "b"))
    assert manifest["state_format"] == {"magic": 0x67677371, "version": 4, "tokens_format": 1, "n_stream": 1}
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith("llama-guard-slot-0-")
                and p.name != manifest["file"]]  # the measuring save left nothing behind
    names = daemon.names()
    assert "slot_restore_refused" not in names and "slot_restore_failed" not in names
    assert "upgrade_rolled_back" not in names


@pytest.mark.parametrize("change", ["state version", "KV streams"])
def test_a_slot_file_of_a_build_whose_layout_differs_is_refused_naming_both_builds(daemon: Any,
                                                                                  change: str) -> None:
    chat = Conversation("tools", facts=5)  # small: after the refusal the whole history is evaluated again
    chat.turn(daemon.front, "Which item weighs the most?")
    saved = daemon.wait_event("slot_saved", 60, where=lambda e: e["server_pid"] == daemon.first)
    bin_path = Path(saved["file"])
    data = bytearray(bin_path.read_bytes())
    if change == "state version":
        data[4:8] = struct.pack("<I", 5)
    else:  # the word after the token list: the KV cache's streams (1 here: one slot)
        n_packed = struct.unpack_from("<I", data, 8)[0]
        data[12 + 4 * n_packed:16 + 4 * n_packed] = struct.pack("<I", 2)
    bin_path.write_bytes(bytes(data))
    path, manifest = manifest_of(saved)
    ours = manifest["fingerprint"]["build"]
    manifest["fingerprint"]["build"] = {"path": "/opt/llama/old/llama-server", "sha256": "0f" * 32,
                                        "version": "version: 9999 (0123abc)", "release": "b9999 (0123abc)"}
    manifest["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    path.write_text(json.dumps(manifest))
    os.kill(daemon.first, signal.SIGKILL)
    second = daemon.wait_event("server_ready", 90, skip=1)["server_pid"]
    refused = daemon.wait_event("slot_restore_refused", 10)
    assert refused["refusal"] == "build" and refused["file"] == bin_path.name and not bin_path.exists()
    assert refused["detail"].startswith(f"saved by llama-server b9999 (0123abc) sha256:0f0f0f0f, this server "
                                        f"runs {ours['release']} sha256:{ours['sha256'][:8]}; the file is "), refused
    assert ("'ggsq' v5" if change == "state version" else "2 KV stream(s)") in refused["detail"], refused
    assert "this build writes 'ggsq' v4, token list v1, 1 KV stream(s)" in refused["detail"], refused
    assert not [e for e in daemon.events() if e["event"] == "slot_restored" and e["server_pid"] == second]
    again = chat.turn(daemon.front, "And which item costs the least?")
    assert again["cache_n"] < again["previous_prompt"]  # a fresh prefill: the history was evaluated again
    daemon.wait_event("slot_saved", 60, where=lambda e: e["server_pid"] == second)  # later saves go on
    assert "daemon_exit" not in daemon.names() and "slot_restore_failed" not in daemon.names()
