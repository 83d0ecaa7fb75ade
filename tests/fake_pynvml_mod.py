"""A module-level fake ``pynvml`` for the daemon SUBPROCESS, injected by tests/run_with_fake_nvml.py.

It wraps one :class:`fake_nvml.FakeNvml` and is scripted by the JSON file named in
``$FAKE_NVML_SCRIPT``, re-read on every call, so a test can change it while the daemon runs:

* ``"lost": true`` — every device call raises GpuIsLost (15) until it is false again;
* ``"processes": [[pid, bytes], ...]`` — compute processes on the GPU (e.g. a foreign one);
  ``[pid, bytes, release_s]`` is one that behaves like a real CUDA process: listed, with its bytes
  added to ``memory_used``, while it runs and for ``release_s`` seconds after it exited (a zombie
  counts as exited; the driver takes that long to free its memory), then gone with its memory;
* ``"fail": {"nvmlDeviceGetMemoryInfo": 7, ...}`` — those calls raise that NVML code while listed;
* ``"call_s": 0.02`` — every NVML call takes that long (a real driver's call is no instant);
* ``"server_on_gpu": true`` — also list every CHILD of this (the daemon's) process whose
  ``/proc/<pid>/cmdline`` names ``fake_llama_server.py``, so ``ready_check`` sees the server on the GPU;
* ``"xids": [79, ...]`` — Xid events, delivered once each (the list only grows);
* ``"values": {...}`` — readings of :data:`fake_nvml.DEFAULTS` to override (memory_used ...).

NVML's session state (initialised or not, init/shutdown counts) is written to ``$FAKE_NVML_STATE``
after every init/shutdown, so a stub reset command can tell whether our NVML session was released.
Every call (a failing one too) is counted by name; the counts are written to ``$FAKE_NVML_CALLS`` (JSON)
after each call when set, so a test can wait for the daemon to have looked again (a positive marker).
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


_exited_at: dict[int, float] = {}
_scripted_fails: set[str] = set()


def _releasing(pid: int, release_s: float) -> bool:
    """Whether a real process ``pid`` is still on the GPU: running, or exited less than ``release_s`` ago."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        state = "X"
    if state not in ("Z", "X"):
        return True
    gone = _exited_at.setdefault(pid, time.monotonic())
    return time.monotonic() - gone < release_s


def _sync() -> None:
    """Bring the fake in line with the script file."""
    global _xids_delivered
    script = _script()
    gpu = _FAKE.gpus[0]
    _FAKE.lost = bool(script.get("lost", False))
    for key, value in (script.get("values") or {}).items():
        gpu.values[key] = value
    procs = []
    base_used = (script.get("values") or {}).get("memory_used", fake_nvml.DEFAULTS["memory_used"])
    gpu.values["memory_used"] = base_used
    for entry in script.get("processes", []):
        pid, used = int(entry[0]), None if entry[1] is None else int(entry[1])
        if len(entry) > 2:  # a real process: its memory is freed release_s after it exited
            if not _releasing(pid, float(entry[2])):
                continue
            gpu.values["memory_used"] = int(gpu.values["memory_used"]) + (used or 0)
        procs.append((pid, used))
    if script.get("server_on_gpu"):
        procs += [(pid, SERVER_BYTES) for pid in _children_running_fake_server()]
    gpu.values["processes"] = procs
    fails = {str(call): int(code) for call, code in (script.get("fail") or {}).items()}
    for call in _scripted_fails - set(fails):
        _FAKE.heal(call)
    for call, code in fails.items():
        _FAKE.fail(call, code)
    _scripted_fails.clear()
    _scripted_fails.update(fails)
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


def _write_calls() -> None:
    path = os.environ.get("FAKE_NVML_CALLS", "")
    if not path:
        return
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(dict(_FAKE.calls)))
    os.replace(tmp, path)


def _wrap(name: str) -> Any:
    method = getattr(_FAKE, name)

    def call(*args: Any) -> Any:
        global _inits, _shutdowns
        if name == "nvmlEventSetWait_v2":
            # The fake answers Timeout at once; block like NVML does: up to the timeout (1 s from
            # the Xid waiter), returning early when an Xid is due or the GPU is lost.
            until = time.monotonic() + int(args[1]) / 1000.0
            while True:
                with _LOCK:
                    _sync()
                    idle = not _FAKE.xids and not _FAKE.lost
                if not idle or time.monotonic() >= until:
                    break
                time.sleep(0.05)
        else:
            time.sleep(float(_script().get("call_s", 0.0)))
        with _LOCK:
            _sync()
            try:
                result = method(*args)
            finally:
                _write_calls()
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
