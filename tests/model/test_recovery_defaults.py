"""The restart defaults: the policy's Params equal the config's defaults, and at those defaults a fault
that clears within a minute (and more) is ridden out while the first restart stays immediate."""

from __future__ import annotations

import dataclasses

import pytest
from llama_guard.config import Config
from llama_guard.model.inputs import Boot, Exited, Spawned, Tick
from llama_guard.model.policy import decide
from llama_guard.model.types import Params, initial_state
from llama_guard.vocab.phases import Phase


def test_policy_params_defaults_are_the_config_defaults() -> None:
    """model.types.Params and the config sections name the same knobs; their defaults must agree (a
    policy built without a config behaves as the shipped defaults)."""
    sections = {name: f.annotation for name, f in Config.model_fields.items()}
    compared = 0
    for field in dataclasses.fields(Params):
        ours = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        for section in sections.values():
            spec = getattr(section, "model_fields", {}).get(field.name)
            if spec is not None:
                theirs = spec.get_default(call_default_factory=True)
                if isinstance(ours, frozenset):  # a set of enums against a list of their values
                    ours, theirs = {m.value for m in ours}, {getattr(v, "value", v) for v in theirs}
                assert theirs == ours, field.name
                compared += 1
    assert compared >= 10


def test_default_backoff_rides_out_a_minute_and_keeps_the_first_restart_immediate() -> None:
    """The default waits between restarts of a server that fails at once, until the crash loop: the
    last start is made more than a minute after the first failure, the first restart is immediate."""
    params = Params()
    s, _ = decide(initial_state(params), Boot(), 0.0)
    now, pid, starts = 0.0, 100, []
    while s.phase is not Phase.EXITED:
        s, _ = decide(s, Spawned(pid), now)
        starts.append(now)
        # a different way each time (no deterministic verdict): this is about the budget
        s, _ = decide(s, Exited(pid, 1 + pid % 50), now + 0.1)
        if s.phase is Phase.BACKOFF:
            now = s.deadline if s.deadline is not None else now
            s, _ = decide(s, Tick(), now)
        pid += 1
    assert starts[1] - starts[0] == pytest.approx(0.1)  # the first restart: at once after the exit
    assert len(starts) == params.max_restarts + 1
    assert starts[-1] - starts[0] > 2 * 60  # a fault that clears within two minutes is ridden out
