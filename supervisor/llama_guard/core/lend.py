"""The window channel between ``llama-guard tune`` and the daemon that serves its configuration.

A unix socket, ``tune.sock`` in ``[runtime].dir``, created by the daemon (it holds that directory's
lock, so a socket file left there is stale and replaced) with mode 0600: only the daemon's user (and
root) can connect; any other user's ``tune`` gets EACCES. Who asks is named by the kernel
(``SO_PEERCRED``: pid and uid), never by the request, and a peer whose uid is neither root nor the
daemon's is refused too. One connection per window, one JSON line each way:

- tune → daemon: ``{"minutes": M}`` (its ``--minutes``; within ``ASK_TIMEOUT_S`` of the connect). The
  window's bound is ``M × 60 × 1.25 + LEND_MARGIN_S`` seconds (:func:`bound_s`).
- daemon → tune: ``{"granted": true, "bound_s": B}`` once the server is drained (slots saved) and
  stopped, or ``{"granted": false, "reason": "..."}`` (then the connection closes; nothing changed).
- tune → daemon, at its end: ``{"end": "done" | "stopped" | "failed"}``, then it closes.

The window ends at the first of: that line, the connection's end, or tune's process ending — watched
through a pidfd (``pidfd_open(2)``: readable when the process exits, also after kill -9). If the
configuration file changed since the ask (``tune --apply``), the daemon reloads it first; then it posts
:class:`~llama_guard.model.inputs.LendReturned` and the policy starts a server (:mod:`.policy.lend`).
Malformed input gets ``{"granted": false, "reason": ...}`` and a ``lend_refused`` event; the loop
never waits on a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from llama_guard.model.actions import AnswerLend
from llama_guard.model.inputs import Input, LendAsked, LendReturned
from llama_guard.model.types import LendEnd

SOCKET_NAME = "tune.sock"
#: A window lasts beyond tune's ``--minutes``: ``LEND_OVERRUN`` of them (the search ends a group's round
#: in progress at its deadline) plus ``LEND_MARGIN_S`` seconds (the last trial server's stop, the
#: worst-prefill trial of the chosen flags, ``--apply``'s write).
LEND_OVERRUN = 0.25
LEND_MARGIN_S = 120.0
MAX_MINUTES = 24 * 60.0  # the longest window tune may ask for (minutes)
ASK_TIMEOUT_S = 10.0  # the request line must come within this after the connect (seconds)
LINE_MAX = 4096  # bytes of one line, either way
#: How tune may say it ended (the rest of :class:`LendEnd` the daemon sees itself).
TUNE_ENDS = frozenset({LendEnd.DONE, LendEnd.STOPPED, LendEnd.FAILED})


def bound_s(minutes: float) -> float:
    """The window's bound for ``tune --minutes`` ``minutes``, seconds."""
    return minutes * 60.0 * (1 + LEND_OVERRUN) + LEND_MARGIN_S


class BadRequest(ValueError):
    """A line that is not the channel's (the message says why)."""


def parse_ask(line: bytes) -> float:
    """The ``minutes`` of an ask line. Raises :class:`BadRequest`."""
    body = _object(line)
    minutes = body.get("minutes")
    if set(body) != {"minutes"} or isinstance(minutes, bool) or not isinstance(minutes, (int, float)):
        raise BadRequest('expected {"minutes": <number>}')
    if not (0 < minutes <= MAX_MINUTES) or not math.isfinite(minutes):
        raise BadRequest(f"minutes must be above 0 and at most {MAX_MINUTES:g}, not {minutes!r}")
    return float(minutes)


def parse_end(line: bytes) -> LendEnd:
    """The end tune names in its last line. Raises :class:`BadRequest`."""
    body = _object(line)
    try:
        end = LendEnd(body.get("end"))
    except ValueError:
        end = None
    if set(body) != {"end"} or end not in TUNE_ENDS:
        raise BadRequest(f'expected {{"end": one of {sorted(e.value for e in TUNE_ENDS)}}}')
    assert end is not None
    return end


def _object(line: bytes) -> dict[str, object]:
    try:
        body = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("not a JSON line") from None
    if not isinstance(body, dict):
        raise BadRequest("not a JSON object")
    return body


