"""``llama-guard check``'s VRAM budget: the model's GGUF metadata against the GPU's free memory."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from llama_guard.config import Config
from llama_guard.gpu.info import GpuMemoryFacts
from llama_guard.insight.budget import CUDA_OVERHEAD_MIB, Budget, Settings, Step, estimate, ladder
from llama_guard.insight.model_facts import ModelFactsError, read_model_facts
from llama_guard.insight.need_child import ADMISSION_SHARE
from llama_guard.vocab.units import MIB
from llama_guard.vocab.verdicts import Verdict

# A budget within this fraction of the available VRAM is a WARN: the estimate is ±10 %.
TIGHT_FRACTION = 0.9


@dataclass
class VramReport:
    """The verdict (OK, WARN, FAIL), one summary line, the budget and the ladder (when it does not fit)."""

    verdict: Verdict
    summary: str
    budget: Budget | None = None
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON form for ``check --json``."""
        return {"verdict": self.verdict, "summary": self.summary,
                "budget": None if self.budget is None else self.budget.as_dict(),
                "ladder": [s.as_dict() for s in self.steps], "notes": self.notes,
                "cuda_overhead_mib": CUDA_OVERHEAD_MIB}


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f}"


def vram_report(config: Config, gpu: GpuMemoryFacts) -> VramReport:
    """Read the model's metadata and estimate ``config``'s VRAM need against ``gpu``'s figure."""
    server = config.server
    try:
        facts = read_model_facts(server.model)
    except ModelFactsError as exc:
        return VramReport(Verdict.FAIL, f"cannot read the model's metadata: {exc}")
    settings = Settings.from_server(server)
    gpu_build = bool(gpu.name)  # NVML sees a GPU: a CUDA build there takes its context even at -ngl 0
    budget = estimate(facts, settings, available=gpu.available, available_source=gpu.available_source,
                      gpu_build=gpu_build)
    notes = list(facts.notes)
    if server.flash_attn == "auto":
        notes.append('flash_attn = "auto" counted as on (what the CUDA build picks on recent GPUs)')
    if server.n_gpu_layers == 0 and not gpu_build:
        return VramReport(Verdict.OK, f"n_gpu_layers = 0: nothing on the GPU (weights {_mib(budget.weights_cpu)} MiB "
                                f"and KV cache {_mib(budget.kv_cache_cpu)} MiB in host memory)", budget, notes=notes)
    cache = (server.cache_type_k if server.cache_type_k == server.cache_type_v
             else f"{server.cache_type_k}/{server.cache_type_v}")
    layers = f"{budget.layers_on_gpu}/{budget.n_layer} layers" + (" + output" if server.n_gpu_layers >= 1 else "")
    parts = (f"weights {_mib(budget.weights_gpu)} ({layers}) + KV cache {_mib(budget.kv_cache)} "
             f"({budget.kv_cells} cells, {cache}) + compute {_mib(budget.compute)} (ubatch {server.ubatch_size}) "
             f"+ CUDA context {_mib(budget.overhead)}")
    if budget.weights_cpu and budget.layers_on_gpu < budget.n_layer:
        parts += f"; {_mib(budget.weights_cpu)} MiB of weights stay in host memory"
    if budget.available is None:
        return VramReport(Verdict.OK, f"needs ~{_mib(budget.total)} MiB of VRAM = {parts}; no VRAM figure to compare "
                                f"with ({gpu.note or 'no GPU'}; [gpu].vram_total_mib states one)", budget, notes=notes)
    head = (f"needs ~{_mib(budget.total)} MiB of {_mib(budget.available)} MiB available "
            f"({budget.available_source}) = {parts}")
    if budget.fits:
        verdict = Verdict.WARN if budget.total > TIGHT_FRACTION * budget.available else Verdict.OK
        if verdict is Verdict.WARN:
            head += "; within the estimate's ±10 %: a long prompt may still fail"
        steps = ladder(facts, settings, budget) if verdict is Verdict.WARN else []
        return VramReport(verdict, head, budget, steps, notes)
    short = budget.total - budget.available
    return VramReport(Verdict.FAIL, f"does not fit: {_mib(short)} MiB short; {head}", budget,
                      ladder(facts, settings, budget), notes)


def report_lines(report: VramReport) -> list[tuple[Verdict, str, str]]:
    """``(verdict, name, detail)`` rows for ``check``'s table: the summary, then one row per ladder step."""
    rows = [(report.verdict, "vram budget", report.summary)]
    for step in report.steps:
        fits = "" if step.fits_after is None else (" → fits" if step.fits_after else " → still too big")
        rows.append((Verdict.HINT, "vram ladder", f"{step.change}: saves {step.saves / MIB:,.0f} MiB "
                                            f"(→ {step.total_after / MIB:,.0f} MiB{fits}); {step.caveat}"))
    rows += [(Verdict.NOTE, "vram budget", note) for note in report.notes]
    return rows


def estimated_need_mib(config: Config) -> int | None:
    """VRAM (MiB) the server of ``config`` is expected to need on a CUDA build, for the VRAM
    admission before a start when nothing was measured yet: 90 % of :func:`llama_guard.insight.budget.estimate`
    (CUDA context included). None when the model's metadata cannot be read or nothing is offloaded.
    Reads only the GGUF header and tensor index (blocking: call it in a thread)."""
    server = config.server
    if server.n_gpu_layers == 0:
        return None
    try:
        facts = read_model_facts(server.model)
    except ModelFactsError:
        return None
    return int(estimate(facts, Settings.from_server(server), gpu_build=True).total * ADMISSION_SHARE / MIB)


NEED_CHILD_TIMEOUT_S = 20.0  # a GGUF header that takes longer to read is not estimated


def need_mib_in_child(model: str, settings: Settings, timeout_s: float = NEED_CHILD_TIMEOUT_S) -> int | None:
    """The admission's need (MiB, 90 % of the estimate, CUDA context included) of ``model`` under
    ``settings``, computed by ``python -m llama_guard.insight.need_child``: reading a GGUF's metadata
    holds the GIL (0.5 s for SmolLM2-135M's header, more for a 150k-token vocabulary), which in the daemon
    would stall its event loop, and numpy would stay in the daemon's RSS. The child imports only the
    budget and the GGUF reader (not the configuration model). Blocking (call it in a thread); None when
    the child fails, times out (``timeout_s``) or cannot read the model, and when nothing is offloaded."""
    if settings.n_gpu_layers == 0:
        return None
    request = json.dumps({"model": model, "settings": dataclasses.asdict(settings)})
    try:
        done = subprocess.run([sys.executable, "-m", "llama_guard.insight.need_child"], input=request,
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        answer = json.loads(done.stdout or "null")
    except ValueError:
        return None
    return answer if isinstance(answer, int) and done.returncode == 0 else None
