"""The VRAM budget of one llama-server configuration: weights + KV cache + compute buffers + the CUDA
context, from the model's GGUF metadata (:mod:`.model_facts`), and the operators' ladder when it does
not fit.

How llama.cpp places things (``src/llama-model.cpp``, ``src/llama-kv-cache*.cpp``, version 0.6.0-dev):

* **Weights.** ``-ngl N``: ``i_gpu_start = max(n_layer + 1 - N, 0)``; block ``il`` is on the GPU when
  ``il >= i_gpu_start`` and the output layer (``output.weight``, ``output_norm.weight``; index
  ``n_layer``) when ``N >= 1``. ``token_embd`` (the input layer) always stays on the CPU. A file
  without ``output.weight`` (tied embeddings) gets a copy of ``token_embd`` as its output layer.
* **KV cache.** Cells = ``ctx_size`` rounded up to 256 per slot (``n_ctx_seq = pad(ctx / parallel, 256)``,
  one stream per slot unless the cache is unified: the total stays ``ctx_size``). Per layer and cell:
  ``n_head_kv(il) × key_length`` K elements and ``n_head_kv(il) × value_length`` V elements at the cache
  type's size (f16 2 B, q8_0 34/32 B, q4_0 18/32 B; ``gguf.GGML_QUANT_SIZES``). A sliding-window layer
  holds ``pad(min(cells, sliding_window + ubatch), 256)`` cells per stream (``llama-kv-cache-iswa.cpp``).
  The KV cache of a layer lives where the layer lives.
* **Compute buffers** are sized by ggml's graph allocator at load (``sched_reserve``: a worst-case
  graph of ``ubatch`` tokens with one output per slot, ``n_outputs_max``): no closed formula exists.
  The estimate here is the largest set of f32 activations alive at once: a layer stage
  ``ubatch × (3 n_ff + 4 n_embd + (n_head + 2 n_head_kv) × head_dim) × 4 B`` plus the attention mask
  ``ubatch × cells × 2 B`` (flash attention) or the attention scores ``ubatch × cells × n_head × 4 B``
  (without), or the logits stage ``slots × (n_vocab + n_embd) × 4 B``, whichever is larger, times
  :data:`COMPUTE_MARGIN`. Checked against the ``compute buffer size`` line the real llama-server prints
  with ``--verbose`` (SmolLM2-135M, the reference flags: 11.35 MiB printed, 11.7 MiB estimated;
  tests/insight/test_budget_real.py compares the CPU build at several settings).
* **CUDA context** (driver context, loaded kernels) :data:`CUDA_CONTEXT_MIB`, which a CUDA build pays
  even with ``-ngl 0`` (it still reserves a compute buffer on the GPU for offloaded batch work), plus
  :data:`CUDA_RUNTIME_MIB` (cuBLAS workspace, ggml's CUDA memory pool) once layers run on the GPU:
  per-GPU constants, not derived from the model. Calibrated on two H200 runs (SmolLM2-135M Q4_1):
  ``-ngl 0 -c 512`` (526 MiB by NVML for the server's pid; a bare torch process's context: ~518 MiB)
  and the reference ``-ngl 99 -c 8192 -np 1 -b 512 -ub 256 -ctk q8_0 -ctv q8_0 -fa on`` (790–796 MiB,
  of which weights + KV cache + compute are 199 MiB, the same figure llama.cpp's own ``-fit``
  projection prints). Six other flag sets measured there (context 32768, f16 KV cache, flash attention
  off, micro-batch 1024, 4 slots, -ngl 10) agree within 2 % (tests/insight/test_budget_h200_fixture.py).
  Another GPU/driver can differ by a few hundred MiB: ``scripts/gpu_insight.py`` measures it.

All sizes are bytes unless a name says MiB.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from llama_guard.insight.model_facts import ModelFacts, split_tensors
from llama_guard.vocab.units import MIB

CELL_PAD = 256
COMPUTE_MARGIN = 1.0
# Measured, not derived (H200, driver 580, CUDA 13; tests/fixtures/h200_vram/vram_measure.json):
# the CUDA context any process pays (a torch process: ~518 MiB; llama-server with -ngl 0 -c 512:
# 526 MiB by NVML minus its ~8 MiB compute buffer), and what running layers on the GPU adds on top
# (cuBLAS workspace, ggml's CUDA memory pool): the reference run's 790 MiB minus 199 MiB of weights,
# KV cache and compute buffers minus the context. See the module docstring and docs/insight.md.
CUDA_CONTEXT_MIB = 518
CUDA_RUNTIME_MIB = 75
CUDA_OVERHEAD_MIB = CUDA_CONTEXT_MIB + CUDA_RUNTIME_MIB
CACHE_CAVEATS = {
    "q8_0": "q8_0 KV cache: about half of f16, quality loss negligible in published perplexity tests",
    "q4_0": "q4_0 KV cache: about a quarter of f16, measurable quality loss (long contexts, reasoning); "
            "test on your own prompts",
}


def cache_type_bytes(cache_type: str) -> float:
    """Bytes per element of a KV cache type (``f16`` → 2.0, ``q8_0`` → 1.0625, ``q4_0`` → 0.5625),
    from ``gguf.GGML_QUANT_SIZES`` (block size, block bytes). Raises :class:`ValueError` for an
    unknown type name."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType[cache_type.upper()]
    except KeyError:
        raise ValueError(f"unknown KV cache type {cache_type!r}") from None
    block, size = GGML_QUANT_SIZES[qtype]
    return float(size) / float(block)


