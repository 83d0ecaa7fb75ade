"""The child process of :func:`llama_guard.preflight.vram_check.need_mib_in_child`: a JSON request
``{"model": path, "settings": {...Settings fields}}`` on stdin, the need in MiB (or ``null`` when the
model cannot be read) on stdout. Imports only the budget and the GGUF reader: no configuration model
(pydantic), so the child starts in a fraction of a second."""

from __future__ import annotations

import json
import sys

from llama_guard.insight.budget import Settings, estimate
from llama_guard.insight.model_facts import ModelFactsError, read_model_facts
from llama_guard.vocab.units import MIB

# The admission waits for this share of the estimate: the estimate is ±10 %, and a wait that was not
# needed costs more (a delayed start) than one too short (the start then fails and is retried).
ADMISSION_SHARE = 0.9


def main() -> int:
    request = json.loads(sys.stdin.read())
    try:
        facts = read_model_facts(request["model"])
    except ModelFactsError:
        print("null")
        return 0
    budget = estimate(facts, Settings(**request["settings"]), gpu_build=True)
    print(int(budget.total * ADMISSION_SHARE / MIB))
    return 0


if __name__ == "__main__":
    sys.exit(main())
