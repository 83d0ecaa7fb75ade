"""The slots watcher: saves each slot's KV cache and restores it into the next server, verified.

- Planned restarts (schedule, ``llama-guard restart``, reload, decay) and a drained stop of
  llama-guard: after the drain (:meth:`SlotsSource.after_drain`: no slot processing, clients held
  by the front door) every slot whose tokens changed since its last save is saved, within
  ``[slots].save_timeout_s``; ``slot_saved`` names which of the two (from the policy's
  :class:`~llama_guard.model.types.AfterStop`).
- Crashes: every ``[slots].rolling_save_interval_s`` while the server is READY and no slot is
  processing, the idle slots whose tokens changed are saved (a rolling save), so a kill -9, OOM or
  hang loses at most what changed since.
- GPU resets: when the policy stops a server that can still answer for a reset (an Xid that is not
  a lost GPU or a memory error; :meth:`SlotsSource.before_reset_stop`), the changed idle slots are
  saved first, within ``[slots].reset_save_timeout_s`` (a slot still processing is left alone).
- Every start: after ``/health`` 200 and before the server is called ready (:meth:`restore`:
  clients are still held), each committed file of this server's fingerprint is restored into its
  slot and verified by evaluating its tokens on that slot (``cache_n`` must cover all but the last);
  a file saved by another build only when its state format is the one this build writes (measured,
  when there is such a file, by a save of the new server's empty slot 0, read and removed at once),
  otherwise refused naming both builds (``slot_restore_refused``, refusal ``build``); the whole
  within ``[slots].restore_timeout_s``. A verification that reused nothing is reported with the
  model and build and ends this start's restores; :data:`~.store.UNRESTORABLE_AFTER` of them in a
  row stop the carry-over for them for good (counted on disk; a verification that reused its tokens
  starts the count again). Only a restore's own verification can say so: a client's answer cannot
  (a raw ``/completion``, ``/v1/completions`` or ``/infill`` prompt shares nothing with the restored
  one when it is another conversation).

The verification's completion also marks the slot as holding a conversation in ``/slots``, so the
liveness canary (which only takes a slot without one) leaves a restored slot alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TypeVar

from llama_guard.config.argv import own_slot_save_path, own_slot_save_problem, slot_save_dir
from llama_guard.config.server import ServerConfig
from llama_guard.core.offload import Lane, LaneBusy, LaneKind
from llama_guard.core.privileges import resolve_identity, server_user_argv
from llama_guard.host.build import Build, identify, stamp_of
from llama_guard.model.policy.window import slot_save_reason
from llama_guard.model.transition import Transition
from llama_guard.model.types import State
from llama_guard.model.watcher import Context, Watcher
from llama_guard.slots.client import SlotCallError, SlotClient
from llama_guard.slots.fingerprint import Fingerprint, fingerprint_of
from llama_guard.slots.header import StateFormat
from llama_guard.slots.store import IO_TIMEOUT_S, UNRESTORABLE_AFTER, SlotStore, StoreError
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.units import MIB

SLOT_FILES_TIMEOUT_S = IO_TIMEOUT_S + 10.0  # one slot-file step on its lane (seconds): its reads end by IO_TIMEOUT_S
T = TypeVar("T")


class SlotsSource(Watcher):
    """Saves and restores llama-server's slots (off when ``[slots].enabled`` is false); the daemon's
    KV slot port (:class:`llama_guard.core.ports.SlotPort`)."""

    name = "slots"

    def __init__(self) -> None:
        self.store: SlotStore | None = None
        self._builds: dict[tuple[str, tuple[int, int, int, int]], Build] = {}  # (binary, stamp_of) -> its build
        self._binary: tuple[Path, Mapping[str, str]] | None = None  # the executable started next, its environment
        self._saved: dict[int, tuple[int | None, int]] = {}  # slot id -> (id_task, n_tokens) as last saved
        self._failed: dict[int, tuple[int | None, int]] = {}  # slot id -> (id_task, n_tokens) whose save failed
        self._spawned: ServerConfig | None = None  # the [server] section the next server is started from
        self._pid: int | None = None  # the server _saved and _fp belong to
        self._fp: Fingerprint | None = None  # that server's fingerprint (None: no saves for it)
        self._lock = asyncio.Lock()  # one save or restore pass at a time
        self._off_reason: str | None = None  # why the carry-over is off now (said once)
        self._files = Lane(LaneKind.SLOT_FILES)  # the store's file work: a hung disk stays on this lane
        # The policy as the loop's last record showed it: the server it holds READY (None: none), and
        # what the saves after a drain are for (the window's slot_save_reason).
        self._ready_pid: int | None = None
        self._drain_reason = slot_save_reason(State())

    async def _on_files(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` (the store's blocking file work) on the slot-files lane, within
        :data:`SLOT_FILES_TIMEOUT_S`. Raises OSError: the call's own, a timeout (CallTimeout is one)
        or a lane whose every slot is held by calls that did not return."""
        try:
            return await self._files.run(fn, SLOT_FILES_TIMEOUT_S, what)
        except LaneBusy as exc:
            raise OSError(errno.EBUSY, str(exc)) from None

    # ------------------------------------------------------------ set-up

    async def start(self, ctx: Context) -> str | None:
        await self._prepare(ctx)
        return None

    async def before_spawn(self, ctx: Context, binary: Path, env: Mapping[str, str]) -> None:
        self._spawned = ctx.config.server  # a reload may change the config while this server runs
        self._binary = (binary, env)
        await self._prepare(ctx)

    async def _prepare(self, ctx: Context) -> None:
        """The store for the current config (its directory created, owned by ``[server].user``). A
        directory that cannot be prepared turns the carry-over off for this server — said once per
        reason (``slot_save_failed``), never a reason to refuse a start: llama-server serves without."""
        config = ctx.config
        self.store = None
        if not config.slots.enabled:
            return
        root = slot_save_dir(config.server, config.slots, config.runtime)
        store = SlotStore(root, int(config.slots.budget_mib * MIB))
        try:
            who = resolve_identity(config.server.user, config.server.group, config.server.supplementary_groups) \
                if config.server.user else None
            uid = who.uid if who is not None else None
            gids = tuple(g for g in (who.gid, *(who.groups or ())) if g is not None) if who is not None else ()
            if await self._on_files(lambda: own_slot_save_problem(config.server), f"checking {root}"):
                return  # the user's own --slot-save-path is never created: the start is refused (spawner)
            await self._on_files(lambda: store.prepare(uid, gids), f"preparing {root}")
        except (OSError, ValueError) as exc:
            reason = (f"the KV cache is not carried across restarts: cannot prepare the slot directory {root} "
                      f"for llama-server's user: {getattr(exc, 'strerror', None) or exc} (llama-guard needs "
                      "CAP_CHOWN and CAP_DAC_OVERRIDE to share it with [server].user; or set [slots].enabled = false)")
            if own_slot_save_path(config.server) is None:  # ours, and empty: no --slot-save-path on it
                with contextlib.suppress(OSError):
                    await self._on_files(root.rmdir, f"removing {root}")
            if reason != self._off_reason:
                ctx.emit("slot_save_failed", slot_id=None, error=reason)
            self._off_reason = reason
            return
        self._off_reason = None
        self.store = store

    async def _fingerprint(self, ctx: Context, server: ServerConfig) -> Fingerprint | None:
        """The fingerprint of the server started from ``server`` with the executable of the last
        :meth:`before_spawn` (its build identified once per file: path and stamp); None (reported)
        when it cannot be read."""
        started = self._binary

        def compute() -> Fingerprint:
            if started is None:
                raise OSError("no llama-server was started by llama-guard")
            binary, env = started
            stamp = (str(binary), stamp_of(binary))
            if stamp not in self._builds:
                try:  # as llama-server runs, never as root
                    prefix = server_user_argv(server.user, server.group, server.supplementary_groups)
                except ValueError as exc:
                    raise OSError(str(exc)) from None
                build, failure = identify(binary, env=env, prefix=prefix)
                if build is None:
                    raise OSError(failure)
                self._builds[stamp] = build
            return fingerprint_of(server, self._builds[stamp])

        try:
            return await self._on_files(compute, "the fingerprint of llama-server and its model")
        except OSError as exc:
            ctx.emit("slot_save_failed", slot_id=None, error=f"no fingerprint: {exc.strerror or exc}")
            return None

    def _client(self, ctx: Context) -> SlotClient:
        timeout = min(ctx.config.slots.save_timeout_s, ctx.config.slots.restore_timeout_s)
        return SlotClient(ctx.config.server.base_url, ctx.get_api_key, timeout)

    # ------------------------------------------------------------ restore (every start)

    async def restore(self, ctx: Context, pid: int) -> None:
        """Restore and verify the committed slots of this server's fingerprint (bounded); never refuses."""
        if self.store is None:
            return
        async with self._lock:
            self._pid, self._saved, self._failed = pid, {}, {}
            self._fp = await self._fingerprint(ctx, self._spawned or ctx.config.server)
            bound = ctx.config.slots.restore_timeout_s
            try:
                await asyncio.wait_for(self._restore_all(ctx, self.store), bound)
            except OSError as exc:  # the slot store on a disk that fails or does not answer
                ctx.emit("slot_restore_failed", slot_id=None, server_pid=pid, error=f"the slot store: {_why(exc)}")
            except asyncio.TimeoutError:
                ctx.emit("slot_restore_failed", slot_id=None, server_pid=pid,
                         error=f"the restores took longer than [slots].restore_timeout_s ({bound:g} s); "
                               "the server is called ready without the rest")

    async def _restore_all(self, ctx: Context, store: SlotStore) -> None:
        fingerprint = self._fp
        if fingerprint is None or await self._on_files(lambda: store.unrestorable(fingerprint), "restorable?"):
            self._report_set_aside(ctx, store)
            return
        written: StateFormat | str | None = None
        if await self._on_files(lambda: store.from_other_builds(fingerprint), "files of other builds"):
            written = await self._written_format(ctx, store)
        good, refused = await self._on_files(lambda: store.check(fingerprint, written), f"checking {store.root}")
        for item in [*store.take_set_aside(), *refused]:
            ctx.emit("slot_restore_refused", file=item.file, refusal=item.refusal.value, detail=item.detail)
        if not good:
            return  # nothing to restore: the server is not asked anything more (no delay to its readiness)
        client = self._client(ctx)
        try:
            for manifest in good:
                try:
                    moved = await client.restore(manifest.slot_id, manifest.file)
                    tokens = await self._on_files(partial(store.tokens, manifest), manifest.file)
                    cache_n = await client.reuse(manifest.slot_id, tokens)
                except (SlotCallError, StoreError, OSError) as exc:
                    ctx.emit("slot_restore_failed", slot_id=manifest.slot_id, server_pid=self._pid, error=_why(exc))
                    continue
                if cache_n == 0 and len(tokens) > 1:
                    count = await self._on_files(lambda: store.note_unused(fingerprint), "counting a restore unused")
                    until = ("for good (remembered in unrestorable.json)" if count >= UNRESTORABLE_AFTER else
                             f"for this server ({count} of {UNRESTORABLE_AFTER} in a row before they stop for good)")
                    ctx.emit("slot_restore_unused", slot_id=manifest.slot_id, n_tokens=len(tokens), cache_n=cache_n,
                             model=fingerprint.model.path, build=fingerprint.build.short, by="verification",
                             until=until, server_pid=self._pid)
                    return
                if cache_n < len(tokens) - 1:
                    ctx.emit("slot_restore_failed", slot_id=manifest.slot_id, server_pid=self._pid,
                             error=f"its verification reused only {cache_n} of its {len(tokens)} tokens")
                    continue
                ctx.emit("slot_restored", slot_id=manifest.slot_id, n_tokens=moved.n_tokens, bytes=moved.n_bytes,
                         restore_ms=moved.ms, cache_n=cache_n, server_pid=self._pid)
                await self._on_files(lambda: store.note_reused(fingerprint), "counting a restore reused")
            with contextlib.suppress(SlotCallError):  # what is in the slots now needs no save
                self._saved = {s.id: (s.id_task, s.n_tokens) for s in await client.slots()}
        finally:
            await client.aclose()

    async def _written_format(self, ctx: Context, store: SlotStore) -> StateFormat | str:
        """The state format this server's build writes, from a save of its slot 0 (empty: the server
        has just started; the file is removed at once); else why it could not be measured."""
        name = store.new_name(0)
        client = self._client(ctx)
        try:
            await client.save(0, name)
            return await self._on_files(partial(store.written_format, name), f"reading {name}")
        except (SlotCallError, StoreError, OSError) as exc:
            return f"a save of its empty slot 0 failed: {_why(exc)}"
        finally:
            await client.aclose()

    def on_transition(self, ctx: Context, step: Transition) -> None:
        """Follow the loop's records: the server the policy holds READY and what the saves after a
        drain are for (the planned window decides: :func:`~llama_guard.model.policy.window.slot_save_reason`;
        cheap: no call)."""
        after = step.after
        self._ready_pid = after.pid if after.phase is Phase.READY else None
        self._drain_reason = slot_save_reason(after)

    @staticmethod
    def _report_set_aside(ctx: Context, store: SlotStore) -> None:
        for item in store.take_set_aside():
            ctx.emit("slot_restore_refused", file=item.file, refusal=item.refusal.value, detail=item.detail)

    def held_files(self) -> int | None:
        """The committed slot files (each one slot's conversation, for the next server); None when the
        carry-over is off or the directory cannot be read. Blocking (manifest reads, each store call bounded
        by its I/O timeout): for a caller off the loop, such as a /metrics scrape's lane."""
        store = self.store
        if store is None:
            return None
        try:
            return len(store.committed())
        except OSError:
            return None

    # ------------------------------------------------------------ saves

    async def after_drain(self, ctx: Context, pid: int) -> None:
        """Save the changed slots of drained server ``pid`` (bounded by ``[slots].save_timeout_s``; step 2
        of the planned window, :mod:`llama_guard.model.policy.window`); the reason is what follows its
        stop, as the window says: the daemon's exit, or else a planned restart."""
        if self.store is None:
            return
        bound = ctx.config.slots.save_timeout_s
        reason = self._drain_reason
        try:
            await asyncio.wait_for(self._save_changed(ctx, pid, reason, retry_failed=True), bound)
        except asyncio.TimeoutError:
            ctx.emit("slot_save_failed", slot_id=None, server_pid=pid,
                     error=f"the saves took longer than [slots].save_timeout_s ({bound:g} s)")

    async def before_reset_stop(self, ctx: Context, pid: int) -> None:
        """Save the changed idle slots of server ``pid`` before its stop for a GPU reset (bounded by
        ``[slots].reset_save_timeout_s``; slots still processing are skipped, not waited for)."""
        if self.store is None:
            return
        bound = ctx.config.slots.reset_save_timeout_s
        try:
            await asyncio.wait_for(self._save_changed(ctx, pid, "GPU reset", skip_busy=True, retry_failed=True),
                                   bound)
        except asyncio.TimeoutError:
            ctx.emit("slot_save_failed", slot_id=None, server_pid=pid,
                     error=f"the saves before the GPU reset took longer than [slots].reset_save_timeout_s "
                           f"({bound:g} s); the reset goes on without them")

    async def run(self, ctx: Context) -> None:
        """The rolling save: every ``rolling_save_interval_s``, the changed idle slots of a READY server."""
        while True:
            await asyncio.sleep(ctx.config.slots.rolling_save_interval_s)
            pid = self._ready_pid
            if self.store is not None and pid is not None:
                await self._save_changed(ctx, pid, "rolling")

    async def _save_changed(self, ctx: Context, pid: int, reason: str, *, skip_busy: bool = False,
                            retry_failed: bool = False) -> None:
        """Save each slot of server ``pid`` whose tokens changed since its last save, when no slot is
        processing (``skip_busy``: the idle slots even while others process). A slot whose save failed
        is tried again only once it changed (not every rolling interval), or when ``retry_failed`` (the
        saves before a stop: its conversation's last chance)."""
        store = self.store
        async with self._lock:
            fingerprint = self._fp
            if store is None or self._pid != pid or fingerprint is None:
                return  # a server whose restore pass did not run (slots were off): nothing to label its files with
            try:
                unrestorable = await self._on_files(lambda: store.unrestorable(fingerprint), "restorable?")
            except OSError as exc:
                ctx.emit("slot_save_failed", slot_id=None, server_pid=pid, error=f"the slot store: {_why(exc)}")
                return
            self._report_set_aside(ctx, store)
            if unrestorable:
                return
            client = self._client(ctx)
            try:
                await self._save_with(ctx, client, store, fingerprint, pid, reason, skip_busy, retry_failed)
            finally:
                await client.aclose()
            try:
                dropped = await self._on_files(store.prune, "pruning the slot files")
            except OSError as exc:
                ctx.emit("slot_save_failed", slot_id=None, server_pid=pid, error=f"pruning the slot files: {_why(exc)}")
                return
            for item in dropped:
                ctx.emit("slot_dropped", file=item.file, bytes=item.bytes, budget_mib=store.budget_bytes / MIB)

    async def _save_with(self, ctx: Context, client: SlotClient, store: SlotStore, fingerprint: Fingerprint,
                         pid: int, reason: str, skip_busy: bool, retry_failed: bool) -> None:
        try:
            slots = await client.slots()
        except SlotCallError:
            return  # a server that does not answer now is the liveness watch's business
        if any(s.processing for s in slots) and not skip_busy:
            return
        for slot in slots:
            seen = (slot.id_task, slot.n_tokens)
            if (slot.processing or slot.id_task is None or slot.n_tokens == 0 or slot.canary
                    or self._saved.get(slot.id) == seen or (not retry_failed and self._failed.get(slot.id) == seen)):
                continue
            try:
                name = store.new_name(slot.id)
                moved = await client.save(slot.id, name)
                manifest = await self._on_files(partial(store.commit, slot.id, name, fingerprint), f"slot {slot.id}")
            except (SlotCallError, StoreError, OSError) as exc:
                self._failed[slot.id] = seen  # tried once per change: a failing save is not repeated every interval
                ctx.emit("slot_save_failed", slot_id=slot.id, server_pid=pid, error=_why(exc))
                continue
            self._saved[slot.id] = seen
            ctx.emit("slot_saved", slot_id=slot.id, n_tokens=manifest.n_tokens, bytes=manifest.bytes,
                     save_ms=moved.ms, reason=reason, server_pid=pid, file=str(Path(store.root) / manifest.file))


def _why(exc: BaseException) -> str:
    """What went wrong, never empty (an exception without a message is named by its type)."""
    return str(exc) or type(exc).__name__
