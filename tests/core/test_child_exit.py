"""The daemon's last-resort kill of llama-server (core/child.py ``kill_and_reap``) is woken by the
kernel (the child's pidfd), never by polling: shown with a real child and ``asyncio.sleep`` made to fail,
and a bound too long to be what ended the wait (the run's own timeout would fail a wait that ran out)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
from llama_guard.core.child import ChildSetup, kill_and_reap, spawn


async def test_kill_and_reap_returns_on_the_exit_itself_without_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    server = await spawn(["sleep", "1000"], os.environ, ChildSetup())
    try:
        assert server.pidfd is not None and server.proc.returncode is None

        async def polled(*_: Any, **__: Any) -> None:
            raise AssertionError("kill_and_reap polled (asyncio.sleep) instead of waiting for the exit")

        with monkeypatch.context() as patch:
            patch.setattr(asyncio, "sleep", polled)
            await kill_and_reap(server, timeout_s=3600.0)
        assert await server.exited() == -signal.SIGKILL  # gone, killed by llama-guard's SIGKILL
    finally:
        server.signal_group(signal.SIGKILL)
        server.close()
