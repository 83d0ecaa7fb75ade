#!/usr/bin/env python3
"""A stand-in for ``nvidia-smi --gpu-reset`` that resets NOTHING: it appends its argv to a record
file and prints nvidia-smi's success line. For machines whose GPU must not be reset (shared test
hardware) and for dry runs: ``reset_command = ["python3", "scripts/stub_gpu_reset.py", RECORD, "{index}"]``.
"""

import sys
import time

record, index = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "?"
with open(record, "a", encoding="utf-8") as handle:
    handle.write(f"{time.time():.3f} stub reset of GPU index {index}: argv={sys.argv}\n")
print(f"GPU index {index} was successfully reset. (stub: nothing was reset)")
