"""The tuner's result as the motivating write-up's table (each knob, baseline → tuned, its effect on
decode tokens/s), the final speed against the bandwidth ceiling, the VRAM left, and every trial's
predicted vs measured VRAM; and the same as JSON (``tune --json``)."""

from __future__ import annotations

from typing import Any

from llama_guard.tune.search import TuneResult


def _pct(before: float | None, after: float | None) -> str:
    if not before or after is None:
        return ""
    return f"{(after / before - 1) * 100:+.1f} %"


def table(result: TuneResult, ceiling: dict[str, Any] | None, available_mib: float | None) -> list[str]:
    """Human lines: one row per knob, then the totals."""
    base, best = result.baseline_candidate, result.best_candidate
    rows = [f"{'knob':<12} {'baseline':<18} {'tuned':<18} {'decode tokens/s':<22} effect"]
    for o in result.outcomes:
        changed = o.after.changes_from(o.before)
        if o.skipped:
            rows.append(f"{o.knob.value:<12} {'':<18} {'':<18} {'':<22} {o.skipped}")
            continue
        was = ", ".join(f"{v[0]}" for v in changed.values()) or "="
        now = ", ".join(f"{v[1]}" for v in changed.values()) or "="
        speeds = (f"{o.before_eval:,.1f} → {o.after_eval:,.1f}" if o.before_eval is not None
                  and o.after_eval is not None else "")
        effect = _pct(o.before_eval, o.after_eval) if changed else (
            f"kept ({o.measured} tried" + (f", {o.priced_out} priced out" if o.priced_out else "") + ")")
        rows.append(f"{o.knob.value:<12} {was:<18} {now:<18} {speeds:<22} {effect}")
    rows.append("")
    rows.append(f"baseline: {result.baseline.label()}")
    rows.append(f"tuned:    {result.best.label()}")
    rows.append(f"decode {base.eval.median:,.1f} → {best.eval.median:,.1f} tokens/s median "
                f"({_pct(base.eval.median, best.eval.median)}); prompt {base.prompt.median:,.1f} → "
                f"{best.prompt.median:,.1f} tokens/s (last measured alongside each other where the tuned flags won)")
    if ceiling and ceiling.get("verdict"):
        rows.append(f"ceiling: {ceiling['verdict']}")
    predicted = best.price.predicted_mib
    if available_mib is not None:
        rows.append(f"VRAM: predicted {predicted:,.0f} MiB of {available_mib:,.0f} MiB available: "
                    f"{available_mib - predicted:,.0f} MiB left")
    tried = sum(1 for c in result.candidates.values() if c.runs or c.failure)
    rows.append(f"{tried} flag sets tried in {result.elapsed_s:,.0f} s (predicted VRAM vs NVML, speed):")
    for c in result.candidates.values():
        if c.runs or c.failure:
            vram = f"NVML {max(c.vram_mib):,.0f} MiB" if c.vram_mib else "NVML —"
            state = f"failed: {c.failure}" if c.failure else f"{c.eval.median:,.1f} tokens/s ({len(c.runs)} runs)"
            rows.append(f"  {c.knobs.label()}: predicted {c.price.predicted_mib:,.0f} MiB, {vram}; {state}")
    rows += [f"note: {n}" for n in result.notes]
    return rows


def document(result: TuneResult, ceiling: dict[str, Any] | None, available_mib: float | None) -> dict[str, Any]:
    """``tune --json``: the same as :func:`table`, for scripts."""
    return {
        "baseline": result.baseline.as_server_update(), "tuned": result.best.as_server_update(),
        "changes": {k: list(v) for k, v in result.best.changes_from(result.baseline).items()},
        "baseline_eval_tokens_per_s": result.baseline_candidate.eval.median,
        "tuned_eval_tokens_per_s": result.best_candidate.eval.median,
        "knobs": [{"knob": o.knob.value, "before": o.before.as_server_update(), "after": o.after.as_server_update(),
                   "before_eval": o.before_eval, "after_eval": o.after_eval, "measured": o.measured,
                   "priced_out": o.priced_out, "skipped": o.skipped} for o in result.outcomes],
        "candidates": [c.as_dict() for c in result.candidates.values()],
        "ceiling": ceiling, "available_vram_mib": available_mib, "elapsed_s": result.elapsed_s,
        "notes": result.notes,
    }
