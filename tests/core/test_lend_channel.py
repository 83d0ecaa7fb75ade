"""The window channel's daemon end (core/lend.py) on a real unix socket, in process: who may ask (the
socket's mode, the peer's uid named by the kernel), bad requests (each refused with its reason and a
``lend_refused`` event, nothing posted to the policy), one window per process, and how a window's end
is seen — tune's end line, or its process's end through a pidfd (a kill -9)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from llama_guard.core.lend import LEND_MARGIN_S, SOCKET_NAME, LendChannel, bound_s
from llama_guard.model.actions import AnswerLend
from llama_guard.model.inputs import Input, LendAsked, LendReturned
from llama_guard.model.types import LendEnd

# A client in another process: connects, sends argv[2] (a line, or nothing), prints the answer line.
CLIENT = ("import socket, sys\n"
          "s = socket.socket(socket.AF_UNIX)\n"
          "try:\n"
          "    s.connect(sys.argv[1])\n"
          "except OSError as e:\n"
          "    print('connect:', e.strerror, flush=True); sys.exit(0)\n"
          "s.sendall(sys.argv[2].encode())\n"
          "print(s.makefile('rb').readline().decode().strip(), flush=True)\n"
          "for line in sys.stdin:\n"  # then what the test writes goes to the daemon, until it closes stdin
          "    s.sendall(line.encode())\n")


class Channel:
    def __init__(self, directory: Path, config: Path) -> None:
        self.posted: list[Input] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.reloads = 0
        self.dir = directory
        self.channel = LendChannel(config, lambda name, **f: self.events.append((name, f)), self.posted.append,
                                   self._reload)

    async def _reload(self) -> None:
        self.reloads += 1

    @property
    def path(self) -> str:
        return str(self.dir / SOCKET_NAME)

    def client(self, line: str, *prefix: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*prefix, sys.executable, "-c", CLIENT, self.path, line], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

    async def until(self, predicate: Any, what: str, timeout: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.01)


def _directory() -> Path:
    """A directory another uid may traverse (the socket file's own mode decides who connects)."""
    directory = Path(tempfile.mkdtemp(prefix="lg-lend-"))
    directory.chmod(0o755)
    (directory / "lg.toml").write_text("# config\n")
    return directory


def _remove(directory: Path) -> None:
    for item in directory.iterdir():
        item.unlink()
    directory.rmdir()


@pytest.fixture
async def chan() -> AsyncIterator[Channel]:
    directory = _directory()
    c = Channel(directory, directory / "lg.toml")
    await c.channel.open(directory)
    yield c
    await c.channel.close()
    _remove(directory)


async def answer_of(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return (await asyncio.to_thread(proc.stdout.readline)).strip()


async def test_the_socket_is_the_daemons_alone_and_a_stale_one_is_replaced(chan: Channel) -> None:
    assert stat.S_IMODE(os.stat(chan.path).st_mode) == 0o600
    await chan.channel.close()
    with pytest.raises(FileNotFoundError):
        os.stat(chan.path)
    os.close(os.open(chan.path, os.O_CREAT | os.O_WRONLY))  # a dead daemon's file: the next one replaces it
    await chan.channel.open(chan.dir)
    assert stat.S_ISSOCK(os.stat(chan.path).st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
async def test_another_user_cannot_reach_the_socket_nor_ask_through_a_wider_mode(chan: Channel) -> None:
    nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    denied = chan.client('{"minutes": 1}\n', *nobody)
    assert await answer_of(denied) == "connect: Permission denied"
    denied.communicate(timeout=30)
    os.chmod(chan.path, 0o666)  # were the mode wider, the peer's uid (named by the kernel) still decides
    refused = chan.client('{"minutes": 1}\n', *nobody)
    assert "uid 65534 is neither root nor the daemon's user" in await answer_of(refused)
    refused.communicate(input="", timeout=30)
    assert chan.posted == [] and [n for n, _ in chan.events] == ["lend_refused"]


@pytest.mark.parametrize(("line", "why"), [
    ("hello\n", "not a JSON line"),
    ('["minutes", 1]\n', "not a JSON object"),
    ('{"minutes": "5"}\n', 'expected {"minutes": <number>}'),
    ('{"minutes": true}\n', 'expected {"minutes": <number>}'),
    ('{"minutes": 5, "pid": 1}\n', 'expected {"minutes": <number>}'),  # a pid is never taken from the request
    ('{"minutes": 0}\n', "minutes must be above 0"),
    ('{"minutes": 1e9}\n', "minutes must be above 0"),
    ('{"minutes": NaN}\n', "minutes must be above 0"),
])
async def test_a_bad_request_is_refused_with_its_reason_and_nothing_is_asked(chan: Channel, line: str,
                                                                            why: str) -> None:
    proc = chan.client(line)
    answer = await answer_of(proc)
    proc.communicate(input="", timeout=30)
    assert json.loads(answer)["granted"] is False and why in json.loads(answer)["reason"]
    assert chan.posted == [] and chan.events[0][0] == "lend_refused" and why in chan.events[0][1]["reason"]


async def test_a_window_ends_with_tunes_end_line_and_the_file_changed_is_reloaded_first(chan: Channel) -> None:
    proc = chan.client('{"minutes": 2}\n')
    await chan.until(lambda: chan.posted, "the ask posted")
    assert chan.posted == [LendAsked(proc.pid, bound_s(2))] and bound_s(2) == 150 + LEND_MARGIN_S
    chan.channel.answer(AnswerLend(proc.pid, True, bound_s=bound_s(2)))
    assert await answer_of(proc) == f'{{"granted": true, "bound_s": {bound_s(2)}}}'
    await asyncio.to_thread((chan.dir / "lg.toml").write_text, "# written by tune --apply\n")
    proc.stdin.write('{"end": "done"}\n')  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    await chan.until(lambda: len(chan.posted) >= 2 and isinstance(chan.posted[-1], LendReturned), "the end")
    assert chan.posted[-1] == LendReturned(proc.pid, LendEnd.DONE) and chan.reloads == 1
    proc.communicate(input="", timeout=30)


async def test_a_kill_9_of_tune_ends_its_window_through_its_pidfd(chan: Channel) -> None:
    proc = chan.client('{"minutes": 1}\n')
    await chan.until(lambda: chan.posted, "the ask posted")
    chan.channel.answer(AnswerLend(proc.pid, True, bound_s=bound_s(1)))
    assert '"granted": true' in await answer_of(proc)
    proc.kill()
    await chan.until(lambda: len(chan.posted) == 2, "the end seen")
    assert chan.posted[-1] == LendReturned(proc.pid, LendEnd.EXITED) and chan.reloads == 0
    proc.wait(timeout=30)


async def test_a_refusal_closes_the_connection_and_no_end_is_posted_for_it(chan: Channel) -> None:
    proc = chan.client('{"minutes": 1}\n')
    await chan.until(lambda: chan.posted, "the ask posted")
    chan.channel.answer(AnswerLend(proc.pid, False, "the GPU is already lent to tune pid 7"))
    assert await answer_of(proc) == '{"granted": false, "reason": "the GPU is already lent to tune pid 7"}'
    proc.communicate(input="", timeout=30)
    chan.channel.answer(AnswerLend(proc.pid, True, bound_s=60.0))  # an answer for a peer gone: dropped
    later = chan.client('{"minutes": 1}\n')  # the next window, to its end: the refused one posted none
    await chan.until(lambda: len(chan.posted) == 2, "the next ask posted")
    chan.channel.answer(AnswerLend(later.pid, True, bound_s=bound_s(1)))
    assert '"granted": true' in await answer_of(later)
    later.communicate(input="", timeout=30)
    await chan.until(lambda: len(chan.posted) == 3, "the next end")
    assert chan.posted == [LendAsked(proc.pid, bound_s(1)), LendAsked(later.pid, bound_s(1)),
                           LendReturned(later.pid, LendEnd.EXITED)]


async def test_one_process_asks_for_one_window_at_a_time(chan: Channel) -> None:
    _, first = await asyncio.open_unix_connection(chan.path)
    first.write(b'{"minutes": 1}\n')
    await chan.until(lambda: chan.posted, "the first ask posted")
    reader, second = await asyncio.open_unix_connection(chan.path)
    second.write(b'{"minutes": 1}\n')
    answer = await asyncio.wait_for(reader.readline(), 30)
    assert f"pid {os.getpid()} already asked for a window on another connection".encode() in answer
    assert chan.posted == [LendAsked(os.getpid(), bound_s(1))]
    first.close()
    second.close()
    await chan.until(lambda: len(chan.posted) == 2, "the first window's end")


async def test_the_bound_signals_tune_through_its_pidfd_and_nothing_after_its_window(chan: Channel) -> None:
    proc = chan.client('{"minutes": 1}\n')
    await chan.until(lambda: chan.posted, "the ask posted")
    chan.channel.answer(AnswerLend(proc.pid, True, bound_s=bound_s(1)))
    assert '"granted": true' in await answer_of(proc)
    chan.channel.signal(proc.pid, signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == -signal.SIGTERM
    await chan.until(lambda: len(chan.posted) == 2, "the end seen")
    assert chan.posted[-1] == LendReturned(proc.pid, LendEnd.EXITED)
    chan.channel.signal(proc.pid, signal.SIGKILL)  # its window ended: no signal goes to a pid that may be reused


async def test_a_peer_gone_before_the_grant_is_posted_as_such_and_never_reloads(chan: Channel) -> None:
    """Before: the same end as a granted window's (``exited``), with nothing to say it was never granted —
    the policy's restart after it read ``restart_cause: crash``."""
    _, writer = await asyncio.open_unix_connection(chan.path)
    writer.write(b'{"minutes": 1}\n')
    await chan.until(lambda: chan.posted, "the ask posted")
    writer.close()  # the connection ends before any answer (tune's process lives on: this one)
    await chan.until(lambda: len(chan.posted) == 2, "the cancel posted")
    assert chan.posted[-1] == LendReturned(os.getpid(), LendEnd.EXITED, "its connection closed")
    assert chan.reloads == 0


async def test_tune_ending_before_the_grant_is_posted_with_how(chan: Channel) -> None:
    """Another input of the kind: tune says it stopped (Ctrl-C) before the grant."""
    _, writer = await asyncio.open_unix_connection(chan.path)
    writer.write(b'{"minutes": 1}\n')
    await chan.until(lambda: chan.posted, "the ask posted")
    writer.write(b'{"end": "stopped"}\n')
    await chan.until(lambda: len(chan.posted) == 2, "the cancel posted")
    assert chan.posted[-1] == LendReturned(os.getpid(), LendEnd.STOPPED, "it said stopped")
    writer.close()


@pytest.mark.parametrize("line", [
    b"x" * 5000 + b"\n",                               # a line over the limit
    b'{"minutes": 1' + b" " * 5000 + b"}\n",            # a valid ask padded past the limit
    b"y" * 20000,                                      # no newline at all, far past the limit
])
async def test_a_request_line_over_the_limit_is_refused_at_once_as_such(chan: Channel, line: bytes) -> None:
    """Before: refused as "no request line within 10 s" (the overrun caught with the timeout), after
    the wait; now at once, naming the limit."""
    reader, writer = await asyncio.open_unix_connection(chan.path)
    writer.write(line)
    answer = json.loads(await asyncio.wait_for(reader.readline(), 60))
    assert answer == {"granted": False, "reason": "bad request: request line longer than 4096 bytes"}
    assert chan.posted == [] and chan.events == [("lend_refused", {"tune_pid": os.getpid(),
                                                                   "reason": answer["reason"]})]
    writer.close()
