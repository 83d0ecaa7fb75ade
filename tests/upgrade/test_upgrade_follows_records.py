"""The build port learns the policy's state from the loop's records (``on_transition``), never by
reading the live state: a build found replaced in place at a start asks for its trial only when the
last record shows none under way."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from llama_guard.config import Config
from llama_guard.host.build import Build
from llama_guard.model.inputs import Input, Tick, TrialAsked
from llama_guard.model.transition import Transition
from llama_guard.model.types import State, Trial, TrialStage
from llama_guard.model.watcher import Context
from llama_guard.upgrade.figures import flags_key, record
from llama_guard.upgrade.watcher import UpgradeSource
from llama_guard.vocab.phases import Phase


async def test_a_replaced_build_asks_for_its_trial_by_what_the_records_say(tmp_path: Path) -> None:
    cfg = Config.model_validate({"runtime": {"dir": str(tmp_path)}, "server": {"model": "/m.gguf"}})
    posted: list[Input] = []
    ctx = Context(get_config=lambda: cfg, emit=lambda name, **f: None, post=posted.append,
                  post_threadsafe=posted.append, clock=lambda: 0.0, loop=asyncio.get_running_loop())
    source = UpgradeSource()
    exe = tmp_path / "bin" / "llama-server"
    good, replaced = Build(exe, "a" * 64, "version: 1", "b1"), Build(exe, "b" * 64, "version: 2", "b2")
    source.lineage.serving = good
    record(source._root(cfg), {good.sha256: 42.0}, flags_key(cfg))

    idle = State()
    on_trial = replace(idle, phase=Phase.STARTING, trial=Trial(TrialStage.NEW, old_tps=40.0, spawned=True))
    source.on_transition(ctx, Transition(idle, on_trial, Tick(), (), 1.0))
    await source._ask_trial(ctx, replaced)
    assert posted == []  # the last record shows a trial under way: not asked again

    starting = replace(idle, phase=Phase.STARTING)
    source.on_transition(ctx, Transition(on_trial, starting, Tick(), (), 2.0))
    await source._ask_trial(ctx, replaced)
    assert posted == [TrialAsked(42.0)]  # compared with the good build's recorded figure
