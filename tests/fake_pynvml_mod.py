"""A module-level fake ``pynvml`` for the daemon SUBPROCESS, injected by tests/run_with_fake_nvml.py.

It wraps one :class:`fake_nvml.FakeNvml` and is scripted by the JSON file named in
``$FAKE_NVML_SCRIPT``, re-read on every call, so a test can change it while the daemon runs:

* ``"lost": true`` — every device call raises GpuIsLost (15) until it is false again;
* ``"processes": [[pid, bytes], ...]`` — compute processes on the GPU (e.g. a foreign one);
* ``"server_on_gpu": true`` — also list every CHILD of this (the daemon's) process whose
  ``/proc/<pid>/cmdline`` names ``fake_llama_server.py``, so ``ready_check`` sees the server on the GPU;
* ``"xids": [79, ...]`` — Xid events, delivered once each (the list only grows);
* ``"values": {...}`` — readings of :data:`fake_nvml.DEFAULTS` to override (memory_used ...).

NVML's session state (initialised or not, init/shutdown counts) is written to ``$FAKE_NVML_STATE``
after every init/shutdown, so a stub reset command can tell whether our NVML session was released.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import fake_nvml
from fake_nvml import FakeNvml, NVMLError

__all__ = ["NVMLError"]

SERVER_MARK = "fake_llama_server.py"
SERVER_BYTES = 600 * 1024**2

_FAKE = FakeNvml()
_LOCK = threading.RLock()
_xids_delivered = 0
_shutdowns = 0
_inits = 0

for _name, _value in vars(fake_nvml).items():
    if _name.startswith(("NVML_", "nvmlEventType")):
        globals()[_name] = _value


def _script() -> dict[str, Any]:
    path = os.environ.get("FAKE_NVML_SCRIPT", "")
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}  # being rewritten: the next call reads it again
    return data if isinstance(data, dict) else {}


def _children_running_fake_server() -> list[int]:
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != me:
                continue
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if SERVER_MARK in cmdline:  # a zombie has an empty cmdline: it has left the GPU
            out.append(int(entry))
    return out


def _sync() -> None:
    """Bring the fake in line with the script file."""
    global _xids_delivered
    script = _script()
    gpu = _FAKE.gpus[0]
    _FAKE.lost = bool(script.get("lost", False))
    for key, value in (script.get("values") or {}).items():
        gpu.values[key] = value
    procs = [(int(p), None if b is None else int(b)) for p, b in script.get("processes", [])]
    if script.get("server_on_gpu"):
        procs += [(pid, SERVER_BYTES) for pid in _children_running_fake_server()]
    gpu.values["processes"] = procs
    xids = [int(x) for x in script.get("xids", [])]
    for x in xids[_xids_delivered:]:
        _FAKE.push_xid(x)
    _xids_delivered = max(_xids_delivered, len(xids))


def _write_state() -> None:
    path = os.environ.get("FAKE_NVML_STATE", "")
    if not path:
        return
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps({"initialised": _FAKE.initialised, "inits": _inits, "shutdowns": _shutdowns,
                               "time": time.time()}))
    os.replace(tmp, path)


def _wrap(name: str) -> Any:
    method = getattr(_FAKE, name)

    def call(*args: Any) -> Any:
        global _inits, _shutdowns
        if name == "nvmlEventSetWait_v2":
            # The fake answers Timeout at once; wait like NVML does (bounded) so the waiter thread
            # does not spin.
            with _LOCK:
                _sync()
                idle = not _FAKE.xids and not _FAKE.lost
            if idle:
                time.sleep(min(int(args[1]), 100) / 1000.0)
        with _LOCK:
            _sync()
            result = method(*args)
            if name == "nvmlInit":
                _inits += 1
                _write_state()
            elif name == "nvmlShutdown":
                _shutdowns += 1
                _write_state()
            return result

    call.__name__ = name
    return call


for _name in dir(_FAKE):
    if _name.startswith("nvml") and callable(getattr(_FAKE, _name)):
        globals()[_name] = _wrap(_name)