def encode(body: dict[str, object]) -> bytes:
    return json.dumps(body).encode() + b"\n"


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of unix socket ``sock`` (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", raw)
    return pid, uid


@dataclass
class _Peer:
    pid: int
    writer: asyncio.StreamWriter
    pidfd: int = -1  # its process, for its end and for signals (no pid reuse can redirect them)
    granted: bool = False  # the window was granted (told to tune)


class LendChannel:
    """The daemon's end: ``emit`` reports, ``post`` queues the policy's inputs, ``reload`` reloads the
    configuration file (awaited before a window's end is posted when ``config_path`` changed)."""

    def __init__(self, config_path: Path, emit: Callable[..., None], post: Callable[[Input], None],
                 reload: Callable[[], Awaitable[None]]) -> None:
        self._config_path = config_path
        self._emit = emit
        self._post = post
        self._reload = reload
        self._server: asyncio.AbstractServer | None = None
        self._peers: dict[int, _Peer] = {}
        self.path: Path | None = None

    async def open(self, directory: Path) -> None:
        """Listen on ``directory``/tune.sock (0600). Raises OSError."""
        path = directory / SOCKET_NAME
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # this daemon holds the directory's lock: a socket file here is a dead daemon's
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=LINE_MAX)
        finally:
            os.umask(old)
        self.path = path

    async def close(self) -> None:
        """Stop listening, close every connection, remove the socket file."""
        if self._server is not None:
            self._server.close()
        for peer in list(self._peers.values()):
            peer.writer.close()
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def signal(self, pid: int, sig: int) -> None:
        """Send ``sig`` to tune ``pid`` through its pidfd (its bound passed); nothing once its window ended."""
        peer = self._peers.get(pid)
        if peer is not None and peer.pidfd >= 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(peer.pidfd, sig)

    def answer(self, action: AnswerLend) -> None:
        """Tell tune ``action.pid`` the policy's answer; a refusal closes its connection."""
        peer = self._peers.get(action.pid)
        if peer is None:
            return  # it went away meanwhile (its end is posted by its watch)
        peer.granted = action.granted
        body: dict[str, object] = ({"granted": True, "bound_s": action.bound_s} if action.granted
                                   else {"granted": False, "reason": action.reason})
        with contextlib.suppress(OSError, RuntimeError):
            peer.writer.write(encode(body))
        if not action.granted:
            del self._peers[action.pid]
            peer.writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid = peer_credentials(writer.get_extra_info("socket"))
        try:
            minutes = 0.0
            try:  # read first, whoever asks: the answer then reaches the client before the close
                line = await asyncio.wait_for(reader.readline(), ASK_TIMEOUT_S)
                refusal = self._who(pid, uid)
                if not refusal:
                    minutes = parse_ask(line)
            except BadRequest as exc:
                refusal = f"bad request: {exc}"
            except ValueError:  # readline's LimitOverrunError: no newline within the limit
                refusal = f"bad request: request line longer than {LINE_MAX} bytes"
            except (asyncio.TimeoutError, OSError):
                refusal = f"no request line within {ASK_TIMEOUT_S:g} s"
            if refusal:
                self._emit("lend_refused", tune_pid=pid, reason=refusal)
                with contextlib.suppress(OSError, RuntimeError):
                    writer.write(encode({"granted": False, "reason": refusal}))
                    await writer.drain()
                return
            await self._window(pid, minutes, reader, writer)
        finally:
            writer.close()

    def _who(self, pid: int, uid: int) -> str:
        """Why peer ``pid`` (``uid``) may not ask ("" when it may)."""
        if uid not in (0, os.geteuid()):
            return f"uid {uid} is neither root nor the daemon's user (uid {os.geteuid()})"
        if pid <= 0:
            return "the peer's pid cannot be seen (another pid namespace)"
        if pid in self._peers:
            return f"pid {pid} already asked for a window on another connection"
        return ""

    async def _window(self, pid: int, minutes: float, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        """Ask the policy, then watch until tune ends; its end is posted (after a reload when the
        configuration file changed)."""
        before = _stamp(self._config_path)
        try:
            pidfd, exited = _exit_of(pid)
        except ProcessLookupError:
            return
        self._peers[pid] = _Peer(pid, writer, pidfd)
        said: asyncio.Future[LendEnd | None] = asyncio.ensure_future(_end_line(reader))
        try:
            self._post(LendAsked(pid, bound_s(minutes)))
            await asyncio.wait((said, exited), return_when=asyncio.FIRST_COMPLETED)
        finally:
            said.cancel()
            exited.cancel()
        told = said.result() if said.done() and not said.cancelled() else None
        end = told or LendEnd.EXITED
        peer = self._peers.pop(pid, None)
        if peer is None:
            return  # refused meanwhile: nothing was lent
        if not peer.granted:  # gone before the grant: the policy cancels the window asked for
            detail = (f"it said {told.value}" if told is not None else
                      "its connection closed" if said.done() else "its process ended")
            self._post(LendReturned(pid, end, detail))
            return
        if _stamp(self._config_path) != before:  # tune --apply wrote it: the next server starts from it
            await self._reload()
        self._post(LendReturned(pid, end))


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells a changed file: (inode, size, mtime in ns); None when it cannot be read."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


async def _end_line(reader: asyncio.StreamReader) -> LendEnd | None:
    """tune's end line; None when the connection ends without one or with a bad one."""
    try:
        return parse_end(await reader.readline())
    except (BadRequest, ValueError, OSError):
        return None


def _exit_of(pid: int) -> tuple[int, asyncio.Future[None]]:
    """Process ``pid``'s pidfd and a future done when it exits (the pidfd becomes readable); the pidfd is
    closed once the future is done or cancelled. Raises ProcessLookupError."""
    loop = asyncio.get_running_loop()
    fd = os.pidfd_open(pid)
    done: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not done.done():
            done.set_result(None)

    def release(_: asyncio.Future[None]) -> None:
        loop.remove_reader(fd)
        os.close(fd)

    loop.add_reader(fd, on_exit)
    done.add_done_callback(release)
    return fd, done