@dataclass(frozen=True)
class Settings:
    """The ``[server]`` knobs the budget depends on (llama-server's flag in each comment)."""

    n_gpu_layers: int = 999          # -ngl
    ctx_size: int = 8192             # -c (0 = the model's training context)
    parallel: int = 1                # -np
    batch_size: int = 512            # -b
    ubatch_size: int = 256           # -ub
    cache_type_k: str = "f16"        # -ctk
    cache_type_v: str = "f16"        # -ctv
    flash_attn: str = "auto"         # -fa on|off|auto (auto is counted as on: the CUDA build enables it)
    kv_unified: bool = False         # --kv-unified

    @classmethod
    def from_server(cls, server: Any) -> Settings:
        """From a :class:`llama_guard.config.server.ServerConfig` (``--kv-unified`` read from ``extra_args``)."""
        return cls(n_gpu_layers=server.n_gpu_layers, ctx_size=server.ctx_size, parallel=server.parallel,
                   batch_size=server.batch_size, ubatch_size=server.ubatch_size,
                   cache_type_k=server.cache_type_k, cache_type_v=server.cache_type_v,
                   flash_attn=server.flash_attn, kv_unified="--kv-unified" in server.extra_args)


@dataclass(frozen=True)
class Budget:
    """One configuration's VRAM need (bytes) and, when known, the VRAM available to it."""

    weights_gpu: int
    weights_cpu: int
    kv_cache: int
    kv_cache_cpu: int
    compute: int
    overhead: int
    layers_on_gpu: int
    n_layer: int
    kv_cells: int
    available: int | None = None
    available_source: str = ""

    @property
    def total(self) -> int:
        """Bytes the server is predicted to hold on the GPU."""
        return self.weights_gpu + self.kv_cache + self.compute + self.overhead

    @property
    def fits(self) -> bool | None:
        """Whether :attr:`total` fits in :attr:`available` (None: nothing to compare with)."""
        return None if self.available is None else self.total <= self.available

    def as_dict(self) -> dict[str, Any]:
        """JSON form, sizes in MiB (floats, one decimal) with the bytes alongside."""
        out: dict[str, Any] = asdict(self)
        for key in ("weights_gpu", "weights_cpu", "kv_cache", "kv_cache_cpu", "compute", "overhead"):
            out[f"{key}_mib"] = round(out[key] / MIB, 1)
        out["total"] = self.total
        out["total_mib"] = round(self.total / MIB, 1)
        out["available_mib"] = None if self.available is None else round(self.available / MIB, 1)
        out["fits"] = self.fits
        return out


def layers_on_gpu(n_layer: int, n_gpu_layers: int) -> tuple[range, bool]:
    """The blocks on the GPU and whether the output layer is there (llama-model.cpp's rule)."""
    start = max(n_layer + 1 - n_gpu_layers, 0)
    return range(min(start, n_layer), n_layer), n_gpu_layers >= 1


