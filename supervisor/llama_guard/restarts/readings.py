"""The decay monitor's readings of the serving llama-server: its anonymous memory (``/proc``), its
VRAM (from the GPU watcher's last NVML sample) and its ``/metrics`` text.

Each answers None when there is nothing to read (the process is gone, no GPU sample lists it,
the server did not answer 200); none raises for that.
"""

from __future__ import annotations

from pathlib import Path

from llama_guard.core.client import RequestFailed, ServerClient
from llama_guard.gpu.readings import GpuSample
from llama_guard.vocab.units import MIB


def read_anon_memory_mib(pid: int) -> float | None:
    """The anonymous memory of ``pid`` in MiB: ``RssAnon + VmSwap`` of ``/proc/PID/status`` (kB).

    Anonymous pages are what the server allocated (the memory-mapped model file's pages are
    file-backed, left out); swap is added because a leak the kernel paged out still leaks (a
    public report: 9.35 GiB anonymous after 5.5 h while VmRSS showed ~70 MiB). ``None`` when the
    process is gone or its status unreadable (a kernel without the fields: before Linux 4.5).
    """
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return anon_memory_mib(text)


def anon_memory_mib(status_text: str) -> float | None:
    """``RssAnon + VmSwap`` (MiB) from the text of a ``/proc/PID/status``; None without ``RssAnon``."""
    fields: dict[str, int] = {}
    for line in status_text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "VmSwap"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[key] = int(parts[0])
    if "RssAnon" not in fields:
        return None
    return (fields["RssAnon"] + fields.get("VmSwap", 0)) * 1024 / MIB


async def fetch_metrics(client: ServerClient, base_url: str, timeout_s: float) -> str | None:
    """The text of ``base_url``/metrics within ``timeout_s`` seconds; None unless answered 200."""
    try:
        resp = await client.get(f"{base_url}/metrics", timeout_s=timeout_s)
    except RequestFailed:
        return None
    return resp.text if resp.status == 200 else None


def server_vram_mib(sample: GpuSample | None, pid: int) -> float | None:
    """Server ``pid``'s VRAM (MiB) in an NVML ``sample`` (None without one), if its process list has it."""
    for proc in (sample.processes or ()) if sample is not None else ():
        if proc.pid == pid and proc.used_bytes is not None:
            return proc.used_bytes / MIB
    return None
