#!/usr/bin/env python3
"""``llama-guard <verb> ...`` with the scriptable fake NVML (tests/fake_pynvml_mod.py) injected as the
pynvml module — the CLI's own run/check paths, wired as in production except for that module.

Tests start the daemon as ``python tests/run_with_fake_nvml.py run --config X`` (see harness.DaemonRun's
``command``); the fake is scripted through ``$FAKE_NVML_SCRIPT`` / ``$FAKE_NVML_STATE``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fake_pynvml_mod
from llama_guard.app.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], nvml_module=fake_pynvml_mod))
