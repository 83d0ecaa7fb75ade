"""The one HTTP client llama-guard talks to its llama-server with: aiohttp, the stack the front door
serves and forwards with (one HTTP stack in the daemon; measured in docs/front.md, "Cost").

Every request has a deadline (``timeout_s``, the whole exchange: connect, send, the complete answer);
no proxy is taken from the environment; the API key current at each request (``get_key()``; "" sends
none) goes as ``Authorization: Bearer``, so that a reloaded ``[server].api_key_file`` applies to an
open client. A request that got no complete answer raises :class:`RequestFailed` (``timed_out`` tells
a deadline from a failed connection); any HTTP status is an :class:`Answer`.

:class:`ServerClient` is for the event loop (the probes, the planned-restart watcher);
:class:`BlockingClient` runs one on a loop of its own for the synchronous verbs (``bench``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp

# llama-server (cpp-httplib) closes an idle keep-alive connection after 5 s: ours are dropped sooner, so
# that a request is never written into a connection the server is closing at that moment.
UPSTREAM_KEEPALIVE_S = 2.0


class RequestFailed(Exception):
    """No complete answer: the connection failed, or the deadline passed (``timed_out``)."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class Answer:
    """A complete HTTP answer: its ``status`` and ``body`` (bytes)."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        """The body as text (UTF-8; undecodable bytes replaced)."""
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body parsed as JSON. Raises ValueError when it is not JSON."""
        return jsonlib.loads(self.body)


class ServerClient:
    """Requests to ``base_url`` (``http://host:port``; "": each path is a whole URL) on the running
    event loop; the connection pool is made at the first request and closed by :meth:`aclose`.
    Idle connections are kept :data:`UPSTREAM_KEEPALIVE_S`; ``keep_alive`` False: none is kept (a
    loop that does not run between requests never sees the server close one)."""

    def __init__(self, base_url: str = "", get_key: Callable[[], str] = lambda: "", *,
                 keep_alive: bool = True) -> None:
        self.base_url = base_url
        self._get_key = get_key
        self._keep_alive = keep_alive
        self._session: aiohttp.ClientSession | None = None

    async def request(self, method: str, path: str, *, timeout_s: float, json: Any = None) -> Answer:
        """``method path`` (with a JSON body when ``json`` is not None) answered in full within
        ``timeout_s`` seconds. Raises :class:`RequestFailed`."""
        if self._session is None:
            connector = aiohttp.TCPConnector(force_close=not self._keep_alive,
                                             keepalive_timeout=UPSTREAM_KEEPALIVE_S if self._keep_alive else None)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        key = self._get_key()
        headers = {"Authorization": f"Bearer {key}"} if key else None
        try:
            async with self._session.request(method, self.base_url + path, json=json, headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return Answer(resp.status, await resp.read())
        except asyncio.TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
            raise RequestFailed(f"{method} {path}: no answer within {timeout_s:g} s", timed_out=True) from None
        except aiohttp.ClientError as exc:
            raise RequestFailed(f"{method} {path}: {exc.__class__.__name__}: {exc}", timed_out=False) from None

    async def get(self, path: str, *, timeout_s: float) -> Answer:
        return await self.request("GET", path, timeout_s=timeout_s)

    async def post(self, path: str, *, json: Any, timeout_s: float) -> Answer:
        return await self.request("POST", path, json=json, timeout_s=timeout_s)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> ServerClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class Cancel:
    """A cancellation of blocking requests from another thread (an upgrade's trial abandoned by the
    daemon's stop): :meth:`set` makes every :class:`BlockingClient` made with it raise
    :class:`RequestFailed` — the request under way at once (its connection closed, so llama-server stops
    that task), any later one before it is sent. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._loops: set[asyncio.AbstractEventLoop] = set()

    @property
    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            self._set = True
            loops = list(self._loops)
        for loop in loops:
            with contextlib.suppress(RuntimeError):  # that loop closed meanwhile
                loop.call_soon_threadsafe(_cancel_all, loop)

    def _add(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._loops.add(loop)

    def _discard(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._loops.discard(loop)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


class BlockingClient:
    """A :class:`ServerClient` on an event loop of its own, for callers without one (``bench``):
    each call blocks until the answer or its deadline (or ``cancel``). Use as a context manager."""

    def __init__(self, base_url: str, api_key: str = "", cancel: Cancel | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = ServerClient(base_url, lambda: api_key, keep_alive=False)
        self._cancel = cancel
        if cancel is not None:
            cancel._add(self._loop)

    def _run(self, method: str, path: str, request: Coroutine[Any, Any, Answer]) -> Answer:
        if self._cancel is not None and self._cancel.is_set:
            request.close()
            raise RequestFailed(f"{method} {path}: cancelled", timed_out=False)
        try:
            return self._loop.run_until_complete(request)
        except asyncio.CancelledError:
            raise RequestFailed(f"{method} {path}: cancelled", timed_out=False) from None

    def get(self, path: str, *, timeout_s: float) -> Answer:
        return self._run("GET", path, self._client.get(path, timeout_s=timeout_s))

    def post(self, path: str, *, json: Any, timeout_s: float) -> Answer:
        return self._run("POST", path, self._client.post(path, json=json, timeout_s=timeout_s))

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._cancel is not None:
            self._cancel._discard(self._loop)
        self._loop.run_until_complete(self._client.aclose())
        self._loop.close()
