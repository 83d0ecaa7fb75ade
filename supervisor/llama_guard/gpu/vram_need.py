"""What the server needs in VRAM, and the VRAM facts of the check before each start.

The GPU watcher (:class:`llama_guard.gpu.watcher.GpuSource`) composes one :class:`VramNeed`; it
holds the GPU's readings (the NVML sample, which pids are ours, the recovery action) and hands them
in as callables, so that this module makes no NVML call of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from llama_guard.config import Config
from llama_guard.core.offload import CallTimeout, Lane, LaneBusy, LaneKind
from llama_guard.gpu.readings import GpuSample
from llama_guard.gpu.reset import holders_of
from llama_guard.insight.budget import Settings
from llama_guard.insight.need_cache import NeedCache, need_key
from llama_guard.model.inputs import VramFacts
from llama_guard.model.types import RecoveryAction
from llama_guard.model.watcher import Context
from llama_guard.vocab.units import MIB

NEED_LEARN_S = 30.0  # the VRAM need estimate (its child process gives up after 20 s)
NEED_KEY_S = 5.0  # the stat of the model file behind the estimate's cache key


class VramNeed:
    """The server's VRAM need and the VRAM facts built on it.

    Units: NVML readings come in bytes; every need, free amount and fact is in MiB (bytes // MIB,
    rounded down).

    Sources of the need, first found wins: what the server held (measured) at its first sample once
    READY after its last good start (:meth:`measure`), else ``[gpu].expected_vram_mib``, else the
    GGUF estimate of :class:`~llama_guard.insight.need_cache.NeedCache` (``need_cache``; None: no
    estimate at all). The estimate is learned in a thread (:meth:`learn`, lane
    ``LaneKind.VRAM_NEED``, deadline :data:`NEED_LEARN_S`) when the watch starts and after a reload
    (the GGUF read costs seconds of CPU): never on a start's path unless another process holds VRAM;
    then the admission's polls share it. The cache key is the model file's stat (lane
    ``LaneKind.VRAM_NEED_KEY``, deadline :data:`NEED_KEY_S`).

    Errors: a stat that times out or finds its lane busy makes the need unknown (None) for now. An
    estimate that fails (its own error, or the lane's :class:`~llama_guard.core.offload.CallTimeout`
    or :class:`~llama_guard.core.offload.LaneBusy`) raises to its first awaiter (:meth:`facts`),
    once per read; that configuration's need is then unknown until a new read (a reload, or the
    next daemon). No sample, or one without memory readings: facts with ``error`` set, no free VRAM.
    """

    def __init__(self, need_cache: NeedCache | None) -> None:
        self._needs = need_cache
        self._learning: asyncio.Future[int | None] | None = None
        self._learning_for: tuple[str, Settings] | None = None  # (model, settings) of that read
        self._needs_opened = False
        self._need_lane = Lane(LaneKind.VRAM_NEED)  # daemon threads: never delay the exit
        self._stat_lane = Lane(LaneKind.VRAM_NEED_KEY)
        self._measured_mib: int | None = None  # the server's VRAM at its last good start (MiB)
        self._measured_pid: int | None = None

    @property
    def learning(self) -> asyncio.Future[int | None] | None:
        """The latest estimate's future (its need in MiB, or None), None before any."""
        return self._learning

    def learn(self, config: Config) -> asyncio.Future[int | None] | None:
        """Estimate ``config``'s VRAM need in a thread (a no-op when it is known, nothing is offloaded or
        ``[gpu].expected_vram_mib`` states it); returns the estimate's future (None: nothing to learn).
        The caller asks only while a GPU is watched."""
        needs = self._needs
        if needs is None or config.server.n_gpu_layers == 0 or config.gpu.expected_vram_mib:
            return None
        model, settings, directory = str(config.server.model), Settings.from_server(config.server), config.runtime.dir
        first = not self._needs_opened
        self._needs_opened = True

        def learn() -> int | None:
            if first:
                needs.open(directory)
            return needs.learn(model, settings)

        previous = self._learning
        self._learning_for = (model, settings)

        async def run() -> int | None:
            if previous is not None:  # one read at a time: this one after it
                await asyncio.gather(previous, return_exceptions=True)
            return await self._need_lane.run(learn, NEED_LEARN_S, f"the VRAM need of {model}")

        self._learning = asyncio.ensure_future(run())
        self._learning.add_done_callback(lambda f: f.cancelled() or f.exception())  # raised to its awaiter
        return self._learning

    def measure(self, sample: GpuSample, ready_pid: int | None) -> None:
        """The READY server ``ready_pid``'s VRAM at its first sample: what the next start will need
        (``ready_pid`` None: no server is READY, nothing is measured)."""
        if ready_pid is None or self._measured_pid == ready_pid:
            return
        pid = ready_pid
        used = next((p.used_bytes for p in sample.processes or () if p.pid == pid), None)
        if used:
            self._measured_mib, self._measured_pid = used // MIB, pid

    async def _estimated(self, ctx: Context, holders: bool) -> int | None:
        """The need estimate (MiB) of the configuration, when known. Unknown and another process holds
        VRAM (``holders``): waits for the estimate (started now unless under way); a caller that times
        out leaves it running for the next poll. Raises what the estimate raised, once per read."""
        if self._needs is None:
            return None
        config = ctx.config
        settings = Settings.from_server(config.server)
        try:
            key = await self._stat_lane.run(lambda: need_key(str(config.server.model), settings), NEED_KEY_S,
                                            "stat of the model file")
        except (CallTimeout, LaneBusy):  # a hung filesystem: the need is unknown for now
            return None
        found, mib = self._needs.known(key)
        if found or key is None or not holders:
            return mib
        learning = self._learning
        if learning is not None and learning.done() and self._learning_for == (str(config.server.model), settings) \
                and (learning.cancelled() or learning.exception() is not None):
            return None  # this configuration's read failed (raised to its first awaiter): unknown
        if learning is None or learning.done():
            learning = self.learn(config)
        if learning is None:
            return None
        await asyncio.shield(learning)
        return self._needs.known(key)[1]

    async def facts(self, ctx: Context, index: int, *, sample: Callable[[], Awaitable[GpuSample | None]],
                    own_pids: Callable[[], set[int]],
                    recovery: Callable[[], Awaitable[RecoveryAction | None]]) -> VramFacts:
        """GPU ``index``'s free VRAM (MiB), what the server needs (MiB: measured at the last good start,
        else ``[gpu].expected_vram_mib``, else the GGUF estimate when known — awaited only when another
        process holds VRAM, the one case where the need decides anything) and the other processes
        holding VRAM, from one NVML ``sample()``; ``own_pids()``: ours (read after the sample),
        ``recovery()``: NVML's recovery action. Unbounded here: the daemon bounds each call."""
        need = self._measured_mib if self._measured_mib is not None else (ctx.config.gpu.expected_vram_mib or None)
        reading = await sample()
        if reading is None or reading.memory_used_bytes is None or reading.memory_total_bytes is None:
            why = "NVML gave no sample" if reading is None else "NVML gave no memory reading"
            return VramFacts(index, None, need, error=why)
        free = (reading.memory_total_bytes - reading.memory_used_bytes) // MIB
        holders = holders_of(reading, own_pids())
        if need is None:
            need = await self._estimated(ctx, bool(holders))
        return VramFacts(index, free, need, holders, recovery=await recovery())