def kv_cells(facts: ModelFacts, s: Settings) -> tuple[int, int]:
    """(cells per stream, streams): ``pad(ctx / parallel, 256)`` and ``parallel`` (1 when unified)."""
    ctx = s.ctx_size or facts.n_ctx_train or 4096
    if s.kv_unified:
        return _pad(ctx), 1
    return _pad(max(1, ctx // s.parallel)), s.parallel


def _pad(n: int, to: int = CELL_PAD) -> int:
    return int(math.ceil(n / to) * to)


def kv_cache_bytes(facts: ModelFacts, s: Settings, layers: range | None = None) -> int:
    """KV cache bytes of ``layers`` (default: all) at ``s``'s context, slots and cache types."""
    cells, streams = kv_cells(facts, s)
    k_b, v_b = cache_type_bytes(s.cache_type_k), cache_type_bytes(s.cache_type_v)
    total = 0.0
    for il in layers if layers is not None else range(facts.n_layer):
        n = cells
        if facts.is_swa(il):
            n = _pad(min(cells, facts.sliding_window * (streams if s.kv_unified else 1) + s.ubatch_size))
        total += n * streams * _cell_bytes(facts, il, k_b, v_b)
    return int(total)


def _cell_bytes(facts: ModelFacts, il: int, k_b: float, v_b: float) -> float:
    kv_heads = facts.n_head_kv[il] if il < len(facts.n_head_kv) else facts.n_head_kv[-1]
    k_dim, v_dim = facts.head_dims(il)
    return kv_heads * (k_dim * k_b + v_dim * v_b)


def kv_read_bytes(facts: ModelFacts, s: Settings, context: int, layers: range | None = None) -> int:
    """KV cache bytes one decode step reads at ``context`` tokens of one sequence: every cell up to
    the context (a sliding-window layer: up to its window) of ``layers`` (default: all)."""
    k_b, v_b = cache_type_bytes(s.cache_type_k), cache_type_bytes(s.cache_type_v)
    total = 0.0
    for il in layers if layers is not None else range(facts.n_layer):
        n = min(context, facts.sliding_window) if facts.is_swa(il) else context
        total += n * _cell_bytes(facts, il, k_b, v_b)
    return int(total)


def weights_read_bytes(facts: ModelFacts, s: Settings, *, gpu: bool) -> int:
    """Weight bytes one decode step reads: with a GPU, the offloaded ones (blocks on the GPU and the
    output layer); without, every block and the output layer. ``token_embd`` is never read whole
    (one row per token)."""
    if gpu:
        return estimate(facts, s, overhead_mib=0).weights_gpu
    per_layer, _, output_bytes, embd = split_tensors(facts.tensors)
    if not any(t.name == "output.weight" for t in facts.tensors):
        output_bytes += embd
    return sum(per_layer.values()) + output_bytes


def compute_bytes(facts: ModelFacts, s: Settings) -> int:
    """The compute-buffer estimate of the module docstring (bytes)."""
    cells, streams = kv_cells(facts, s)
    ub = min(s.ubatch_size, s.batch_size)
    n_kv = cells * streams if s.kv_unified or streams == 1 else cells
    head_dim = max(facts.key_length, facts.value_length)
    kv_heads = max(facts.n_head_kv) if facts.n_head_kv else facts.n_head
    # The server asks for the logits of the last token of each sequence only (n_outputs_max = slots).
    logits = (streams if not s.kv_unified else s.parallel) * (facts.n_vocab + facts.n_embd) * 4
    layer = ub * (3 * facts.n_ff + 4 * facts.n_embd + (facts.n_head + 2 * kv_heads) * head_dim) * 4
    if s.flash_attn == "off":
        layer += ub * n_kv * facts.n_head * 4  # KQ; the softmax reuses its memory (ggml-alloc in place)
    else:
        layer += ub * n_kv * 2
    return int(max(logits, layer) * COMPUTE_MARGIN)


def estimate(facts: ModelFacts, s: Settings, *, available: int | None = None, available_source: str = "",
             overhead_mib: float = CUDA_OVERHEAD_MIB, gpu_build: bool = False) -> Budget:
    """The budget of ``s`` for ``facts``. ``available``: VRAM bytes the server may use (free memory,
    or a stated size); ``overhead_mib``: the per-GPU CUDA constant (0 for a CPU-only estimate).
    With ``n_gpu_layers = 0`` nothing is counted unless ``gpu_build`` (a CUDA build on a host with a
    GPU), which still takes its CUDA context and a compute buffer."""
    per_layer, input_bytes, output_bytes, embd = split_tensors(facts.tensors)
    # Tied embeddings (no output.weight): llama.cpp copies token_embd to the GPU as the output layer;
    # on the host it stays one tensor of the file (counted once, in input_bytes).
    tied_copy = embd if not any(t.name == "output.weight" for t in facts.tensors) else 0
    gpu_blocks, output_on_gpu = layers_on_gpu(facts.n_layer, s.n_gpu_layers)
    on_gpu = sum(per_layer.get(il, 0) for il in gpu_blocks) + (output_bytes + tied_copy if output_on_gpu else 0)
    on_host = (sum(size for il, size in per_layer.items() if il not in gpu_blocks) + input_bytes
               + (0 if output_on_gpu else output_bytes))
    kv_gpu = kv_cache_bytes(facts, s, gpu_blocks)
    kv_all = kv_cache_bytes(facts, s)
    offloaded = s.n_gpu_layers > 0
    cells, streams = kv_cells(facts, s)
    return Budget(
        weights_gpu=on_gpu, weights_cpu=on_host, kv_cache=kv_gpu, kv_cache_cpu=kv_all - kv_gpu,
        compute=compute_bytes(facts, s) if offloaded or gpu_build else 0,
        overhead=int(overhead_mib * MIB) if offloaded else
        int(min(overhead_mib, CUDA_CONTEXT_MIB) * MIB) if gpu_build else 0,
        layers_on_gpu=len(gpu_blocks), n_layer=facts.n_layer, kv_cells=cells * streams,
        available=available, available_source=available_source)


@dataclass(frozen=True)
class Step:
    """One rung of the ladder: the change, the bytes it saves, the budget after it, and its cost."""

    change: str
    saves: int
    total_after: int
    fits_after: bool | None
    caveat: str

    def as_dict(self) -> dict[str, Any]:
        """JSON form with MiB alongside the bytes."""
        out = asdict(self)
        out["saves_mib"] = round(self.saves / MIB, 1)
        out["total_after_mib"] = round(self.total_after / MIB, 1)
        return out


def ladder(facts: ModelFacts, s: Settings, budget: Budget, *, overhead_mib: float = CUDA_OVERHEAD_MIB) -> list[Step]:
    """The operators' ladder, each step on its own from ``s``: the largest context that fits, a q8_0
    then a q4_0 KV cache, a smaller micro-batch, the most offloaded layers that fit. A step that saves
    nothing is left out."""
    avail = budget.available

    def after(new: Settings) -> Budget:
        return estimate(facts, new, available=avail, overhead_mib=overhead_mib)

    steps: list[Step] = []

    def add(change: str, new: Settings, caveat: str) -> None:
        b = after(new)
        if b.total < budget.total:
            steps.append(Step(change, budget.total - b.total, b.total, b.fits, caveat))

    ctx = s.ctx_size or facts.n_ctx_train or 4096
    unit = CELL_PAD * (1 if s.kv_unified else s.parallel)
    best = _largest(lambda c: after(replace(s, ctx_size=c)), unit, ctx, unit) if avail is not None else None
    if best is not None and best < ctx:
        add(f"ctx_size = {best} (from {ctx})", replace(s, ctx_size=best),
            "prompts plus answers longer than that are refused by the server")
    elif avail is None or best is None:
        half = max(unit, _pad(ctx // 2, unit))
        if half < ctx:
            add(f"ctx_size = {half} (from {ctx})", replace(s, ctx_size=half),
                "prompts plus answers longer than that are refused by the server")
    for qtype in ("q8_0", "q4_0"):
        if cache_type_bytes(qtype) < max(cache_type_bytes(s.cache_type_k), cache_type_bytes(s.cache_type_v)):
            fa = "" if s.flash_attn != "off" else "; needs flash_attn = \"on\" for the V cache"
            add(f"cache_type_k = cache_type_v = \"{qtype}\"",
                replace(s, cache_type_k=qtype, cache_type_v=qtype, flash_attn=s.flash_attn), CACHE_CAVEATS[qtype] + fa)
    for ub in (128, 64):
        if ub < s.ubatch_size:
            add(f"ubatch_size = {ub} (from {s.ubatch_size})", replace(s, ubatch_size=ub),
                "prompt processing (prefill) gets slower")
            break
    if avail is not None and budget.fits is False:
        n_max = min(s.n_gpu_layers, facts.n_layer + 1)
        best_ngl = _largest(lambda n: after(replace(s, n_gpu_layers=n)), 1, n_max, 1)
        if best_ngl is not None and best_ngl < n_max:
            add(f"n_gpu_layers = {best_ngl} (from {s.n_gpu_layers})", replace(s, n_gpu_layers=best_ngl),
                f"{n_max - best_ngl} layers run on the CPU: generation slows down sharply (each token "
                "then waits for host memory)")
        elif best_ngl is None:
            add(f"n_gpu_layers = 0 (from {s.n_gpu_layers})", replace(s, n_gpu_layers=0),
                f"not even one layer fits next to the CUDA context (~{overhead_mib:.0f} MiB): "
                "everything runs on the CPU")
    return steps


def _largest(budget_of: Any, low: int, high: int, step: int) -> int | None:
    """The largest value in [low, high] (multiples of ``step``) whose budget fits; None if none does."""
    if not budget_of(low).fits:
        return None
    lo, hi = low // step, high // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if budget_of(mid * step).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * step
