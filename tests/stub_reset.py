#!/usr/bin/env python3
"""A stand-in for ``nvidia-smi --gpu-reset -i N`` (tests only: it never touches a GPU).

Appends one JSON line to ``$STUB_RESET_RECORD``: its argv and what the fake NVML's state file
(``$FAKE_NVML_STATE``) said at its start and end (was the daemon's NVML session released?).
``$STUB_RESET_MODE`` picks the outcome:

* ``ok`` (default): prints nvidia-smi's success line, exits 0; a fake GPU marked lost in
  ``$FAKE_NVML_SCRIPT`` comes back, and a recovery action "GPU reset" (1) there goes back to none
  (the reset "worked");
* ``fail``: prints nvidia-smi's "could not be reset" text, exits 1;
* ``hang``: sleeps far past any reset timeout.

Each record also has ``credentials``: the euid and capability masks it ran with.
``$STUB_RESET_SLEEP_S`` (default 0.5) is how long it takes, so the daemon has time to misbehave.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def nvml_state() -> object:
    path = os.environ.get("FAKE_NVML_STATE", "")
    try:
        return json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


def credentials() -> dict[str, object]:
    """Who this command runs as: effective uid and the capability masks of /proc/self/status."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"euid": os.geteuid(), "cap_eff": int(fields["CapEff"].strip(), 16),
            "cap_amb": int(fields["CapAmb"].strip(), 16), "no_new_privs": fields.get("NoNewPrivs", "").strip()}


def main(argv: list[str]) -> int:
    mode = os.environ.get("STUB_RESET_MODE", "ok")
    start_state = nvml_state()
    time.sleep(float(os.environ.get("STUB_RESET_SLEEP_S", "0.5")))
    if mode == "hang":
        time.sleep(3600)
    end_state = nvml_state()
    record = os.environ.get("STUB_RESET_RECORD", "")
    if record:
        with open(record, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"argv": argv, "mode": mode, "nvml_at_start": start_state,
                                     "nvml_at_end": end_state, "pid": os.getpid(),
                                     "credentials": credentials()}) + "\n")
    index = argv[argv.index("-i") + 1] if "-i" in argv[:-1] else "?"
    if mode == "fail":
        print("The following GPUs could not be reset:")
        print(f"  GPU 00000000:02:00.{index}: In use by another client")
        print("1 device is currently being used by one or more other processes (e.g., Fabric Manager, CUDA "
              "application, graphics application such as an X server, or a monitoring application such as "
              "another instance of nvidia-smi). Please first kill all processes using this device and all "
              "compute applications running in the system.")
        return 1
    script = os.environ.get("FAKE_NVML_SCRIPT", "")
    if script:
        try:
            data = json.loads(Path(script).read_text())
        except (OSError, ValueError):
            data = {}
        values = data.get("values") or {}
        if data.get("lost") or values.get("recovery_action") == 1:
            data["lost"] = False
            if values.get("recovery_action") == 1:  # a reset clears "GPU reset required"
                data["values"] = {**values, "recovery_action": 0}
            tmp = Path(script + ".stub")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, script)
    print(f"GPU 00000000:02:00.{index} was successfully reset.")
    print("All done.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
