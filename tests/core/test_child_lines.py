"""llama-server's output reaches events (``server_line``, an exit's ``last_error``), the failure record
and ``llama-guard status``'s recent events through one reader (core/child.py ``lines``): what a build
(or setpriv, whose one line precedes a failed start) prints there is cleaned as its ``--version`` is
(host/build.py ``clean_text``) — no escape sequence, carriage return or other control character, no
bidi override reaches an operator's terminal; each line stays one line."""

from __future__ import annotations

import os

import pytest
from llama_guard.core.child import ChildSetup, spawn


@pytest.mark.parametrize(("printed", "lines"), [
    # an OSC (the terminal's title) and a colour, around a real error line
    (r"\033]0;owned\007\033[31merror: CUDA error\033[0m\n", ["error: CUDA error"]),
    # a carriage return redraws the line: both parts kept, on one line
    (r"loading 10%%\rloading 99%%\n", ["loading 10% loading 99%"]),
    # a DCS with its payload; NUL, backspace and a bidi override
    (r"ok\033Pq#0;rm -rf\033\\ then\000\010 \342\200\256dne\n", ["ok then dne"]),
    # an 8-bit C1 CSI as Latin-1 bytes (not UTF-8: replaced, never a control) and an unterminated OSC
    (r"abort: \2331;31m bad\nlast\033]8;;http://x\n", ["abort: �1;31m bad", "last"]),
])
async def test_the_servers_output_is_read_clean_one_line_at_a_time(printed: str, lines: list[str]) -> None:
    server = await spawn(["/bin/sh", "-c", f"printf '{printed}'"], os.environ, ChildSetup())
    try:
        assert [line async for line in server.lines()] == lines
    finally:
        await server.exited()
        server.close()
