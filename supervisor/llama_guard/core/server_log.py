"""Classification of llama-server's log lines into failure families.

One ordered table of patterns → families (facts/llama-server.md). Patterns match the text
anywhere in a line, never a position: lines come with or without the elapsed/level prefix
(``0.00.450.903 I srv ...``), with or without a ``[pid]`` prefix, and the logger's lines can
interleave with an abort's direct stderr writes inside one physical line. The first matching
row wins, so the more specific families (OOM) sit above the general ones (GPU error, boot).
Unknown lines are harmless.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass


class Family(enum.Enum):
    """What one log line says about the server."""

    HARMLESS = "harmless"
    READY_HINT = "ready_hint"          # "listening on", "model loaded": informative, not readiness
    OOM = "oom"                        # out of GPU memory, at load or at run time
    GPU_FATAL = "gpu_fatal"            # fatal GPU runtime error other than OOM
    GPU_ABORT = "gpu_abort"            # the "<file>.cu:<line>: CUDA error" abort line, message elsewhere
    BOOT_CONFIG = "boot_config"        # cannot start for a configuration reason
    LOAD_FAILED = "load_failed"        # model load failed; the cause is on another line
    GPU_UNAVAILABLE = "gpu_unavailable"  # the server found no usable GPU and falls back to the CPU
    RESOURCE_LIMIT = "resource_limit"  # an rlimit bit (memlock, threads, file descriptors)


@dataclass(frozen=True)
class LineClass:
    """The verdict on one line: its family, a short cause and, for limits, which rlimit."""

    family: Family
    cause: str = ""
    limit: str = ""


_GPU_API = r"(?:CUDA|HIP|ROCm|MUSA|SYCL)"


def _fixed(cause: str, limit: str = "") -> Callable[[re.Match[str]], tuple[str, str]]:
    return lambda _m: (cause, limit)


def _group(template: str) -> Callable[[re.Match[str]], tuple[str, str]]:
    return lambda m: (template.format(*(g.strip() for g in m.groups())), "")


_Row = tuple[re.Pattern[str], Family, Callable[[re.Match[str]], tuple[str, str]]]


def _row(pattern: str, family: Family, cause: Callable[[re.Match[str]], tuple[str, str]]) -> _Row:
    return (re.compile(pattern, re.IGNORECASE), family, cause)


F = Family
TABLE: tuple[_Row, ...] = (
    # Not failures: the server copes on its own, or a client asked for too much.
    _row(r"failed to find free space in the KV cache", F.HARMLESS, _fixed("KV cache full, batch retried")),
    _row(r"exceeds the available context size", F.HARMLESS, _fixed("client request too long")),
    # Out of memory: runtime and at load/context creation.
    _row(_GPU_API + r" error: out of memory", F.OOM, _fixed("GPU runtime out of memory")),
    _row(r"cudaMalloc failed: out of memory", F.OOM, _fixed("cudaMalloc failed: out of memory")),
    _row(r"ErrorOutOfDeviceMemory", F.OOM, _fixed("device out of memory")),
    _row(r"failed to allocate (\S+) buffer of size (\d+)", F.OOM, _group("failed to allocate {0} buffer of {1} bytes")),
    _row(r"unable to allocate (\S+) buffer", F.OOM, _group("unable to allocate {0} buffer")),
    _row(r"failed to allocate compute buffers", F.OOM, _fixed("failed to allocate compute buffers")),
    _row(r"failed to allocate buffer for kv cache", F.OOM, _fixed("failed to allocate the KV cache")),
    # Fatal GPU runtime errors other than OOM.
    _row(_GPU_API + r" error: (.+?)\s*$", F.GPU_FATAL, _group("{0}")),
    _row(r"\.cu[h]?:\d+: " + _GPU_API + r" error", F.GPU_ABORT, _fixed("GPU runtime error (abort)")),
    _row(r"ggml_cuda_compute_forward: (\S+) failed", F.GPU_ABORT, _group("{0} failed on the GPU")),
    # The GPU is silently unavailable: the server would run on the CPU.
    _row(r"failed to initialize " + _GPU_API + r": (.+?)\s*$", F.GPU_UNAVAILABLE, _group("{0}")),
    _row(r"no usable GPU found", F.GPU_UNAVAILABLE, _fixed("no usable GPU found")),
    # Resource limits.
    _row(r"failed to mlock", F.RESOURCE_LIMIT, _fixed("failed to mlock the model", "RLIMIT_MEMLOCK")),
    _row(r"RLIMIT_MEMLOCK", F.RESOURCE_LIMIT, _fixed("memlock limit too low", "RLIMIT_MEMLOCK")),
    _row(r"Resource temporarily unavailable", F.RESOURCE_LIMIT,
         _fixed("thread creation failed: Resource temporarily unavailable", "RLIMIT_NPROC")),
    _row(r"Too many open files", F.RESOURCE_LIMIT, _fixed("too many open files", "RLIMIT_NOFILE")),
    # Boot failures for a configuration reason: restarting cannot help.
    _row(r"error: invalid argument: (\S+)", F.BOOT_CONFIG, _group("llama-server rejected the argument {0}")),
    _row(r"error while handling argument \"?([^\"\s:]+)", F.BOOT_CONFIG,
         _group("llama-server rejected the argument {0}")),
    _row(r"quantized V cache requires flash_attn", F.BOOT_CONFIG,
         _fixed("quantized V cache requires flash attention (set flash_attn = 'on')")),
    _row(r"failed to open GGUF file '([^']*)' \(([^)]*)\)", F.BOOT_CONFIG, _group("cannot open model {0}: {1}")),
    _row(r"Address already in use", F.BOOT_CONFIG, _fixed("the port is already in use (Address already in use)")),
    _row(r"couldn't bind HTTP server socket", F.BOOT_CONFIG,
         _fixed("couldn't bind the HTTP server socket (port in use or address unavailable)")),
    _row(r"error loading model: (.+?)\s*$", F.BOOT_CONFIG, _group("error loading model: {0}")),
    _row(r"failed to load model '?([^'\s]*)", F.BOOT_CONFIG, _group("failed to load model {0}")),
    _row(r"failed to create_context", F.BOOT_CONFIG, _fixed("llama-server could not create a context")),
    _row(r"exiting due to model loading error", F.LOAD_FAILED, _fixed("model loading error")),
    # Progress that is informative only (readiness is /health 200).
    _row(r"listening on http|server is listening on", F.READY_HINT, _fixed("listening")),
    _row(r"model loaded", F.READY_HINT, _fixed("model loaded")),
)

_HARMLESS = LineClass(Family.HARMLESS)


def classify_line(line: str) -> LineClass:
    """The family of one llama-server log line (any prefix; trailing newline allowed)."""
    for pattern, family, cause in TABLE:
        match = pattern.search(line)
        if match:
            text, limit = cause(match)
            return LineClass(family, text, limit)
    return _HARMLESS
