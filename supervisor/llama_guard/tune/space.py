"""The tuner's search space: one flag set (:class:`Knobs`), the knobs the motivating write-up A/B-tested
(build, layers on the GPU, threads, flash attention, KV cache type, context, slots, batch and
micro-batch), and each knob's alternatives to a given flag set within the ``[tune]`` floors.

Pure: no process, no clock. The search (:mod:`.search`) walks the knobs in :data:`AXES` order, one
knob at a time from the best flag set so far (coordinate descent), so a search costs a sum, not a
product, of each knob's values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from typing import Any

from llama_guard.config import Config
from llama_guard.vocab.server_flags import QUANTIZED_CACHE_TYPES

# (batch_size, ubatch_size) pairs worth trying besides the configured one: llama-server's default
# 2048/512, the write-up's 512/256, and a smaller pair that leaves more VRAM to the KV cache.
BATCH_PAIRS: tuple[tuple[int, int], ...] = ((2048, 512), (512, 256), (256, 128))


@dataclass(frozen=True)
class Knobs:
    """One llama-server flag set the tuner may choose (the ``[server]`` keys of the same names;
    ``binary`` is a path or a name on PATH)."""

    binary: str
    n_gpu_layers: int
    ctx_size: int
    parallel: int
    batch_size: int
    ubatch_size: int
    cache_type_k: str
    cache_type_v: str
    flash_attn: str
    threads: int | None
    threads_batch: int | None

    @classmethod
    def from_config(cls, config: Config) -> Knobs:
        """The configured ``[server]`` flags: the baseline."""
        s = config.server
        return cls(binary=s.binary, n_gpu_layers=s.n_gpu_layers, ctx_size=s.ctx_size, parallel=s.parallel,
                   batch_size=s.batch_size, ubatch_size=s.ubatch_size, cache_type_k=s.cache_type_k,
                   cache_type_v=s.cache_type_v, flash_attn=s.flash_attn, threads=s.threads,
                   threads_batch=s.threads_batch)

    def as_server_update(self) -> dict[str, Any]:
        """The ``[server]`` keys and values of this flag set (for ``model_copy(update=…)`` and ``--apply``)."""
        return asdict(self)

    def changes_from(self, other: Knobs) -> dict[str, tuple[Any, Any]]:
        """``{key: (other's value, this value)}`` for every key that differs."""
        return {f.name: (getattr(other, f.name), getattr(self, f.name)) for f in fields(self)
                if getattr(other, f.name) != getattr(self, f.name)}

    def label(self) -> str:
        """Short llama-server-flag form, e.g. ``-c 8192 -np 1 -b 512 -ub 256 -ctk q8_0 -ctv q8_0 -fa on -t 8``."""
        t = f" -t {self.threads}" if self.threads is not None else ""
        tb = f" -tb {self.threads_batch}" if self.threads_batch is not None else ""
        return (f"-ngl {self.n_gpu_layers} -c {self.ctx_size} -np {self.parallel} -b {self.batch_size} "
                f"-ub {self.ubatch_size} -ctk {self.cache_type_k} -ctv {self.cache_type_v} -fa {self.flash_attn}"
                f"{t}{tb}" + (f" [{self.binary}]" if "/" in self.binary or self.binary != "llama-server" else ""))

    def problem(self) -> str | None:
        """Why llama-server would refuse this flag set (None: it would not)."""
        if self.ubatch_size > self.batch_size:
            return f"ubatch_size {self.ubatch_size} > batch_size {self.batch_size}"
        if self.cache_type_v in QUANTIZED_CACHE_TYPES and self.flash_attn == "off":
            return f"a {self.cache_type_v} V cache needs flash attention"
        return None


class Knob(Enum):
    """The knobs in the order the search tries them: those the write-up found largest first."""

    BINARY = "binary"
    THREADS = "threads"
    FLASH_ATTN = "flash_attn"
    CACHE_TYPE = "cache_type"
    CTX_SIZE = "ctx_size"
    PARALLEL = "parallel"
    BATCH = "batch"


@dataclass(frozen=True)
class Space:
    """What the alternatives may be: the ``[tune]`` floors and facts about the host.

    ``binaries``: builds to try besides the baseline's; ``cache_types``: allowed KV cache types;
    ``min_ctx_size``: the smallest context (tokens); ``min_parallel``/``max_parallel``: slots;
    ``cpu_threads``: the host's usable CPU count; ``cpu_layers``: whether any layer runs on the CPU
    (then threads matter for decode)."""

    binaries: tuple[str, ...]
    cache_types: tuple[str, ...]
    min_ctx_size: int
    min_parallel: int
    max_parallel: int
    cpu_threads: int
    cpu_layers: bool

    @classmethod
    def from_config(cls, config: Config, *, cpu_threads: int, cpu_layers: bool) -> Space:
        tune = config.tune
        return cls(binaries=tuple(tune.binaries), cache_types=tuple(tune.cache_types),
                   min_ctx_size=tune.min_ctx_size, min_parallel=tune.min_parallel,
                   max_parallel=tune.max_parallel if tune.max_parallel is not None else config.server.parallel,
                   cpu_threads=max(1, cpu_threads), cpu_layers=cpu_layers)


def thread_counts(cpus: int) -> list[int]:
    """1, 2, 4, … up to ``cpus``, and ``cpus`` itself (decode is memory-bound: more threads than
    cores only contend)."""
    out, n = [], 1
    while n < cpus:
        out.append(n)
        n *= 2
    out.append(cpus)
    return out


def _binary(k: Knobs, sp: Space) -> list[Knobs]:
    return [replace(k, binary=b) for b in sp.binaries]


def _threads(k: Knobs, sp: Space) -> list[Knobs]:
    if not sp.cpu_layers:
        return []
    # threads_batch unset means llama-server's own default (the same as threads): kept unset
    return [replace(k, threads=n, threads_batch=None if k.threads_batch is None else n)
            for n in thread_counts(sp.cpu_threads)]


def _flash_attn(k: Knobs, sp: Space) -> list[Knobs]:
    return [replace(k, flash_attn=fa) for fa in ("on", "off")]


def _cache_type(k: Knobs, sp: Space) -> list[Knobs]:
    """Each allowed type for both K and V; a quantized V cache brings flash attention with it."""
    return [replace(k, cache_type_k=t, cache_type_v=t,
                    flash_attn="on" if t in QUANTIZED_CACHE_TYPES and k.flash_attn == "off" else k.flash_attn)
            for t in sp.cache_types]


def _ctx_size(k: Knobs, sp: Space) -> list[Knobs]:
    """The configured context and halvings of it down to the floor (never more than configured: a
    larger context is never faster)."""
    if k.ctx_size == 0:
        return []
    out, ctx = [], k.ctx_size
    while ctx >= sp.min_ctx_size:
        out.append(replace(k, ctx_size=ctx))
        ctx //= 2
    return out


def _parallel(k: Knobs, sp: Space) -> list[Knobs]:
    values = sorted({n for n in (sp.min_parallel, 1, 2, 4, k.parallel, sp.max_parallel)
                     if sp.min_parallel <= n <= sp.max_parallel})
    return [replace(k, parallel=n) for n in values]


def _batch(k: Knobs, sp: Space) -> list[Knobs]:
    return [replace(k, batch_size=b, ubatch_size=u) for b, u in BATCH_PAIRS]


AXES: dict[Knob, Callable[[Knobs, Space], list[Knobs]]] = {
    Knob.BINARY: _binary, Knob.THREADS: _threads, Knob.FLASH_ATTN: _flash_attn, Knob.CACHE_TYPE: _cache_type,
    Knob.CTX_SIZE: _ctx_size, Knob.PARALLEL: _parallel, Knob.BATCH: _batch,
}


def alternatives(knob: Knob, best: Knobs, space: Space) -> list[Knobs]:
    """``best`` and its alternatives along ``knob`` that llama-server would accept, without
    duplicates, ``best`` first."""
    out = [best]
    for cand in AXES[knob](best, space):
        if cand not in out and cand.problem() is None:
            out.append(cand)
    return out
