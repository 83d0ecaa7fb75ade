#!/usr/bin/env python3
"""What the preflight of a new llama-server build costs (llama_guard.upgrade.preflight): the binary's
SHA-256, a bounded ``--version`` and a bounded ``--help`` with the flags check — the time a reload
naming a new build, or the first start of a build not seen before, spends before anything else
(the serving server is untouched meanwhile). A build already preflighted (same path, same file) is
cached by the watcher and costs nothing at later starts.

    . .work/real/env && .venv/bin/python benchmarks/bench_preflight.py [--rounds 10] [--server-bin PATH]

Prints the median and the slowest of ``--rounds`` preflights, and the load average at both ends (how
much to trust the figures on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from llama_guard.config import Config
from llama_guard.upgrade.preflight import preflight


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-bin", default=os.environ.get("LLAMA_SERVER_BIN", ""))
    parser.add_argument("--model", default=os.environ.get("LLAMA_GUARD_TEST_MODEL", ""))
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    binary = Path(args.server_bin)
    with tempfile.TemporaryDirectory() as tmp:
        config = Config.model_validate({"server": {"binary": str(binary), "model": args.model},
                                        "runtime": {"dir": tmp}})
        print(f"load average at start: {os.getloadavg()}")
        took = []
        for _ in range(args.rounds):
            start = time.monotonic()
            result = preflight(config, binary)
            took.append(time.monotonic() - start)
            if not result.passed:
                print(f"preflight failed: {result.cause}")
                return 1
        assert result.build is not None
        print(f"build {result.build.release} ({binary}): preflight median {statistics.median(took) * 1000:.0f} ms, "
              f"slowest {max(took) * 1000:.0f} ms over {args.rounds} rounds")
        print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
