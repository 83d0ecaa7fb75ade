"""End to end: a conversation's KV cache carried across a GPU reset, with the REAL llama-server and
SmolLM2 model (CPU) behind the front door, a fake NVML (``tests/fake_pynvml_mod.py``: a CPU has no GPU
to fault) and the stub reset command (``tests/stub_reset.py``), as in test_reset_e2e.py.

NVML reports Xid 74 (an NVLink error: the GPU still answers, its memory as it was). The rolling save is
off (an hour), so only the save before the reset's stop can carry the conversation: the slot must be
saved for the "GPU reset" before the server stopped, restored into the server started after the reset,
and the next turn must evaluate only its own tokens.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import FAKE_NVML_RUN, base_sections, free_port, merge, server_pids_of
from needs import unavailable
from test_reset_e2e import STUB, TESTS, GpuRun
from test_slots_e2e import Conversation, carried

pytestmark = [pytest.mark.real, pytest.mark.timeout(120)]


@pytest.fixture
def reset_run(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> Iterator[GpuRun]:
    if os.geteuid() != 0:
        unavailable("the GPU reset's precondition 'we are root' needs root")
    port, front = free_port(), free_port()
    script = tmp_path / "nvml.json"
    script.write_text("{}")
    sections = merge(base_sections(tmp_path, str(llama_server_bin), str(real_model), port), {
        "server": {"ctx_size": 2048},
        "front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": 120.0},
        "health": {"interval_s": 1.0, "hang_strikes": 5, "timeout_s": 5.0, "canary": False},
        "gpu": {"enabled": "on", "index": 0, "sample_interval_s": 0.2, "vram_release_timeout_s": 3.0,
                "require_server_on_gpu": False, "kmsg_path": str(tmp_path / "no-kmsg")},
        "recovery": {"reset_command": [sys.executable, str(STUB), "--tag", str(tmp_path), "--gpu-reset", "-i",
                                       "{index}"],
                     "reset_timeout_s": 10.0, "max_resets": 2, "stop_grace_s": 10.0},
        "slots": {"rolling_save_interval_s": 3600.0},
    })
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": pythonpath, "FAKE_NVML_SCRIPT": str(script), "FAKE_NVML_STATE": str(tmp_path / "state.json"),
           "STUB_RESET_RECORD": str(tmp_path / "reset-record.jsonl"), "STUB_RESET_MODE": "ok"}
    run = GpuRun(tmp_path, sections, env=env, command=FAKE_NVML_RUN)
    run.port, run.script, run.record = port, script, tmp_path / "reset-record.jsonl"
    run.front = front  # type: ignore[attr-defined]
    yield run
    run.stop()
    for pid in server_pids_of(port):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"llama-server pid {pid} outlived its daemon")


def test_a_gpu_reset_for_an_xid_that_leaves_the_memory_readable_keeps_the_conversation(reset_run: Any) -> None:
    run = reset_run.start()
    first = run.wait_event("server_ready", 60)["server_pid"]
    chat = Conversation("tools", facts=10)
    assert chat.turn(run.front, "Which item weighs the most?")["cache_n"] == 0
    run.set_nvml(xids=[74])
    saved = run.wait_event("slot_saved", 30, where=lambda e: e["reason"] == "GPU reset")
    assert saved["server_pid"] == first and saved["n_tokens"] >= chat.prompt_tokens - 1
    assert run.wait_event("gpu_reset", 30)["outcome"] == "succeeded"
    second = run.wait_event("server_ready", 60, skip=1)["server_pid"]
    assert second != first
    restored = run.wait_event("slot_restored", 10, where=lambda e: e["server_pid"] == second)
    assert restored["cache_n"] >= restored["n_tokens"] - 1
    assert carried(chat.turn(run.front, "And which item costs the least?")), chat.messages
    # The save came before the stop for the reset, the reset before the new server.
    assert run.order("slot_saved", "server_stopped", "gpu_reset", "server_ready")[-4:] == [
        "slot_saved", "server_stopped", "gpu_reset", "server_ready"]
    assert "slot_save_failed" not in run.names()
