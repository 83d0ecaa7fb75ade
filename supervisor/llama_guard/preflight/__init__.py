"""``llama-guard check``: what can be known before starting the server.

:func:`run_checks` runs every check row in report order; the rows are small functions, one module per
family: llama-server itself (:mod:`.server`: binary and flags, offload, model, sizes, port), the
process it would be (:mod:`.process`: its user, its API key, its rlimits), the GPU (:mod:`.gpu`: NVML,
the VRAM budget, the reset); the front door's and the exporter's rows are
:mod:`llama_guard.front.check`. The verdict and the node-health action are in
:mod:`llama_guard.preflight.check_report`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_guard.config import Config
from llama_guard.preflight.gpu import check_gpu, check_reset, check_vram
from llama_guard.preflight.process import check_api_key, check_credentials, check_limits
from llama_guard.preflight.server import (
    check_binary,
    check_model,
    check_offload,
    check_port,
    check_settings,
    check_slot_save_path,
)
from llama_guard.vocab.verdicts import CheckResult, Verdict


def run_checks(config: Config, config_path: Path, *, nvml_module: Any = None) -> list[CheckResult]:
    """Every preflight check, in report order; ``nvml_module`` as for :func:`~llama_guard.preflight.gpu.check_gpu`."""
    results = [CheckResult("config", Verdict.OK, str(config_path))]
    results += check_binary(config)
    results += check_offload(config)
    model = check_model(config)
    results.append(model)
    results += check_settings(config)
    results += check_slot_save_path(config)
    results.append(check_port(config))
    from llama_guard.front.check import check_front, check_metrics  # they report in this module's terms

    results += [check_front(config), check_metrics(config)]
    results += check_credentials(config)
    results.append(check_api_key(config))
    results += check_limits(config)
    results += check_gpu(config, nvml_module=nvml_module)
    if model.verdict is Verdict.FAIL:  # never read a FIFO, a directory or a hung file for its metadata
        results.append(CheckResult("vram budget", Verdict.WARN, "not estimated: the model file failed its check"))
    else:
        results += check_vram(config, nvml_module=nvml_module)
    results.append(check_reset(config, nvml_module=nvml_module))
    return results
