"""``llama-guard tune``: the fastest ``[server]`` flags that fit the GPU, found by measurement on the real
server, from the configured flags (the baseline), within ``--minutes``.

The trials need the GPU and the CPU to themselves (measured beside a serving server, its clients would
pick the winner): with a daemon serving the configuration, tune runs them in a window the daemon lends
(:mod:`.window`: its server drained and stopped, the front door holding clients; started again when tune
ends, from the file ``--apply`` wrote); without one, on the GPU as it is. A stop (Ctrl-C, SIGTERM) at any
moment stops the trial server that runs and leaves the file as it was; ``--apply`` writes the file
only after the whole search, atomically (:mod:`.apply`).

Exit codes: 0 done (tuned or nothing better found), 1 the baseline cannot be measured, the file
cannot be written or the daemon lends no window, 78 configuration error, 130 stopped."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from llama_guard.config import Config
from llama_guard.insight.model_facts import ModelFacts, ModelFactsError, read_model_facts
from llama_guard.model.types import LendEnd
from llama_guard.tune.apply import ApplyError, apply_changes
from llama_guard.tune.bench import BenchResult, ceiling_for
from llama_guard.tune.report import document, table
from llama_guard.tune.search import Search
from llama_guard.tune.space import Space
from llama_guard.tune.trial import TrialFailed
from llama_guard.tune.window import WindowRefused, lent_window
from llama_guard.vocab.exitcodes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK
from llama_guard.vocab.units import MIB

EXIT_STOPPED = 130  # the shell's code for a run ended by SIGINT


class Stopped(BaseException):
    """SIGTERM during the search (raised in the main thread, like KeyboardInterrupt for SIGINT)."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Stopped


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_tune(path: Path, config: Config, *, minutes: float, apply: bool, as_json: bool,
             nvml_module: Any = None) -> int:
    """The verb: search, print, optionally apply; in a window the daemon lends when one serves this
    configuration (:mod:`.window`), else on the GPU as it is."""
    from llama_guard.status.status import locate_daemon

    found = locate_daemon(config.runtime.dir)
    try:
        facts = read_model_facts(config.server.model)
    except ModelFactsError as exc:
        _say(f"llama-guard: tune: {exc}")
        return EXIT_CONFIG
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if found.pid is None:
            return _tune(path, config, facts, minutes=minutes, apply=apply, as_json=as_json, nvml_module=nvml_module)
        _say(f"tune: asking llama-guard pid {found.pid} for the GPU (it drains and stops its llama-server; "
             "the front door holds clients meanwhile)")
        with lent_window(config, minutes, found.pid) as window:
            _say(f"tune: the GPU is lent for at most {window.bound_s:.0f} s; the daemon's server starts again "
                 "when tune ends")
            code = _tune(path, config, facts, minutes=minutes, apply=apply, as_json=as_json,
                         nvml_module=nvml_module)
            window.end = _END.get(code, LendEnd.FAILED)
            return code
    except WindowRefused as exc:
        _say(f"llama-guard: tune: {exc}; nothing changed")
        return EXIT_FAILURE
    except (KeyboardInterrupt, Stopped):
        return _stopped(path)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped(path: Path) -> int:
    """A stop (Ctrl-C, SIGTERM) in the search, which ends its window as stopped, or around it: said; 130."""
    _say(f"llama-guard: tune stopped; no trial server left running, {path} unchanged")
    return EXIT_STOPPED


#: How tune's exit status names the end of a window (any other: failed).
_END = {EXIT_OK: LendEnd.DONE, EXIT_STOPPED: LendEnd.STOPPED}


def _tune(path: Path, config: Config, facts: ModelFacts, *, minutes: float, apply: bool, as_json: bool,
          nvml_module: Any) -> int:
    """Search (the GPU's free VRAM read now: in a window, after the daemon's server stopped), print, apply."""
    from llama_guard.gpu.info import gpu_memory_facts

    gpu = gpu_memory_facts(config, nvml_module=nvml_module)
    available = None if gpu.available is None else gpu.available / MIB
    gpu_build = bool(gpu.name)
    on_cpu = not gpu_build or config.server.n_gpu_layers <= facts.n_layer
    space = Space.from_config(config, cpu_threads=len(os.sched_getaffinity(0)), cpu_layers=on_cpu)
    _say(f"tune: {config.server.model.name}, {minutes:g} min; VRAM "
         + (f"{available:,.0f} MiB available ({gpu.available_source}), margin {config.tune.vram_margin_mib} MiB"
            if available is not None else "not known: nothing priced out")
         + f"; {config.tune.runs} runs × {config.tune.tokens} tokens per flag set")
    try:
        with tempfile.TemporaryDirectory(prefix="llama-guard-tune-") as logs:
            search = Search(config, facts, space, available_mib=available, gpu_build=gpu_build, log_dir=Path(logs),
                            say=_say, nvml_module=nvml_module)
            result = search.run(time.monotonic() + minutes * 60)
    except TrialFailed as exc:
        _say(f"llama-guard: tune: {exc}")
        return EXIT_FAILURE
    except (KeyboardInterrupt, Stopped):
        return _stopped(path)
    best = result.best_candidate
    ceiling = ceiling_for(config.model_copy(update={"server": config.server.model_copy(
        update=result.best.as_server_update())}), BenchResult(url="", runs=best.runs, tokens=config.tune.tokens),
        nvml_module=nvml_module)
    if as_json:
        print(json.dumps(document(result, ceiling, available), indent=2, default=str))
    else:
        print("\n".join(table(result, ceiling, available)))
    changes = {k: v[1] for k, v in result.best.changes_from(result.baseline).items()}
    if apply and changes:
        try:
            apply_changes(path, changes)
        except ApplyError as exc:
            _say(f"llama-guard: tune --apply: {exc}")
            return EXIT_FAILURE
        _say(f"tune: wrote {', '.join(f'{k} = {v!r}' for k, v in changes.items())} to [server] of {path}")
    elif apply:
        _say(f"tune: the configured flags are the fastest found; {path} unchanged")
    return EXIT_OK
