"""tune's end of the window channel (:mod:`llama_guard.core.lend`): with a daemon serving the
configuration, ``tune`` asks it for the GPU, waits until the daemon has drained and stopped its
llama-server, runs its trials, and returns the window when it ends (done, stopped, failed); the
daemon then starts its server again (from the file ``--apply`` wrote, reloaded first).

Blocking, every wait bounded. Raises :class:`WindowRefused` with the reason when the daemon cannot be
reached or refuses; nothing changed then."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llama_guard.config import Config
from llama_guard.core.lend import LINE_MAX, SOCKET_NAME, encode
from llama_guard.model.types import LendEnd

#: Seconds the grant may take beyond the daemon's own bounds on the drain, the slot saves and the stop.
GRANT_MARGIN_S = 30.0


class WindowRefused(RuntimeError):
    """The daemon could not be asked, or refused the window (the message says why)."""


@dataclass
class Window:
    """A granted window: its bound (seconds from the grant) and how tune will say it ended (set by the
    caller before the window closes; :attr:`LendEnd.FAILED` unless it says otherwise)."""

    bound_s: float
    end: LendEnd = LendEnd.FAILED


def grant_wait_s(config: Config) -> float:
    """How long tune waits for the grant (seconds): the daemon's drain (``[schedule].drain_timeout_s``),
    slot saves (``[slots].save_timeout_s``), the server's stop (``[recovery].stop_grace_s``) and a margin."""
    return (config.schedule.drain_timeout_s + config.slots.save_timeout_s + config.recovery.stop_grace_s
            + GRANT_MARGIN_S)


@contextlib.contextmanager
def lent_window(config: Config, minutes: float, daemon_pid: int) -> Iterator[Window]:
    """The GPU lent by daemon ``daemon_pid`` for the trials; returned on the way out with
    :attr:`Window.end`. Raises :class:`WindowRefused`."""
    path = Path(config.runtime.dir) / SOCKET_NAME
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        window = _ask(sock, path, minutes, grant_wait_s(config), daemon_pid)
        try:
            yield window
        finally:
            with contextlib.suppress(OSError):
                sock.sendall(encode({"end": window.end.value}))
    finally:
        sock.close()


def _ask(sock: socket.socket, path: Path, minutes: float, wait_s: float, daemon_pid: int) -> Window:
    try:
        sock.connect(str(path))
    except PermissionError:
        raise WindowRefused(f"cannot reach llama-guard pid {daemon_pid} at {path}: permission denied (only the "
                            "daemon's user and root may ask it for the GPU)") from None
    except OSError as exc:
        raise WindowRefused(f"cannot reach llama-guard pid {daemon_pid} at {path}: {exc.strerror or exc} (a "
                            "daemon too old to lend the GPU? restart it)") from None
    sock.settimeout(wait_s)
    try:
        sock.sendall(encode({"minutes": minutes}))
        line = sock.makefile("rb").readline(LINE_MAX)
    except TimeoutError:
        raise WindowRefused(f"llama-guard pid {daemon_pid} did not lend the GPU within {wait_s:.0f} s") from None
    except OSError as exc:
        raise WindowRefused(f"llama-guard pid {daemon_pid}: {exc.strerror or exc}") from None
    sock.settimeout(None)
    try:
        answer = json.loads(line)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise WindowRefused(f"llama-guard pid {daemon_pid} ended the channel without an answer (it is stopping?)")
    if answer.get("granted") is not True:
        raise WindowRefused(f"llama-guard pid {daemon_pid} refused: {answer.get('reason', '?')}")
    return Window(float(answer.get("bound_s", 0.0)))
