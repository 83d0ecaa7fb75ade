"""Pricing a flag set before it is started: ``check``'s VRAM model (:func:`llama_guard.insight.budget.estimate`)
against the VRAM available minus ``[tune].vram_margin_mib``, and the most layers that fit.

Pure apart from reading nothing: the model's facts and the available VRAM are given."""

from __future__ import annotations

from dataclasses import dataclass, replace

from llama_guard.insight.budget import Settings, estimate
from llama_guard.insight.model_facts import ModelFacts
from llama_guard.tune.space import Knobs
from llama_guard.vocab.units import MIB


@dataclass(frozen=True)
class Price:
    """A flag set's predicted VRAM (MiB, CUDA context included; 0 when nothing is on a GPU), the budget it
    was held against (MiB after the margin; None: no VRAM figure) and whether it fits."""

    predicted_mib: float
    budget_mib: float | None

    @property
    def fits(self) -> bool:
        return self.budget_mib is None or self.predicted_mib <= self.budget_mib

    def why_not(self) -> str:
        return (f"predicted {self.predicted_mib:,.0f} MiB of VRAM > {self.budget_mib:,.0f} MiB "
                f"(available minus [tune].vram_margin_mib)")


def settings_of(k: Knobs, kv_unified: bool = False) -> Settings:
    """The budget's view of a flag set."""
    return Settings(n_gpu_layers=k.n_gpu_layers, ctx_size=k.ctx_size, parallel=k.parallel, batch_size=k.batch_size,
                    ubatch_size=k.ubatch_size, cache_type_k=k.cache_type_k, cache_type_v=k.cache_type_v,
                    flash_attn=k.flash_attn, kv_unified=kv_unified)


def price(facts: ModelFacts, k: Knobs, *, available_mib: float | None, margin_mib: float, gpu_build: bool,
          kv_unified: bool = False) -> Price:
    """``k``'s VRAM need against ``available_mib`` − ``margin_mib`` (MiB)."""
    total = estimate(facts, settings_of(k, kv_unified), gpu_build=gpu_build).total / MIB
    budget = None if available_mib is None else available_mib - margin_mib
    return Price(predicted_mib=total, budget_mib=budget)


def most_layers(facts: ModelFacts, k: Knobs, *, available_mib: float | None, margin_mib: float,
                gpu_build: bool, kv_unified: bool = False) -> Knobs:
    """``k`` with ``n_gpu_layers`` = every layer (``n_layer + 1``: the output layer too) when that fits,
    else the most that fit (0 when not even one does). Unchanged without a VRAM figure or a GPU."""
    if available_mib is None or not gpu_build:
        return k
    full = facts.n_layer + 1
    for n in range(full, -1, -1):
        if price(facts, replace(k, n_gpu_layers=n), available_mib=available_mib, margin_mib=margin_mib,
                 gpu_build=gpu_build, kv_unified=kv_unified).fits:
            return k if n == full and k.n_gpu_layers >= full else replace(k, n_gpu_layers=n)
    return replace(k, n_gpu_layers=0)
