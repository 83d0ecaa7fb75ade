"""The tuner's search: coordinate descent over :data:`llama_guard.tune.space.AXES` from the configured
flags, each knob's alternatives priced by the VRAM model first, then measured interleaved with the best
flag set so far, and a change kept only when it wins by more than the runs' spread and has survived a
full-context prefill.

How a knob is decided (one *group*: the incumbent and its alternatives that fit):

* ``rounds`` rounds; in each, every member of the group gets a server of its own and ``runs_per_round``
  completions, in an order rotated by one each round, so that a slow spell of the host lands on every
  member alike instead of on whichever ran last.
* A challenger wins when its median decode tokens/s is above every run of the incumbent **and** its
  slowest run is above the incumbent's median (:func:`beats`): it wins by more than the spread.
  Of several winners, the one with the highest median.
* Before a winner is kept, a server with its flags takes a prompt that fills one slot's context in its
  batch size (the "prefill spike" that runs a GPU out of memory); one that fails is recorded and never
  chosen, and the next winner is tried.
* A knob whose group would not finish before the deadline (``--minutes``, from the trials' mean time so
  far) is skipped and named in the result; a group that reaches the deadline ends after the round in
  progress (at least one round: a decision needs every member measured once).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llama_guard.config import Config
from llama_guard.insight.model_facts import ModelFacts
from llama_guard.tune.bench import RunFigures, RunTimings
from llama_guard.tune.price import Price, most_layers, price
from llama_guard.tune.space import Knob, Knobs, Space, alternatives
from llama_guard.tune.trial import TrialFailed, measure, started, vram_mib, worst_prefill


@dataclass
class Candidate(RunFigures):
    """One flag set's record: its price, its runs so far (all rounds), NVML's VRAM readings (MiB),
    whether it took the full-context prefill (None: not tried) and why it failed (None: it did not)."""

    knobs: Knobs
    price: Price
    runs: list[RunTimings] = field(default_factory=list)
    vram_mib: list[float] = field(default_factory=list)
    prefill_ok: bool | None = None
    failure: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"flags": self.knobs.as_server_update(), "label": self.knobs.label(),
                               "predicted_vram_mib": round(self.price.predicted_mib, 1),
                               "measured_vram_mib": round(max(self.vram_mib), 1) if self.vram_mib else None,
                               "runs": len(self.runs), "prefill_ok": self.prefill_ok, "failure": self.failure}
        if self.runs:
            out["eval_tokens_per_s"] = vars(self.eval)
            out["prompt_tokens_per_s"] = vars(self.prompt)
        return out


def beats(challenger: list[float], incumbent: list[float]) -> bool:
    """Whether ``challenger``'s runs (tokens/s) win over ``incumbent``'s by more than their spread: its
    median above the incumbent's fastest run and its slowest run above the incumbent's median."""
    if not challenger or not incumbent:
        return False
    return statistics.median(challenger) > max(incumbent) and min(challenger) > statistics.median(incumbent)


@dataclass
class KnobOutcome:
    """What one knob's group decided: the flag set before and after, the medians (tokens/s), the
    members measured, or why the knob was not explored (``skipped``)."""

    knob: Knob
    before: Knobs
    after: Knobs
    before_eval: float | None = None
    after_eval: float | None = None
    measured: int = 0
    priced_out: int = 0
    skipped: str = ""


@dataclass
class TuneResult:
    """The whole search: the baseline, the chosen flag set, every candidate, each knob's outcome."""

    baseline: Knobs
    best: Knobs
    candidates: dict[Knobs, Candidate]
    outcomes: list[KnobOutcome]
    elapsed_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def baseline_candidate(self) -> Candidate:
        return self.candidates[self.baseline]

    @property
    def best_candidate(self) -> Candidate:
        return self.candidates[self.best]


Say = Callable[[str], None]


class Search:
    """One tuning run. ``facts``: the model's GGUF facts; ``available_mib``: VRAM the server may use
    (None: no figure, nothing priced out); ``gpu_build``: whether a CUDA build on a GPU runs the trials;
    ``say``: progress lines (the terminal's stderr); ``log_dir``: the trial servers' logs."""

    def __init__(self, config: Config, facts: ModelFacts, space: Space, *, available_mib: float | None,
                 gpu_build: bool, log_dir: Path, say: Say, rounds: int = 2, nvml_module: Any = None,
                 timeout_s: float = 300.0) -> None:
        self.config, self.facts, self.space = config, facts, space
        self.available_mib, self.gpu_build = available_mib, gpu_build
        self.log_dir, self.say, self.rounds, self.nvml_module = log_dir, say, rounds, nvml_module
        self.timeout_s = timeout_s
        self.kv_unified = "--kv-unified" in config.server.extra_args
        runs = config.tune.runs
        self.runs_per_round = max(1, -(-runs // rounds))
        self.candidates: dict[Knobs, Candidate] = {}
        self.trial_seconds: list[float] = []

    def _candidate(self, k: Knobs) -> Candidate:
        if k not in self.candidates:
            self.candidates[k] = Candidate(k, price(self.facts, k, available_mib=self.available_mib,
                                                    margin_mib=self.config.tune.vram_margin_mib,
                                                    gpu_build=self.gpu_build, kv_unified=self.kv_unified))
        return self.candidates[k]

    def _trial(self, c: Candidate, *, prefill: bool = False) -> None:
        """One server for ``c``: ``runs_per_round`` completions, or (``prefill``) the worst prefill."""
        t0 = time.monotonic()
        try:
            with started(self.config, c.knobs, self.log_dir) as (url, pid):
                if prefill:
                    n = worst_prefill(url, self.config, c.knobs, self.facts.n_ctx_train, self.timeout_s)
                    c.prefill_ok = True
                    self.say(f"  full-context prefill of {n} tokens: ok")
                else:
                    c.runs.extend(measure(url, self.config, runs=self.runs_per_round,
                                          tokens=self.config.tune.tokens, timeout_s=self.timeout_s))
                reading = vram_mib(self.config, pid, self.nvml_module)
                if reading is not None:
                    c.vram_mib.append(reading)
        except TrialFailed as exc:
            c.failure = str(exc)
            if prefill:
                c.prefill_ok = False
            self.say(f"  {c.knobs.label()}: failed: {exc}")
        finally:
            self.trial_seconds.append(time.monotonic() - t0)

    def _group(self, members: list[Candidate], deadline: float) -> None:
        for r in range(self.rounds):
            if r and time.monotonic() > deadline:
                self.say(f"  the time is up after round {r}/{self.rounds}")
                break
            order = members[r % len(members):] + members[:r % len(members)]
            for c in order:
                if c.failure is None:
                    self._trial(c)
            alive = [c for c in members if c.failure is None and c.runs]
            speeds = ", ".join(f"{_short(c, members[0])} {c.eval.median:,.1f}" for c in alive)
            self.say(f"  round {r + 1}/{self.rounds}: {speeds}")

    def _cost_s(self, trials: int) -> float:
        mean = statistics.fmean(self.trial_seconds) if self.trial_seconds else 0.0
        return trials * mean

    def run(self, deadline: float) -> TuneResult:
        """Search until done or ``deadline`` (``time.monotonic()`` seconds). Raises :class:`TrialFailed`
        when the baseline itself cannot be measured (nothing to compare with)."""
        t0 = time.monotonic()
        configured = Knobs.from_config(self.config)
        baseline = self._candidate(configured)
        notes: list[str] = []
        self.say(f"baseline: {configured.label()}")
        self._group([baseline], deadline)
        if baseline.failure is not None or not baseline.runs:
            raise TrialFailed(f"the configured flags cannot be measured: {baseline.failure}")
        best = baseline
        layered = most_layers(self.facts, best.knobs, available_mib=self.available_mib,
                              margin_mib=self.config.tune.vram_margin_mib, gpu_build=self.gpu_build,
                              kv_unified=self.kv_unified)
        if layered != best.knobs:
            notes.append(f"n_gpu_layers {best.knobs.n_gpu_layers} → {layered.n_gpu_layers}: the most layers that fit")
            best = self._decide(best, [self._candidate(layered)], None, deadline) or best
        outcomes: list[KnobOutcome] = []
        for i, knob in enumerate(Knob, 1):
            alts = [self._candidate(k) for k in alternatives(knob, best.knobs, self.space)[1:]]
            fitting = [c for c in alts if c.price.fits and c.failure is None]
            outcome = KnobOutcome(knob, best.knobs, best.knobs, best.eval.median, best.eval.median,
                                  priced_out=sum(1 for c in alts if not c.price.fits))
            outcomes.append(outcome)
            head = f"[{i}/{len(Knob)}] {knob.value}:"
            priced = "".join(f"\n  priced out: {c.knobs.label()}: {c.price.why_not()}"
                             for c in alts if not c.price.fits)
            need = self._cost_s(self.rounds * (len(fitting) + 1))
            if not fitting:
                outcome.skipped = "no alternative" if not alts else "no alternative fits the VRAM budget"
            elif time.monotonic() + need > deadline:
                outcome.skipped = f"not explored: the time left (--minutes) is shorter than its ~{need:.0f} s"
            if outcome.skipped:
                self.say(f"{head} {outcome.skipped}{priced}")
                continue
            self.say(f"{head} {len(fitting)} alternative(s) against the best so far{priced}")
            new = self._decide(best, fitting, outcome, deadline)
            if new is not None:
                best = new
        if best.prefill_ok is None:
            self._trial(best, prefill=True)
            if best.prefill_ok is False:
                notes.append(f"the chosen flags failed the full-context prefill: {best.failure}; "
                             "keeping the configured flags")
                best = baseline
        return TuneResult(configured, best.knobs, self.candidates, outcomes, time.monotonic() - t0, notes)

    def _decide(self, best: Candidate, challengers: list[Candidate], outcome_knob: KnobOutcome | None,
                deadline: float) -> Candidate | None:
        """Measure ``best`` against ``challengers``; the winner that took the worst prefill, or None."""
        members = [best, *challengers]
        best.runs.clear()  # measured again alongside the challengers: the same spell of the host for all
        self._group(members, deadline)
        if outcome_knob is not None:
            outcome_knob.measured = len(challengers)
            outcome_knob.before_eval = best.eval.median if best.runs else None
        winners = sorted((c for c in challengers if c.failure is None
                          and beats([r.predicted_per_second for r in c.runs],
                                    [r.predicted_per_second for r in best.runs])),
                         key=lambda c: c.eval.median, reverse=True)
        for c in winners:
            if c.prefill_ok is None:
                self._trial(c, prefill=True)
            if c.prefill_ok:
                if outcome_knob is not None:
                    outcome_knob.after, outcome_knob.after_eval = c.knobs, c.eval.median
                self.say(f"  kept: {_short(c, best)} ({best.eval.median:,.1f} → {c.eval.median:,.1f} tokens/s)")
                return c
        if outcome_knob is not None:
            outcome_knob.after_eval = outcome_knob.before_eval
        self.say("  kept the best so far: no alternative wins by more than the spread")
        return None


def _short(c: Candidate, ref: Candidate) -> str:
    changed = c.knobs.changes_from(ref.knobs)
    return ",".join(f"{k}={v[1]}" for k, v in changed.items()) or "best"

